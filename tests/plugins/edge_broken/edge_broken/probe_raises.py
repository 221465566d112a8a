"""Its probe raises."""

from edge_core import hookimpl

EDGE_API_VERSION = 1


@hookimpl
def probe_devices(host):
    raise RuntimeError("the fake driver crashed while probing")
