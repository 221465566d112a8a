"""The backend authors' guide and the tests keep up with the hookspecs (datasette's meta-tests).

* every hookspec's signature, as ``inspect`` renders it, appears verbatim in
  docs/writing-a-backend.md;
* every hook has a test *named for it* (``def test_hook_<name>...``) in the
  core's or a backend's tests;
* the registry's two dispatch lists name every hookspec exactly once.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from edge_core import hookspecs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "writing-a-backend.md"
TESTS = Path(__file__).resolve().parent
#: Where tests live: the core's and every in-tree backend's and example's.
#: The conformance suite counts: every backend's tests run its checks.
TEST_FILES = sorted([*TESTS.glob("test_*.py"), *ROOT.glob("plugins/*/tests/test_*.py"),
                     *ROOT.glob("examples/*/tests/test_*.py"), ROOT / "edge_core" / "testing" / "conformance.py"])


def hook_names(module=hookspecs) -> list[str]:
    """Every function the module marks as an edge hookspec."""
    marker = f"{hookspecs.PROJECT}_spec"
    return sorted(name for name, value in vars(module).items() if callable(value) and hasattr(value, marker))


def rendered_signature(function) -> str:
    """``name(arg: Type, ...) -> Result`` as inspect renders it, without the quotes of string annotations."""
    return function.__name__ + str(inspect.signature(function)).replace("'", "").replace('"', "")


def undocumented(names: list[str], module, text: str) -> list[str]:
    return [rendered_signature(getattr(module, name)) for name in names
            if rendered_signature(getattr(module, name)) not in text]


def untested(names: list[str], texts: list[str]) -> list[str]:
    """Hooks no test function is named for (``def test_hook_<name>`` or ``def test_hook_<name>_...``)."""
    return [name for name in names
            if not any(re.search(rf"^\s*def test_hook_{re.escape(name)}(_\w*)?\(", text, re.M) for text in texts)]


def test_the_six_product_hooks_are_specs():
    names = hook_names()
    for required in ("probe_devices", "weight_formats", "reserve_memory", "start_stage", "stream", "cancel"):
        assert required in names


def test_rendering_strips_string_annotations():
    assert rendered_signature(hookspecs.cancel) == "cancel(stage: Any, request_id: str) -> bool | None"


@pytest.mark.parametrize("name", hook_names())
def test_every_hook_signature_is_in_the_backend_guide(name):
    signature = rendered_signature(getattr(hookspecs, name))
    assert signature in DOCS.read_text(encoding="utf-8"), (
        f"docs/writing-a-backend.md does not show `{signature}`; add (or update) that hook's section"
    )


def test_every_hook_has_a_test_named_for_it():
    texts = [path.read_text(encoding="utf-8") for path in TEST_FILES if path.name != Path(__file__).name]
    missing = untested(hook_names(), texts)
    assert not missing, f"no test is named test_hook_<name> for {missing}; add one that exercises each"


def test_dispatch_lists_cover_every_hook_once():
    listed = list(hookspecs.BROADCAST_HOOKS) + list(hookspecs.OWNER_HOOKS)
    assert sorted(listed) == hook_names(), "BROADCAST_HOOKS + OWNER_HOOKS must name every hookspec exactly once"


def test_the_checks_catch_a_new_undocumented_untested_hook():
    """The two meta-checks fail for a hook added to the specs and nowhere else."""
    import types

    module = types.ModuleType("specs")
    module.__dict__["PROJECT"] = hookspecs.PROJECT

    @hookspecs.hookspec
    def kernel_sizes(device: Device) -> list[int] | None:  # noqa: F821 - a string annotation
        """A hook nobody documented."""

    module.kernel_sizes = kernel_sizes
    assert hook_names(module) == ["kernel_sizes"]
    assert undocumented(["kernel_sizes"], module, DOCS.read_text(encoding="utf-8")) == [
        "kernel_sizes(device: Device) -> list[int] | None"
    ]
    assert untested(["kernel_sizes"], ["def test_other(): probe_devices"]) == ["kernel_sizes"]
    assert untested(["kernel_sizes"], ["registry.call_owner(device, 'kernel_sizes')"]) == ["kernel_sizes"]
    assert untested(["kernel_sizes"], ["def test_hook_kernel_sizes_sorted():"]) == []
