"""A vLLM package tree of the 0.32 shape, cut to the lines :mod:`edge_core.kit.vllm_source` reads.

For testing a gate that reads the installed vLLM's model registry and model
classes (:func:`edge_core.kit.vllm_hooks.pipeline_refusals`) without vLLM
installed: write the tree, then point the gate at it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

#: The tree, cut to the lines the reader looks at: interface protocols in
#: interfaces.py, a class listing SupportsPP (llama), one inheriting it from another module (mistral),
#: one whose bases never list it (nopp, through a base of its own module), one that does not parse.
FAKE_VLLM_MODELS = {
    "registry.py": """
_TEXT_GENERATION_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "NoPPForCausalLM": ("nopp", "NoPPForCausalLM"),
    "BrokenForCausalLM": ("broken", "BrokenForCausalLM"),
    "ElsewhereForCausalLM": ("elsewhere", "ElsewhereForCausalLM"),
}
_MULTIMODAL_MODELS = {}
_VLLM_MODELS = {**_TEXT_GENERATION_MODELS, **_MULTIMODAL_MODELS}
""",
    "interfaces.py": """
from typing import Protocol
class SupportsPP(Protocol):
    supports_pp = True
class SupportsLoRA(Protocol):
    supports_lora = True
class HasInnerState(Protocol):
    has_inner_state = True
""",
    "llama.py": """
from torch import nn
from .interfaces import SupportsLoRA, SupportsPP
class LlamaForCausalLM(nn.Module, SupportsLoRA, SupportsPP):
    pass
""",
    "mistral.py": """
from .llama import LlamaForCausalLM
class MistralForCausalLM(LlamaForCausalLM):
    pass
""",
    "nopp.py": """
from torch import nn
from .interfaces import HasInnerState, SupportsLoRA
class _NoPPBase(nn.Module, SupportsLoRA):
    pass
class NoPPForCausalLM(_NoPPBase, HasInnerState):
    pass
""",
    "broken.py": "class BrokenForCausalLM(\n",
    "elsewhere.py": """
from vllm.model_executor.models.missing import MissingBase
class ElsewhereForCausalLM(MissingBase):
    pass
""",
}


def write_fake_vllm_models(root: Path) -> Path:
    """Write :data:`FAKE_VLLM_MODELS` under ``root/model_executor/models``; returns ``root`` (the package dir)."""
    for name, text in FAKE_VLLM_MODELS.items():
        path = Path(root) / "model_executor" / "models" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return Path(root)
