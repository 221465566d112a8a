"""Run a function on a vLLM module once it is imported, without importing vLLM (edge-cpu's general plugins).

vLLM loads its general plugins in every process it starts, before its worker
modules are imported (and in the API server, which never imports them), so a
plugin that patches a worker class waits for the module on ``sys.meta_path``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``module`` is imported, calls ``then(module)`` once the module has run.

    ``then`` returns False when it found nothing to patch (logged at debug level).
    """

    def __init__(self, module: str, then: Callable[[Any], bool]) -> None:
        self.module, self.then = module, then

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.module:
            return None
        sys.meta_path.remove(self)  # once, and so that the lookup below finds the real module
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        execute = getattr(loader, "exec_module", None)
        if execute is None:
            return spec
        then = self.then

        def exec_module(module: Any) -> None:
            execute(module)
            if not then(module):
                log.debug("edge-cpu: nothing to patch in %s", name)

        setattr(loader, "exec_module", exec_module)  # noqa: B010 - this spec's own loader, not its class
        return spec


def after_import(module: str, then: Callable[[Any], bool]) -> None:
    """``then(module)`` now if ``module`` is imported, else when it is (one finder per ``module`` and ``then``)."""
    if module in sys.modules:
        then(sys.modules[module])
    elif not any(isinstance(finder, AfterImport) and finder.module == module and finder.then is then
                 for finder in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(module, then))
