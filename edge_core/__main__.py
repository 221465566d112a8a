"""``python -m edge_core`` is the ``edge`` command."""

from .cli import console_main

raise SystemExit(console_main())
