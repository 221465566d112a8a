"""Lets `pytest examples/edge_transformers/tests` run from a checkout without installing the example.

When edge-transformers is installed (as `nox -s example` installs it, from a
wheel) the installed copy is the one under test.
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("edge_transformers") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
