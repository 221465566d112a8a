"""How published configs spell each geometry field, and reading one with a named refusal.

The alias groups are what the KV arithmetic and the family rules read; a
field that is missing or garbled is ``config_unreadable`` naming the field,
and when transformers could have filled it, the remedy says to install it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ArtifactError
from .transformers_source import transformers_installed

# How published configs spell the geometry the KV arithmetic (plan/kv/) reads;
# the first name of each group is transformers' canonical one.
LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
ATTENTION_HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
KV_HEAD_FIELDS = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
HIDDEN_FIELDS = ("hidden_size", "n_embd", "d_model")
HEAD_DIM_FIELDS = ("head_dim", "kv_channels")
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
#: Every per-layer pattern vocabulary the installed vLLM and transformers read
#: (.families says which family reads which); any one of them states the pattern.
LAYER_PATTERN_FIELDS = ("layer_types", "layers_block_type", "hybrid_override_pattern", "full_attention_interval",
                        "sliding_window_pattern", "attn_layer_indices", "attn_layer_period", "attn_type_list",
                        "full_attn_idxs", "no_rope_layers")

#: Fields a configuration class's defaults may fill, as alias groups (filled
#: under the first name, and only when no name of the group is set). The layer
#: count and hidden size are not among them: they are the checkpoint's shape,
#: and a library default (``LlamaConfig`` says 32 layers for every Llama) would
#: plan a model the weights do not describe -- a missing one stays a refusal.
DEFAULTABLE_FIELDS: tuple[tuple[str, ...], ...] = (
    ATTENTION_HEAD_FIELDS, KV_HEAD_FIELDS, HEAD_DIM_FIELDS, CONTEXT_FIELDS,
    LAYER_PATTERN_FIELDS, ("sliding_window",), ("attention_chunk_size",),
    ("intermediate_size",), ("vocab_size",),
    ("kv_lora_rank",), ("qk_rope_head_dim",),
    ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"), ("mamba_d_head", "mamba_head_dim", "mamba_headdim"),
    ("mamba_d_state", "ssm_state_size", "state_size"), ("mamba_d_conv", "conv_kernel"),
    ("mamba_n_groups", "n_groups", "mamba_ngroups"), ("mamba_expand", "expand"), ("mamba_d_ssm",),
    ("linear_num_key_heads",), ("linear_num_value_heads",), ("linear_key_head_dim",), ("linear_value_head_dim",),
    ("linear_conv_kernel_dim",), ("conv_L_cache",),
)

#: What a missing field's refusal adds when transformers is absent.
DEFAULTS_REMEDY = ("or install transformers in this venv (pip install transformers): edge then fills the fields "
                   "a config leaves to its library's defaults from the source of transformers' configuration "
                   "class for its model_type (read, not imported: no model code, no trust_remote_code)")

#: What every ``config_unreadable`` from a geometry field tells the user to do.
REMEDY = ("check the checkpoint's config.json (or its text_config) against the model card; "
          "re-download it if it is truncated or hand-edited")


def is_set(config: dict[str, Any], names: tuple[str, ...]) -> bool:
    """Whether the config sets any of ``names`` (a null counts as unset, as vLLM and the KV arithmetic read it)."""
    return any(config.get(name) is not None for name in names)


def defaults_remedy(name: str) -> str | None:
    """The install hint for a missing field edge could fill from transformers, when transformers is absent."""
    fillable = any(name in group for group in DEFAULTABLE_FIELDS)
    return DEFAULTS_REMEDY if fillable and not transformers_installed() else None


def unreadable(message: str, missing: str | None = None) -> ArtifactError:
    """``config_unreadable`` with :data:`REMEDY`, plus the install hint when ``missing`` is fillable."""
    remedy = REMEDY
    hint = defaults_remedy(missing) if missing is not None else None
    if hint is not None:
        remedy = f"{remedy}; {hint}"
    return ArtifactError("config_unreadable", message, remedy)


def opt_int(config: Mapping[str, Any], names: tuple[str, ...], *, minimum: int = 1) -> int | None:
    """The first of ``names`` the config sets (a null counts as unset), or None."""
    for name in names:
        value = config.get(name)
        if value is None:
            continue
        # bool is an int subclass; "true" layers is a broken config, not 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise unreadable(f"config field {name!r} must be an integer, got {value!r}")
        if value < minimum:
            raise unreadable(f"config field {name!r} must be >= {minimum}, got {value}")
        return value
    return None


def req_int(config: Mapping[str, Any], names: tuple[str, ...], *, minimum: int = 1, what: str = "") -> int:
    """The first of ``names`` the config sets; ``config_unreadable`` when none does."""
    value = opt_int(config, names, minimum=minimum)
    if value is None:
        label = f" ({what})" if what else ""
        raise unreadable(f"config has no {' / '.join(repr(n) for n in names)}{label}", missing=names[0])
    return value


def window_tokens(config: Mapping[str, Any], name: str = "sliding_window") -> int | None:
    """A window or chunk in tokens; 0 means none (vLLM's config/model.py reads it so too)."""
    value = config.get(name)
    if value is None or value == 0:
        return None
    return req_int(config, (name,))
