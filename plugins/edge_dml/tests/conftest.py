"""Lets `pytest plugins/edge_dml/tests` run from a checkout without installing edge-dml.

When the package is installed (as the noxfile installs it, from a wheel) the
installed copy is the one under test; the source tree is only a fallback.
"""

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.find_spec("edge_dml")
# origin None: only the checkout's plugins/edge_dml directory was found, as a namespace package.
if _spec is None or _spec.origin is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
