"""Written for an API version this core does not implement."""

from edge_core import hookimpl

EDGE_API_VERSION = 0


@hookimpl
def probe_devices(host):
    return []
