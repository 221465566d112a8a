"""Fails at import, like a backend whose vendor library is missing."""

import edge_vendor_library_that_does_not_exist  # noqa: F401
