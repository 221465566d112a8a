"""Lets edge-cpu's tests use the checkout's checkpoint factories (tests/factories.py) when run on their own.

``pytest tests plugins/edge_cpu/tests`` (as nox runs them) already has
``tests/`` on the path through its conftest; ``pytest plugins/edge_cpu/tests``
alone does not.
"""

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[3] / "tests"
if (_TESTS / "factories.py").is_file() and str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))
