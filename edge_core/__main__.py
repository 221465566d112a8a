"""``python -m edge_core`` is the ``edge`` command."""

from .cli import main

raise SystemExit(main())
