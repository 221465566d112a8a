"""Run a patch on a module of vLLM's the moment it is imported, without importing it (for edge-cpu's vLLM plugins).

vLLM loads its general plugins in every process it starts before any model
code runs, and ``import vllm`` must not happen on edge's planning path, so a
plugin that changes what a vLLM module does waits for that module: an
:class:`AfterImport` finder on ``sys.meta_path`` finds nothing itself, lets the
real finder locate the module, and calls ``patch(module)`` once the module's
code has run. :func:`patch_on_import` patches at once where the module is
already imported.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: A patch: changes the imported module, returns False when it found nothing to change.
Patch = Callable[[Any], bool]


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``module`` is imported, calls ``patch`` on it once its code has run."""

    def __init__(self, module: str, patch: Patch) -> None:
        self.module, self.patch = module, patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.module:
            return None
        sys.meta_path.remove(self)  # once, and so that the lookup below finds the real module
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        execute = getattr(loader, "exec_module", None)
        if execute is None:
            return spec

        def exec_module(module: Any) -> None:
            execute(module)
            if not self.patch(module):
                log.debug("edge-cpu: %s has nothing for %s to patch", self.module, self.patch)

        setattr(loader, "exec_module", exec_module)  # noqa: B010 - this spec's own loader, not its class
        return spec


def wrap_once(owner: Any, name: str, mark: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``owner.<name>`` by ``wrap(original)``, keeping its name and docstring and carrying ``mark``, once:
    a function that already carries ``mark`` is left as it is. False when ``owner`` has no such function."""
    original = getattr(owner, name, None)
    if original is None:
        return False
    if not getattr(original, mark, False):
        wrapped = functools.wraps(original)(wrap(original))
        setattr(wrapped, mark, True)
        setattr(owner, name, wrapped)
    return True


def _key(patch: Patch) -> Any:
    return getattr(patch, "func", patch)  # a functools.partial is the same patch whatever its arguments


def patch_on_import(module: str, patch: Patch, finder: type[AfterImport] = AfterImport) -> None:
    """Patch ``module`` now if it is imported, else when it is (one finder per module and patch)."""
    if module in sys.modules:
        patch(sys.modules[module])
    elif not any(isinstance(f, finder) and f.module == module and _key(f.patch) == _key(patch) for f in sys.meta_path):
        sys.meta_path.insert(0, finder(module, patch))
