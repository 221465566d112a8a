"""The engine phase's sharing works: tests in one ``xdist_group`` run on one worker, so a session fixture
that starts an engine (conftest's ``demo_server``, ``demo_run``) starts it once.

xdist's ``loadgroup`` marks a test's group by suffixing its node id; pytest 9.2 keeps the id where that
suffix no longer lands, and the groups then scatter without a word (hence ``pytest<9.2`` in the noxfile).
This runs a two-file suite the way ``nox -s cpu`` runs its engine phase and counts the fixture's setups.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="needs pytest-xdist")

CONFTEST = """
import os
import pytest

@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    with open(os.environ["SETUPS"], "a") as log:
        log.write(f"{os.getpid()}\\n")
    return object()
"""
FIRST = """
import pytest

class TestFirst:
    def test_unrelated(self):
        pass

    @pytest.mark.xdist_group("engine")
    def test_reads_the_engine(self, engine):
        pass
"""
SECOND = """
import pytest

class TestSecond:
    pytestmark = [pytest.mark.xdist_group("engine")]

    def test_reads_it_again(self, engine):
        pass

    def test_and_again(self, engine):
        pass
"""


def test_one_group_one_worker_one_setup(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    for name, text in {"conftest.py": CONFTEST, "test_first.py": FIRST, "test_second.py": SECOND}.items():
        (suite / name).write_text(textwrap.dedent(text))
    setups = tmp_path / "setups"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadgroup", str(suite)], cwd=suite, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "SETUPS": str(setups)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "4 passed" in done.stdout
    assert len(setups.read_text().split()) == 1, "the group's tests ran on more than one worker"
