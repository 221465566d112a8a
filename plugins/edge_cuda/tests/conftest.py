"""Lets `pytest plugins/edge_cuda/tests` run from a checkout without installing edge-cuda.

When the package is installed (as the noxfile installs it, from a wheel) the
installed copy is the one under test; the source tree is only a fallback. The
checkout's checkpoint factories (``tests/factories.py``) are put on the path
too, as ``pytest tests plugins/edge_cuda/tests`` (how nox runs them) already has.
"""

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.find_spec("edge_cuda")
# origin None: only the checkout's plugins/edge_cuda directory was found, as a namespace package.
if _spec is None or _spec.origin is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_TESTS = Path(__file__).resolve().parents[3] / "tests"
if (_TESTS / "factories.py").is_file() and str(_TESTS) not in sys.path:
    sys.path.append(str(_TESTS))
