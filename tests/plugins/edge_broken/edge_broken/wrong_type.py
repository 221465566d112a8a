"""Its probe returns dicts instead of Device records."""

from edge_core import hookimpl

EDGE_API_VERSION = 1


@hookimpl
def probe_devices(host):
    return [{"device_id": "npu:wrong", "kind": "npu"}]
