"""The engine phase's sharing works: tests that read one engine run on one xdist worker, so the engine starts once.

``nox -s cpu`` runs the engine tests on two workers with ``--dist loadgroup``. A test joins a group
two ways: by naming it (``pytest.mark.xdist_group``, as the suite's shared ``demo_server`` and
``demo_run`` readers do) or, for tests reading a module- or class-scoped engine, from
tests/engine_groups.py's hook. Two ways this broke without a word, each checked here by running a
small suite the way the engine phase does and counting each fixture's setups:

* pytest 9.2 keeps a node's id where xdist 3.8 can no longer suffix it with ``@group``: no group
  held (hence ``pytest<9.2`` in the noxfile);
* a group set in ``pytest_collection_modifyitems`` after xdist's own hook has read the groups
  is ignored (hence ``tryfirst`` there).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="needs pytest-xdist")

HERE = Path(__file__).resolve().parent

CONFTEST = """
import os
import pytest
from engine_groups import pytest_collection_modifyitems  # the suite's own hook

def pytest_configure(config):
    config.addinivalue_line("markers", "engine: starts an engine")

def setup(name):
    with open(os.environ["SETUPS"], "a") as log:
        log.write(f"{name} {os.getpid()}\\n")
    return object()

@pytest.fixture(scope="session")
def shared_engine():
    return setup("session")
"""
NAMED_FIRST = """
import pytest

class TestFirst:
    def test_unrelated(self):
        pass

    @pytest.mark.xdist_group("shared")
    def test_reads_the_engine(self, shared_engine):
        pass
"""
NAMED_SECOND = """
import pytest

class TestSecond:
    pytestmark = [pytest.mark.xdist_group("shared")]

    def test_reads_it_again(self, shared_engine):
        pass

    def test_and_again(self, shared_engine):
        pass
"""
MODULE_ENGINE = """
import pytest
from conftest import setup

pytestmark = pytest.mark.engine

@pytest.fixture(scope="module")
def module_engine():
    return setup("module")

def test_one(module_engine):
    pass

def test_two(module_engine):
    pass

def test_three(module_engine):
    pass

def test_four(module_engine):
    pass
"""
BYSTANDERS = "\n".join(f"def test_bystander_{n}():\n    pass\n" for n in range(8))


def test_one_group_one_worker_one_setup(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    files = {"conftest.py": CONFTEST, "test_first.py": NAMED_FIRST, "test_second.py": NAMED_SECOND,
             "test_module_engine.py": MODULE_ENGINE, "test_bystanders.py": BYSTANDERS}
    for name, text in files.items():
        (suite / name).write_text(textwrap.dedent(text))
    setups = tmp_path / "setups"
    env = {**os.environ, "SETUPS": str(setups),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadgroup", str(suite)], cwd=suite, capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "16 passed" in done.stdout, done.stdout[-2000:]
    names = [line.split()[0] for line in setups.read_text().splitlines()]
    assert sorted(names) == ["module", "session"], f"a group's tests ran on more than one worker: {names}"
