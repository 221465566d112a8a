"""How many bytes of KV cache a text model needs, and how long a context fits a budget.

Input is a model's *text* config as a plain dict (``config.json``, with a
multimodal wrapper's ``text_config`` already resolved by the caller); nothing
is imported from transformers. :func:`kv_layout` classifies every layer
(full, MLA, sliding window, chunked local, recurrent state, none) from
whichever per-layer vocabulary the model family publishes (``layer_types``,
``layers_block_type``, ``hybrid_override_pattern``, ``full_attention_interval``,
``sliding_window_pattern``, ``attn_layer_indices``, ...); :func:`estimate_kv`
charges a session three ways, side by side:

* ``flat`` — every attention layer holds every token (the naive figure);
* ``by_layer_type`` — a sliding layer holds its window, a chunked layer its
  chunk (SPEC section 6's hybrid reference figure);
* ``vllm`` — what vLLM's own allocator reserves (in-flight tokens, whole
  blocks, group padding, the null block; for hybrids the enlarged attention
  block and the state blocks prefix caching keeps), so the planner can hand
  vLLM a ``kv_cache_memory_bytes`` it will accept.

Recurrent (Mamba, linear-attention, short-conv) state is per sequence, not per
token, and is added to all three totals. :func:`max_model_len_for` inverts a
rule: the longest context whose charge fits a byte budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..artifact.config import (
    ATTENTION_HEAD_FIELDS,
    CONTEXT_FIELDS,
    HEAD_DIM_FIELDS,
    HIDDEN_FIELDS,
    KV_HEAD_FIELDS,
    LAYER_COUNT_FIELDS,
    defaults_remedy,
)
from ..errors import ArtifactError, UsageError

#: Layer kinds. ``mla`` is full attention over a compressed latent (one
#: "head" of kv_lora_rank + qk_rope_head_dim elements, not doubled for K/V).
LAYER_KINDS = ("full", "mla", "sliding", "chunked", "recurrent", "none")

#: Charging rules, in the order :class:`KVEstimate` reports them.
RULES = ("flat", "by_layer_type", "vllm")

#: Bytes per element for the dtypes a KV cache or model is stored in.
#: ``auto`` as a KV dtype means the model dtype (vLLM's meaning too).
DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "half": 2, "fp16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1,
}

#: Ceiling for :func:`max_model_len_for` when the config names no context
#: length: a model with no full-attention layer charges a constant beyond its
#: window, so the search needs an upper end. 16 Mi tokens is past any
#: published context length.
DEFAULT_CEILING_TOKENS = 1 << 24

#: The SSM (temporal) state dtype vLLM CPU 0.32 ends up with when the user
#: names none (D, read from the source): ``platforms/cpu.py``
#: ``check_and_update_config`` resets ``mamba_ssm_cache_dtype`` to float32 on
#: every AVX512-BF16 host unless an accelerated-GDN model asked for fp16/bf16;
#: NemotronH sets float32 on every platform (``models/config.py``). The conv
#: state stays in ``mamba_cache_dtype`` (auto: the model dtype). On a host
#: without AVX512-BF16 vLLM keeps the model dtype, so float32 over-reserves
#: there (safe); pass ``mamba_ssm_cache_dtype="auto"`` for vLLM's CUDA default.
DEFAULT_MAMBA_SSM_CACHE_DTYPE = "float32"

#: NemotronHForCausalLMConfig.DEFAULT_MAMBA_SSM_CACHE_DTYPE (models/config.py):
#: the SSM dtype vLLM gives a NemotronH whose config names none, on every platform.
NEMOTRON_H_SSM_CACHE_DTYPE = "float32"

#: vLLM CPU's attention backend takes blocks that are a multiple of 32 tokens
#: (``CPUAttentionBackend.get_supported_kernel_block_sizes``: ``MultipleOf(32)``);
#: a hybrid's enlarged block is rounded to it.
CPU_ATTN_KERNEL_BLOCK_TOKENS = 32

#: ``_align_hybrid_block_size`` keeps an MLA hybrid's block a multiple of 128
#: tokens (TRTLLM/FlashInfer MLA kernels), whatever the backend's own minimum.
MLA_HYBRID_BLOCK_ALIGN_TOKENS = 128

# Per-layer type names seen in published configs and in transformers 5, which
# remaps legacy names ("mamba" -> "linear_attention", "attention" ->
# "full_attention": configuration_utils._LEGACY_LAYER_TYPE_REMAP) -- so
# "linear_attention" is a Mamba mixer in Granite/Jamba/Bamba/NemotronH/Zamba2
# and a gated-DeltaNet or lightning layer elsewhere; _state_formula decides.
_FULL_NAMES = frozenset({"full_attention", "attention", "global_attention", "global", "full"})
_SLIDING_NAMES = frozenset({"sliding_attention", "sliding_window", "local_attention", "local",
                            "sliding", "window_attention"})
_CHUNKED_NAMES = frozenset({"chunked_attention"})
_RECURRENT_NAMES = frozenset({"mamba", "mamba2", "linear_attention", "conv", "ssm", "recurrent"})
#: Falcon-H1 and Zamba/Zamba2 run attention and a Mamba-2 mixer in one layer.
_HYBRID_NAMES = frozenset({"hybrid"})
_NONE_NAMES = frozenset({"mlp", "moe", "none", "dense", "ffn"})

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

_REMEDY = ("check the checkpoint's config.json (or its text_config) against the model card; "
           "re-download it if it is truncated or hand-edited")


@dataclass(frozen=True)
class LayerKV:
    """What one decoder layer keeps per sequence.

    ``elements_per_token`` counts cached elements per token (K and V together;
    the latent for MLA), 0 for recurrent and ``none`` layers.
    ``window_tokens`` is the sliding window or attention chunk, else None.
    ``state_elements`` is the recurrent state per sequence, else 0; of it,
    ``ssm_state_elements`` is the part vLLM stores in ``mamba_ssm_cache_dtype``
    (the SSM / delta-rule state), the rest (conv state, a lightning or
    short-conv state) in ``mamba_cache_dtype``. ``state_formula`` names the
    shape rule (``mamba1``, ``mamba2``, ``gated_deltanet``, ...).
    """

    index: int
    kind: str
    elements_per_token: int = 0
    window_tokens: int | None = None
    state_elements: int = 0
    ssm_state_elements: int = 0
    state_formula: str = ""

    @property
    def attention(self) -> bool:
        return self.kind in ("full", "mla", "sliding", "chunked")

    def state_bytes(self, cache_dtype_bytes: int, ssm_dtype_bytes: int) -> int:
        """This layer's state per sequence: the SSM part in its dtype, the rest in the cache dtype."""
        return ((self.state_elements - self.ssm_state_elements) * cache_dtype_bytes
                + self.ssm_state_elements * ssm_dtype_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "elements_per_token": self.elements_per_token,
            "window_tokens": self.window_tokens,
            "state_elements": self.state_elements,
            "ssm_state_elements": self.ssm_state_elements,
            "state_formula": self.state_formula,
        }


@dataclass(frozen=True)
class KVLayout:
    """Every layer's KV shape, read from a text config.

    ``num_kv_heads`` x ``head_dim`` is one of K or V per token per layer
    (MLA: 1 x (kv_lora_rank + qk_rope_head_dim)). ``source`` says which config
    fields decided the layer kinds; ``evidence`` is ``D`` when the config
    states them (``layer_types``, or plain full attention) and ``E`` when edge
    inferred them from an architecture rule or estimated recurrent state.
    """

    layers: tuple[LayerKV, ...]
    num_kv_heads: int
    head_dim: int
    mla: bool
    source: str
    evidence: str
    notes: tuple[str, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def counts(self) -> dict[str, int]:
        """Layers per kind, every kind present (zeros included)."""
        out = {kind: 0 for kind in LAYER_KINDS}
        for layer in self.layers:
            out[layer.kind] += 1
        return out

    def windows_tokens(self) -> tuple[int, ...]:
        """Distinct sliding windows / chunks, ascending."""
        return tuple(sorted({l.window_tokens for l in self.layers if l.window_tokens}))

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "mla": self.mla,
            "layer_counts": self.counts(),
            "windows_tokens": list(self.windows_tokens()),
            "layer_kinds": [l.kind for l in self.layers],
            "elements_per_token_per_layer": max(
                (l.elements_per_token for l in self.layers), default=0),
            "state_elements_per_layer": max((l.state_elements for l in self.layers), default=0),
            "state_layers": sum(1 for l in self.layers if l.state_elements),
            "source": self.source,
            "evidence": self.evidence,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class KVEstimate:
    """A session's KV charge under each rule, in bytes, with how each was computed.

    Every ``bytes_*`` total covers ``max_num_seqs`` sequences of
    ``max_model_len`` tokens and includes ``recurrent_state_bytes`` (one
    state per sequence; the ``vllm`` rule charges vLLM's state blocks).
    ``bytes_per_token_flat`` is one token of one sequence in every attention
    layer. ``block_size`` is the attention block vLLM will use -- for a hybrid,
    the platform's ``base_block_size`` enlarged until one attention page holds
    one state page. ``state_dtype_bytes`` is ``mamba_cache_dtype`` (conv
    state), ``ssm_state_dtype_bytes`` ``mamba_ssm_cache_dtype``.
    ``mamba_cache_mode`` is vLLM's (``align`` with prefix caching, else
    ``none``; None without recurrent layers) and ``state_blocks_per_request``
    the state pages one request holds per recurrent layer under it.
    ``rules`` holds one note per figure.
    """

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    block_size: int | None
    kv_dtype: str
    kv_dtype_bytes: int
    state_dtype_bytes: int
    layer_counts: dict[str, int]
    windows_tokens: tuple[int, ...]
    bytes_per_token_flat: int
    bytes_flat: int
    bytes_by_layer_type: int
    bytes_vllm: int
    recurrent_state_bytes: int
    evidence: str
    rules: dict[str, str] = field(default_factory=dict)
    base_block_size: int | None = None
    ssm_state_dtype_bytes: int = 0
    mamba_cache_mode: str | None = None
    state_blocks_per_request: int = 0
    #: The rank this estimate is for (:func:`rank_layout`): 1 and None for a whole model on one device.
    tp_size: int = 1
    layer_range: tuple[int, int] | None = None
    concurrent_batches: int = 1

    @property
    def tokens(self) -> int:
        """Token slots the session asks for: max_model_len x max_num_seqs."""
        return self.max_model_len * self.max_num_seqs

    def bytes_for(self, rule: str) -> int:
        return {"flat": self.bytes_flat, "by_layer_type": self.bytes_by_layer_type,
                "vllm": self.bytes_vllm}[_check_rule(rule)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "base_block_size": self.base_block_size,
            "tokens": self.tokens,
            "kv_dtype": self.kv_dtype,
            "kv_dtype_bytes": self.kv_dtype_bytes,
            "state_dtype_bytes": self.state_dtype_bytes,
            "ssm_state_dtype_bytes": self.ssm_state_dtype_bytes,
            "mamba_cache_mode": self.mamba_cache_mode,
            "state_blocks_per_request": self.state_blocks_per_request,
            "layer_counts": dict(self.layer_counts),
            "windows_tokens": list(self.windows_tokens),
            "bytes_per_token_flat": self.bytes_per_token_flat,
            "bytes_flat": self.bytes_flat,
            "bytes_by_layer_type": self.bytes_by_layer_type,
            "bytes_vllm": self.bytes_vllm,
            "recurrent_state_bytes": self.recurrent_state_bytes,
            "evidence": self.evidence,
            "rules": dict(self.rules),
            "tp_size": self.tp_size,
            "layer_range": list(self.layer_range) if self.layer_range is not None else None,
            "concurrent_batches": self.concurrent_batches,
        }


# ---------------------------------------------------------------- config fields

def _unreadable(message: str, missing: str | None = None) -> ArtifactError:
    remedy = _REMEDY
    hint = defaults_remedy(missing) if missing is not None else None
    if hint is not None:
        remedy = f"{remedy}; {hint}"
    return ArtifactError("config_unreadable", message, remedy)


def _opt(config: Mapping[str, Any], names: tuple[str, ...], *, minimum: int = 1) -> int | None:
    """The first of ``names`` the config sets (a null counts as unset), or None."""
    for name in names:
        value = config.get(name)
        if value is None:
            continue
        # bool is an int subclass; "true" layers is a broken config, not 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise _unreadable(f"config field {name!r} must be an integer, got {value!r}")
        if value < minimum:
            raise _unreadable(f"config field {name!r} must be >= {minimum}, got {value}")
        return value
    return None


def _req(config: Mapping[str, Any], names: tuple[str, ...], *, minimum: int = 1, what: str = "") -> int:
    """The first of ``names`` the config sets; ``config_unreadable`` when none does."""
    value = _opt(config, names, minimum=minimum)
    if value is None:
        label = f" ({what})" if what else ""
        raise _unreadable(f"config has no {' / '.join(repr(n) for n in names)}{label}", missing=names[0])
    return value


def _window(config: Mapping[str, Any], name: str = "sliding_window") -> int | None:
    # vLLM (config/model.py) turns sliding_window 0 into "no window"; so do we.
    value = config.get(name)
    if value is None or value == 0:
        return None
    return _req(config, (name,))


def _attention_shape(config: Mapping[str, Any]) -> tuple[int, int, int, bool]:
    """(elements per token per layer, kv heads, head dim, mla)."""
    if config.get("kv_lora_rank") is not None:
        rank = _req(config, ("kv_lora_rank",))
        rope = _req(config, ("qk_rope_head_dim",), what="needed with kv_lora_rank (MLA)")
        # MLA caches one latent vector per token: vLLM's MLAAttentionSpec has
        # num_kv_heads=1, head_size=kv_lora_rank+qk_rope_head_dim, head_size_v=0.
        return rank + rope, 1, rank + rope, True
    heads = _req(config, ATTENTION_HEAD_FIELDS, what="attention heads")
    kv_heads = _opt(config, KV_HEAD_FIELDS)
    if kv_heads is None or config.get("model_type") == "zamba2":
        # Zamba2's shared attention builds Attention(num_heads, head_dim) with
        # no num_kv_heads (vLLM zamba2.py): one KV head per query head.
        kv_heads = 1 if config.get("multi_query") is True else heads
    head_dim = _opt(config, (*HEAD_DIM_FIELDS, "attention_head_dim"))
    if head_dim is None:
        hidden = _req(config, HIDDEN_FIELDS, what="needed when head_dim is absent")
        if hidden < heads:
            raise _unreadable(f"hidden_size {hidden} is smaller than num_attention_heads {heads}")
        head_dim = hidden // heads
    return 2 * kv_heads * head_dim, kv_heads, head_dim, False


# -------------------------------------------------------------- recurrent state

def _state_formula(config: Mapping[str, Any], name: str) -> str:
    """Which state a recurrent layer name means in this config's family."""
    if name == "conv":
        return "short_conv"
    if config.get("linear_num_value_heads") is not None:
        return "gated_deltanet"  # Qwen3-Next, Qwen3.5, OLMo-Hybrid
    if name == "linear_attention" and not any(config.get(f) is not None for f in _FIELDS_WITH_STATE):
        return "linear_attention"  # MiniMax lightning attention
    return "mamba"


def _recurrent_state(config: Mapping[str, Any], name: str, tp: int = 1) -> tuple[int, int, str]:
    """(state elements per sequence, of which SSM-dtype elements, formula) of one recurrent layer on one rank.

    Shapes follow vLLM's MambaStateShapeCalculator (mamba_utils.py) at tensor
    parallel size ``tp`` and no speculative tokens, with each family's fields
    as its ``get_mamba_state_shape_from_config`` reads them: the conv width
    and the heads are split across ranks, and Mamba-2's groups are first
    replicated up to ``tp`` when they do not divide (``extra_groups_for_head_shards``).
    The layout gates have checked that the heads divide.
    """
    formula = _state_formula(config, name)
    if formula == "gated_deltanet":
        # Conv over q, k, v plus a v x k delta-rule state per value head.
        nk = _req(config, ("linear_num_key_heads",))
        nv = _req(config, ("linear_num_value_heads",))
        dk = _req(config, ("linear_key_head_dim",))
        dv = _req(config, ("linear_value_head_dim",))
        kernel = _req(config, ("linear_conv_kernel_dim",))
        ssm = nv // tp * dv * dk
        return (kernel - 1) * ((2 * nk * dk + nv * dv) // tp) + ssm, ssm, formula
    if formula == "linear_attention":
        # Lightning attention (MiniMax): a head_dim x head_dim state per head,
        # in mamba_cache_dtype (linear_attention_state_dtype).
        heads = _req(config, ATTENTION_HEAD_FIELDS)
        head_dim = _opt(config, HEAD_DIM_FIELDS) or _req(config, HIDDEN_FIELDS) // heads
        return heads // tp * head_dim * head_dim, 0, formula
    if formula == "short_conv":
        # LFM2 short convolution: the last conv_L_cache - 1 inputs (lfm2.py reads conv_dim).
        kernel = _req(config, ("conv_L_cache",))
        dim = _opt(config, ("conv_dim",)) or _req(config, HIDDEN_FIELDS)
        return (kernel - 1) * (dim // tp), 0, formula
    d_state = _req(config, ("mamba_d_state", "ssm_state_size", "state_size"), what="Mamba state size")
    kernel = _req(config, ("mamba_d_conv", "conv_kernel"), what="Mamba conv kernel")
    model_type = config.get("model_type")
    # A pure Mamba-2 config names its heads plainly; a hybrid's plain names are attention's.
    plain = model_type == "mamba2"
    ssm_heads = _opt(config, ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
                     + (("num_heads",) if plain else ()))
    expand = _opt(config, ("mamba_expand", "expand"))
    inner = _opt(config, ("mamba_d_ssm",))
    if ssm_heads is not None:
        head_dim_names = ("mamba_d_head", "mamba_head_dim", "mamba_headdim") + (("head_dim",) if plain else ())
        if inner is None:
            if model_type == "nemotron_h" or not expand:
                # nemotron_h.py: intermediate = mamba_num_heads x mamba_head_dim
                # (Nemotron-Nano-9B-v2: 128 x 80 = 10240, not expand x hidden = 8960).
                inner = ssm_heads * _req(config, head_dim_names, what="Mamba-2 head dim")
            else:
                inner = expand * _req(config, HIDDEN_FIELDS)
        if config.get("mamba_d_head") == "auto":
            # GraniteMoeHybridConfig / FalconH1Config: "auto" is intermediate // heads.
            head_dim = inner // ssm_heads
        else:
            head_dim = _req(config, head_dim_names, what="Mamba-2 head dim")
        groups = _opt(config, ("mamba_n_groups", "n_groups", "mamba_ngroups")) or 1
        if groups % tp:
            groups = tp  # replicated so every rank's heads have their group (vLLM: + tp - groups)
        ssm = ssm_heads // tp * head_dim * d_state
        return (kernel - 1) * ((inner + 2 * groups * d_state) // tp) + ssm, ssm, "mamba2"
    if inner is None:
        inner = (expand * _req(config, HIDDEN_FIELDS) if expand
                 else _req(config, ("intermediate_size",), what="Mamba inner width"))
    return (kernel - 1) * (inner // tp) + inner // tp * d_state, inner // tp * d_state, "mamba1"


# ------------------------------------------------------------------ layer kinds

def _name_list(config: Mapping[str, Any], key: str, n: int | None) -> list[str]:
    types = config[key]
    if not isinstance(types, list) or not types or not all(isinstance(t, str) for t in types):
        raise _unreadable(f"config field {key!r} must be a list of strings, got {types!r}")
    if n is not None and len(types) != n and config.get("model_type") != "nemotron_h":
        # NemotronHConfig ignores num_hidden_layers when the list is given; no other family does.
        raise _unreadable(f"config field {key!r} lists {len(types)} layers but num_hidden_layers is {n}")
    return [t.lower() for t in types]


def _layer_names(config: Mapping[str, Any]) -> tuple[list[str], str, str]:
    """Per-layer type names, where they came from, and the evidence class.

    The order follows what vLLM 0.32 reads for each family (its model files
    read the attributes transformers 5.19's configuration classes derive):
    where a family's model derives the pattern itself (Falcon-H1, Jamba,
    Bamba, Llama-4), that rule wins over any list; otherwise an explicit list
    (``layer_types`` / ``layers_block_type``), then the family's compact
    spelling, then its default.
    """
    model_type = config.get("model_type")
    declared = _opt(config, LAYER_COUNT_FIELDS)

    def count() -> int:
        return _req(config, LAYER_COUNT_FIELDS, what="number of layers")

    if model_type in ("llama4", "llama4_text") and config.get("attention_chunk_size"):
        # llama4.py reads no_rope_layers (not layer_types): RoPE layers use
        # chunked local attention, every no_rope_layer_interval-th layer (NoPE)
        # attends globally (HF Llama4TextConfig's default rule).
        n = count()
        rope = config.get("no_rope_layers")
        if not rope:
            interval = _opt(config, ("no_rope_layer_interval",)) or 4
            rope = [int((i + 1) % interval != 0) for i in range(n)]
        if not isinstance(rope, list) or len(rope) != n:
            raise _unreadable(f"config field 'no_rope_layers' must list {n} flags")
        return (["chunked_attention" if r else "full_attention" for r in rope],
                "llama4 no_rope_layers + attention_chunk_size", "E")
    if model_type == "falcon_h1":
        # FalconH1Config.layers_block_type is ["hybrid"] * n, whatever the file says.
        return ["hybrid"] * count(), "falcon_h1: attention and a Mamba-2 mixer in every layer", "E"
    keys = ("layers_block_type", "layer_types") if model_type in _BLOCK_TYPE_FIRST else (
        "layer_types", "layers_block_type")
    listed = next((key for key in keys if config.get(key) is not None), None)
    if model_type == "jamba" or (listed is None and config.get("attn_layer_period") is not None):
        # JambaConfig.layers_block_type (a property vLLM's jamba.py reads):
        # attention where i % attn_layer_period == attn_layer_offset (defaults 8, 4).
        n = count()
        period = _opt(config, ("attn_layer_period",)) or 8
        offset = _opt(config, ("attn_layer_offset",), minimum=0)
        offset = 4 if offset is None else offset
        return (["attention" if i % period == offset else "mamba" for i in range(n)],
                "attn_layer_period/offset", "E")
    if model_type == "bamba" or (listed is None and config.get("attn_layer_indices") is not None):
        # BambaConfig.layers_block_type (a property): attention at the listed indices, Mamba-2 elsewhere.
        n = count()
        idx = config.get("attn_layer_indices") or []
        if not isinstance(idx, list) or not all(isinstance(i, int) and 0 <= i < n for i in idx):
            raise _unreadable(f"config field 'attn_layer_indices' must list layer indices below {n}")
        return ["attention" if i in idx else "mamba" for i in range(n)], "attn_layer_indices", "D"
    if listed is not None:
        return _name_list(config, listed, declared), listed, "D"
    pattern = config.get("hybrid_override_pattern")
    if pattern is not None:
        # NemotronHConfig turns the pattern into layers_block_type; its length is the layer count.
        if (not isinstance(pattern, str) or not pattern or set(pattern) - set(_PATTERN_KINDS)
                or (declared is not None and len(pattern) != declared and model_type != "nemotron_h")):
            raise _unreadable(f"config field 'hybrid_override_pattern' must be {declared or 'one per layer'} "
                              f"of {''.join(_PATTERN_KINDS)}, got {pattern!r}")
        return [_PATTERN_KINDS[c] for c in pattern], "hybrid_override_pattern", "D"
    if config.get("attn_type_list") is not None:
        # MiniMax-Text-01: 1 = softmax attention, 0 = lightning (linear) attention.
        n = count()
        flags = config["attn_type_list"]
        if not isinstance(flags, list) or len(flags) != n or set(flags) - {0, 1}:
            raise _unreadable(f"config field 'attn_type_list' must be {n} zeros and ones")
        return ["full_attention" if f else "linear_attention" for f in flags], "attn_type_list", "D"
    if config.get("full_attn_idxs") is not None or model_type in ("lfm2", "lfm2_vl"):
        # Lfm2Config: full attention at full_attn_idxs, short convolutions elsewhere;
        # with neither list, every layer attends (its default is range(n)).
        n = count()
        idx = config.get("full_attn_idxs")
        if idx is None:
            return ["full_attention"] * n, "lfm2 default (no full_attn_idxs: all attention)", "E"
        if not isinstance(idx, list) or not all(isinstance(i, int) and 0 <= i < n for i in idx):
            raise _unreadable(f"config field 'full_attn_idxs' must list layer indices below {n}")
        return ["full_attention" if i in idx else "conv" for i in range(n)], "full_attn_idxs", "D"
    if config.get("full_attention_interval") is not None or model_type in _INTERVAL_MODEL_TYPES:
        # Qwen3-Next / Qwen3.5: every interval-th layer (1-based) is full
        # attention, the rest gated DeltaNet (default interval 4).
        n = count()
        every = _opt(config, ("full_attention_interval",)) or 4
        return (["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)],
                f"full_attention_interval {every}", "E")
    if model_type == "olmo_hybrid":
        # OlmoHybridConfig: full attention at i % 4 == 3, and at least the last layer.
        n = count()
        names = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
        if "full_attention" not in names:
            names[-1] = "full_attention"
        return names, "olmo_hybrid default (every 4th layer full)", "E"
    if model_type in ("mamba", "mamba2", "falcon_mamba"):
        return ["mamba"] * count(), f"model_type {model_type} (attention-free)", "E"
    if model_type == "granitemoehybrid":
        # GraniteMoeHybridConfig's default layer_types: every layer a Mamba-2 mixer.
        return ["mamba"] * count(), "granitemoehybrid default (no layer_types: all Mamba-2)", "E"
    n = count()
    window = _window(config)
    if window is None:
        return ["full_attention"] * n, "no sliding_window: all layers full", "D"
    letters = config.get("sliding_window_pattern")
    if isinstance(letters, str):
        # Exaone4's string spelling: L = local, G = global, repeated; the last layer is global.
        if not letters or set(letters.upper()) - {"L", "G"}:
            raise _unreadable(f"config field 'sliding_window_pattern' must be L/G letters, got {letters!r}")
        up = letters.upper()
        names = ["full_attention" if up[i % len(up)] == "G" or i == n - 1 else "sliding_attention"
                 for i in range(n)]
        return names, f"sliding_window_pattern {letters!r}", "E"
    global_every = _opt(config, ("sliding_window_pattern",)) or _SLIDING_PATTERN_DEFAULTS.get(str(model_type))
    if global_every is not None:
        # Gemma-3 / Cohere2 / Exaone4: every pattern-th layer (1-based) is global
        # (the configuration classes' rule; their default pattern when none is named).
        names = ["full_attention" if (i + 1) % global_every == 0 else "sliding_attention" for i in range(n)]
        return names, f"sliding_window_pattern {global_every} (Gemma-3 rule)", "E"
    if model_type in ("gemma2", "gpt_oss"):
        # Gemma-2 and gpt-oss alternate, starting with a sliding layer (even
        # 0-based indices; vLLM gpt_oss.py: layer_idx % 2 == 0 slides).
        return (["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
                f"{model_type} alternating rule", "E")
    if "max_window_layers" in config and "use_sliding_window" in config:
        # Qwen2 family: sliding only when enabled, and only from max_window_layers up.
        if config["use_sliding_window"] is not True:
            return ["full_attention"] * n, "use_sliding_window false (Qwen2 rule)", "D"
        first = _req(config, ("max_window_layers",), minimum=0)
        return (["sliding_attention" if i >= first else "full_attention" for i in range(n)],
                f"use_sliding_window + max_window_layers {first} (Qwen2 rule)", "E")
    if config.get("use_sliding_window") is False:
        return ["full_attention"] * n, "use_sliding_window false", "D"
    # Mistral: a model-level window applies to every layer (vLLM sets
    # CacheConfig.sliding_window only when there are no layer_types).
    return ["sliding_attention"] * n, "sliding_window on every layer (Mistral rule)", "E"


def kv_layout(config: Mapping[str, Any], tp_size: int = 1) -> KVLayout:
    """Classify every layer of a text config; recurrent state is one rank's of ``tp_size``
    (:func:`rank_layout` then splits the KV heads and cuts the layers).

    Raises :class:`~edge_core.errors.ArtifactError` ``config_unreadable``
    naming the field when the config lacks or garbles one the answer needs.
    """
    if not isinstance(config, Mapping):
        raise _unreadable(f"text config must be a JSON object, got {type(config).__name__}")
    names, source, evidence = _layer_names(config)
    notes: list[str] = []
    attention_shape = None
    state_cache: dict[str, tuple[int, int, str]] = {}
    layers = []

    def state(name: str) -> tuple[int, int, str]:
        if name not in state_cache:
            state_cache[name] = _recurrent_state(config, name, tp_size)
            note = f"{name!r} state per sequence from the {state_cache[name][2]} shape (estimate)"
            notes.append(note)
        return state_cache[name]

    for i, name in enumerate(names):
        hybrid = name in _HYBRID_NAMES
        if hybrid or name in _FULL_NAMES or name in _SLIDING_NAMES or name in _CHUNKED_NAMES or (
                name.endswith("attention") and name not in _RECURRENT_NAMES):
            if attention_shape is None:
                attention_shape = _attention_shape(config)
            elements, _, _, mla = attention_shape
            if name in _SLIDING_NAMES:
                window = _window(config)
                if window is None:
                    raise _unreadable(f"layer {i} is {name!r} but config has no 'sliding_window'")
                if config.get("model_type") == "cohere2":
                    # commandr.py passes sliding_window + 1 (Cohere's window spans both ends).
                    window += 1
                layers.append(LayerKV(i, "sliding", elements, window))
            elif name in _CHUNKED_NAMES:
                chunk = _window(config, "attention_chunk_size")
                if chunk is None:
                    raise _unreadable(
                        f"layer {i} is {name!r} but config has no 'attention_chunk_size'")
                layers.append(LayerKV(i, "chunked", elements, chunk))
            else:
                if name not in _FULL_NAMES and not hybrid:
                    note = f"layer type {name!r} is not one edge knows; charged as full attention"
                    if note not in notes:
                        notes.append(note)
                    evidence = "E"
                total = ssm = 0
                formula = ""
                if hybrid:
                    # Falcon-H1 / Zamba2 run attention and a Mamba-2 mixer side by
                    # side in one layer: it keeps both a KV cache and a state.
                    total, ssm, formula = state("mamba")
                    evidence = "E"
                layers.append(LayerKV(i, "mla" if mla else "full", elements, state_elements=total,
                                      ssm_state_elements=ssm, state_formula=formula))
        elif name in _RECURRENT_NAMES:
            total, ssm, formula = state(name)
            evidence = "E"
            layers.append(LayerKV(i, "recurrent", state_elements=total, ssm_state_elements=ssm,
                                  state_formula=formula))
        elif name in _NONE_NAMES:
            layers.append(LayerKV(i, "none"))
        else:
            raise _unreadable(f"layer {i} has layer type {name!r}, which edge does not know "
                              f"how to size (known: attention kinds, hybrid, "
                              f"{', '.join(sorted(_RECURRENT_NAMES | _NONE_NAMES))})")
    kv_heads = head_dim = 0
    mla = False
    if attention_shape is not None:
        _, kv_heads, head_dim, mla = attention_shape
    return KVLayout(tuple(layers), kv_heads, head_dim, mla, source, evidence, tuple(notes))


def rank_layout(layout: KVLayout, tp_size: int = 1, layer_range: tuple[int, int] | None = None) -> KVLayout:
    """The part of ``layout`` one tensor/pipeline-parallel rank caches.

    vLLM splits KV heads across ``tp_size`` ranks (``num_kv_heads // tp``) and
    replicates them when there are fewer heads than ranks (one head per
    rank); MLA's latent is one shared vector per token, which tensor
    parallelism does not split. Recurrent state is already one rank's when
    ``layout`` is ``kv_layout(config, tp_size)``. A pipeline stage caches only its layers, ``layer_range`` =
    ``[start, end)`` as vLLM's ``get_pp_indices`` gives them.
    """
    layers = layout.layers
    if layer_range is not None:
        start, end = layer_range
        layers = tuple(l for l in layers if start <= l.index < end)
    kv_heads = layout.num_kv_heads
    if tp_size > 1 and not layout.mla and kv_heads:
        per_rank = max(1, kv_heads // tp_size)
        layers = tuple(replace(l, elements_per_token=l.elements_per_token * per_rank // kv_heads)
                       if l.attention else l for l in layers)
        kv_heads = per_rank
    if layers is layout.layers and kv_heads == layout.num_kv_heads:
        return layout
    return replace(layout, layers=layers, num_kv_heads=kv_heads)


# ----------------------------------------------------------------------- charge

def _dtype_bytes(name: str, what: str) -> int:
    key = str(name).lower()
    if key.startswith("torch."):
        key = key[len("torch."):]
    if key not in DTYPE_BYTES:
        raise UsageError(f"{what} {name!r} is not one of {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


def _check_rule(rule: str) -> str:
    if rule not in RULES:
        raise UsageError(f"KV rule {rule!r} is not one of {', '.join(RULES)}")
    return rule


def _positive(value: Any, name: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a positive integer, got {value!r}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class _Session:
    """The per-session constants every charge needs (bytes per element, vLLM's resolved settings)."""

    max_num_seqs: int
    max_num_batched_tokens: int | None
    block_size: int | None
    concurrent_batches: int
    kv_bytes: int
    cache_bytes: int
    ssm_bytes: int
    mamba_cache_mode: str | None

    def state_blocks(self, layer: LayerKV) -> int:
        return _state_blocks_per_request(layer.state_formula, self.mamba_cache_mode)


def _state_blocks_per_request(formula: str, mode: str | None) -> int:
    """State pages one request holds per recurrent layer (vLLM 0.32 MambaSpec.max_memory_usage_bytes).

    ``align`` (prefix caching): 2 + speculative + prefill-checkpoint blocks,
    and MambaMixer2.get_kv_cache_spec asks for one prefill checkpoint block
    (mamba_mixer2.py), so a Mamba-2 layer holds 3, others 2. ``none``: 1.
    """
    if mode == "align":
        return 3 if formula == "mamba2" else 2
    return 1


def _mamba_cache_mode(layout: KVLayout, enable_prefix_caching: bool | None) -> str | None:
    """vLLM's mamba_cache_mode for this layout: ``align`` with prefix caching, else ``none``.

    Prefix caching is on by default (CacheConfig) for every generative model
    but attention-free ones (ModelConfig.is_prefix_caching_supported), and
    MambaModelConfig.verify_and_update_config then sets ``align``.
    """
    if not any(l.state_elements for l in layout.layers):
        return None
    if enable_prefix_caching is None:
        enable_prefix_caching = any(l.attention for l in layout.layers)
    return "align" if enable_prefix_caching else "none"


def hybrid_block_size(layout: KVLayout, block_size: int | None, *, kv_bytes: int, cache_bytes: int,
                      ssm_bytes: int, kernel_block_tokens: int = CPU_ATTN_KERNEL_BLOCK_TOKENS) -> int | None:
    """The attention block vLLM uses for this layout when the platform's is ``block_size``.

    For a hybrid (attention and state layers), vLLM 0.32's
    ``Platform._align_hybrid_block_size`` (platforms/interface.py) grows the
    block until one attention page holds one state page: ``alignment x
    cdiv(state_page, alignment x attention_page_per_token)`` with alignment =
    max(kernel block, block_size) (CPU: max(32, 128)), rounded to the kernel
    block, and pads the state page to that attention page. Without state
    layers (or without a block size) the block is unchanged.
    """
    if block_size is None:
        return None
    attention = [l for l in layout.layers if l.attention]
    states = [l for l in layout.layers if l.state_elements]
    if not attention or not states:
        return block_size
    per_token = max(l.elements_per_token for l in attention) * kv_bytes
    state_page = max(l.state_bytes(cache_bytes, ssm_bytes) for l in states)
    alignment = max(kernel_block_tokens, block_size)
    if layout.mla:
        alignment = max(alignment, MLA_HYBRID_BLOCK_ALIGN_TOKENS)
    tokens = alignment * _cdiv(state_page, alignment * per_token)
    tokens = kernel_block_tokens * _cdiv(tokens, kernel_block_tokens)
    return max(block_size, tokens)


def _vllm_group_layers(buckets: dict[tuple[str, int, str], int]) -> tuple[dict[tuple[str, int, str], int], int]:
    """Layers each spec bucket is charged for once vLLM pads groups, and the group size.

    vLLM (v1/core/kv_cache_utils.py, _get_kv_cache_groups_uniform_page_size)
    splits each attention type into groups of equal size: the smallest type's
    layer count, or the largest when max < 1.5 x min; the last group of a type
    is padded with layers that still take pages. One type means one group.
    """
    counts = list(buckets.values())
    if len(counts) <= 1:
        return dict(buckets), (counts[0] if counts else 0)
    size = min(counts)
    if max(counts) < size * 1.5:
        size = max(counts)
    return {key: _cdiv(n, size) * size for key, n in buckets.items()}, size


def _charge(layout: KVLayout, rule: str, max_model_len: int, s: _Session) -> int:
    """Bytes for one rule; the KV pool plus recurrent state for every sequence."""
    if rule != "vllm":
        per_seq = 0
        for layer in layout.layers:
            if layer.attention:
                tokens = max_model_len
                if rule == "by_layer_type" and layer.window_tokens:
                    tokens = min(layer.window_tokens, max_model_len)
                per_seq += tokens * layer.elements_per_token * s.kv_bytes
            per_seq += layer.state_bytes(s.cache_bytes, s.ssm_bytes)
        return per_seq * s.max_num_seqs

    # vLLM's rule, read from vllm 0.32 v1/kv_cache_interface.py:
    #  FullAttentionSpec: cdiv(max_model_len, block_size) pages per request.
    #  SlidingWindowSpec.max_admission_blocks_per_request:
    #    cdiv(min(window - 1 + max_in_flight_tokens, max_model_len), block_size) + 1
    #    (the +1 because the window need not start on a block boundary), where
    #    VllmConfig.max_in_flight_tokens = max_concurrent_batches x max_num_batched_tokens.
    #  ChunkedLocalAttentionSpec would hold chunk + in-flight tokens, but
    #    config/vllm.py disables the hybrid manager whenever attention_chunk_size
    #    is set (unless VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE), and
    #    unify_hybrid_kv_cache_specs then promotes every local layer to full.
    #  MambaSpec: state pages per request (_state_blocks_per_request), each page
    #    padded to the attention page in a hybrid (hybrid_block_size), or to the
    #    largest state page when there is no attention (unify_kv_cache_spec_page_size).
    # A request is charged pages over all groups (_max_memory_usage_bytes_from_groups),
    # and get_kv_cache_configs first subtracts the null block the BlockPool
    # holds back: one pool block (group size x page).
    in_flight = (s.max_num_batched_tokens if s.max_num_batched_tokens is not None
                 else max_model_len) * s.concurrent_batches
    promote = any(l.kind == "chunked" for l in layout.layers)
    buckets: dict[tuple[str, int, str], int] = {}
    blocks_of: dict[tuple[str, int, str], int] = {}
    for layer in layout.layers:
        keys = []
        if layer.attention:
            keys.append(("sliding", layer.window_tokens or 0, "")
                        if layer.kind == "sliding" and not promote else ("full", 0, ""))
        if layer.state_elements:
            # vLLM gives a recurrent mixer its own MambaSpec layer.
            key = ("state", layer.state_bytes(s.cache_bytes, s.ssm_bytes), layer.state_formula)
            blocks_of[key] = s.state_blocks(layer)
            keys.append(key)
        for key in keys:
            buckets[key] = buckets.get(key, 0) + 1
    charged, group_size = _vllm_group_layers(buckets)
    elements = max((l.elements_per_token for l in layout.layers), default=0)
    per_token_layer = elements * s.kv_bytes
    page = per_token_layer * s.block_size if s.block_size else 0
    state_pages = [value for kind, value, _ in charged if kind == "state"]
    if s.block_size and not page and state_pages:
        page = max(state_pages)  # attention-free: every state page padded to the largest
    per_seq = 0
    for key, n in charged.items():
        kind, value, _ = key
        if kind == "state":
            per_seq += n * blocks_of[key] * (page or value)
            continue
        if kind == "full":
            tokens = max_model_len
        else:
            tokens = min(value - 1 + in_flight, max_model_len)
        if s.block_size:
            blocks = _cdiv(tokens, s.block_size) + (1 if kind == "sliding" else 0)
            per_seq += n * blocks * page
        else:
            per_seq += n * tokens * per_token_layer
    null_block = group_size * page if page else 0
    return per_seq * s.max_num_seqs + null_block


def _session(layout: KVLayout, kv_dtype: str, model_dtype: str, *, max_num_seqs: int,
             max_num_batched_tokens: int | None, block_size: int | None, concurrent_batches: int,
             mamba_cache_dtype: str, mamba_ssm_cache_dtype: str, enable_prefix_caching: bool | None,
             kernel_block_tokens: int, config: Mapping[str, Any]) -> tuple[str, _Session]:
    _positive(max_num_seqs, "max_num_seqs")
    _positive(max_num_batched_tokens, "max_num_batched_tokens", optional=True)
    _positive(block_size, "block_size", optional=True)
    _positive(concurrent_batches, "concurrent_batches")
    _positive(kernel_block_tokens, "kernel_block_tokens")
    model_bytes = _dtype_bytes(model_dtype, "model dtype")
    if str(kv_dtype).lower() == "auto":
        resolved, kv_bytes = str(model_dtype).lower(), model_bytes
    else:
        resolved, kv_bytes = str(kv_dtype).lower(), _dtype_bytes(kv_dtype, "KV cache dtype")
    # mamba_cache_dtype auto: the model dtype (MambaStateDtypeCalculator,
    # get_kv_cache_torch_dtype). mamba_ssm_cache_dtype auto: what the model's
    # config asks for (NemotronH's mamba_ssm_cache_dtype, default float32;
    # Qwen3.5's mamba_ssm_dtype -- models/config.py), else the conv dtype.
    cache_bytes = model_bytes if str(mamba_cache_dtype).lower() == "auto" else _dtype_bytes(
        mamba_cache_dtype, "mamba_cache_dtype")
    ssm_name = str(mamba_ssm_cache_dtype).lower()
    if ssm_name == "auto":
        model_type = str(config.get("model_type"))
        asked = None
        if model_type == "nemotron_h":
            asked = config.get("mamba_ssm_cache_dtype") or NEMOTRON_H_SSM_CACHE_DTYPE
        elif model_type.startswith("qwen3_5"):
            asked = config.get("mamba_ssm_dtype")
        ssm_bytes = _dtype_bytes(str(asked), "mamba_ssm_cache_dtype") if asked else cache_bytes
    else:
        ssm_bytes = _dtype_bytes(mamba_ssm_cache_dtype, "mamba_ssm_cache_dtype")
    block = hybrid_block_size(layout, block_size, kv_bytes=kv_bytes, cache_bytes=cache_bytes,
                              ssm_bytes=ssm_bytes, kernel_block_tokens=kernel_block_tokens)
    return resolved, _Session(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              block_size=block, concurrent_batches=concurrent_batches, kv_bytes=kv_bytes,
                              cache_bytes=cache_bytes, ssm_bytes=ssm_bytes,
                              mamba_cache_mode=_mamba_cache_mode(layout, enable_prefix_caching))


def estimate_kv(config: Mapping[str, Any], *, max_model_len: int, max_num_seqs: int = 1,
                max_num_batched_tokens: int | None = None, kv_dtype: str = "auto",
                model_dtype: str = "bfloat16", block_size: int | None = None,
                concurrent_batches: int = 1, mamba_cache_dtype: str = "auto",
                mamba_ssm_cache_dtype: str = DEFAULT_MAMBA_SSM_CACHE_DTYPE,
                enable_prefix_caching: bool | None = None,
                kernel_block_tokens: int = CPU_ATTN_KERNEL_BLOCK_TOKENS, tp_size: int = 1,
                layer_range: tuple[int, int] | None = None) -> KVEstimate:
    """Charge a session's KV cache three ways (see the module docstring).

    ``kv_dtype`` ``auto`` stores KV in ``model_dtype``; fp8 variants take one
    byte. Recurrent state follows vLLM's two settings: ``mamba_cache_dtype``
    (conv state; auto = the model dtype) and ``mamba_ssm_cache_dtype`` (the
    SSM state; default :data:`DEFAULT_MAMBA_SSM_CACHE_DTYPE`, what vLLM CPU
    0.32 resolves; ``auto`` = the model config's request, else the conv dtype).
    ``max_num_batched_tokens`` None is charged as ``max_model_len`` in flight
    — vLLM's bound without chunked prefill, and the conservative one; pass the
    engine's value to get its real sliding charge. ``concurrent_batches`` is
    vLLM's ``max_concurrent_batches``: 1 on the CPU build (platforms/cpu.py
    forces async scheduling off), 2 under async scheduling (the CUDA default),
    the pipeline size under pipeline parallelism. ``block_size`` is the
    platform's block (CPU 128); for a hybrid the estimate's ``block_size``
    is the larger one vLLM will pick (:func:`hybrid_block_size`), and passing
    it back gives the same answer. None charges exact tokens: no block
    rounding, no null block. ``enable_prefix_caching`` None is vLLM's default
    (on, except for attention-free models); with it a recurrent layer holds
    ``align``-mode state blocks. ``tp_size`` and ``layer_range`` charge one
    rank of a parallel layout (:func:`rank_layout`); vLLM's
    ``kv_cache_memory_bytes`` is per rank.
    """
    _positive(max_model_len, "max_model_len")
    layout = rank_layout(kv_layout(config, tp_size), tp_size, layer_range)
    resolved, s = _session(layout, kv_dtype, model_dtype, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                           concurrent_batches=concurrent_batches, mamba_cache_dtype=mamba_cache_dtype,
                           mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
                           enable_prefix_caching=enable_prefix_caching,
                           kernel_block_tokens=kernel_block_tokens, config=config)
    figures = {rule: _charge(layout, rule, max_model_len, s) for rule in RULES}
    recurrent = sum(l.state_bytes(s.cache_bytes, s.ssm_bytes) for l in layout.layers) * max_num_seqs
    per_token = sum(l.elements_per_token for l in layout.layers if l.attention) * s.kv_bytes
    if max_num_batched_tokens is None:
        in_flight = "max_model_len (max_num_batched_tokens not given)"
    else:
        in_flight = f"{concurrent_batches} x max_num_batched_tokens {max_num_batched_tokens}"
    rounding = (f"whole blocks of {s.block_size} tokens per layer per sequence, "
                f"+1 block per sliding layer, group padding, plus one null block"
                if s.block_size else "exact tokens (no block_size given), group padding")
    rules = {
        "flat": "every attention layer holds max_model_len tokens per sequence",
        "by_layer_type": "full/MLA layers hold max_model_len tokens; sliding and chunked "
                         "layers hold min(window, max_model_len)",
        "vllm": "vLLM 0.32 allocator: full layers max_model_len; sliding layers "
                f"min(window - 1 + in-flight tokens, max_model_len), in flight = {in_flight}; "
                f"chunked layers as full (hybrid manager off); {rounding}",
    }
    blocks = max((s.state_blocks(l) for l in layout.layers if l.state_elements), default=0)
    if recurrent:
        rules["recurrent"] = (
            f"recurrent state per sequence, conv part in {s.cache_bytes} B/elem (mamba_cache_dtype), "
            f"SSM part in {s.ssm_bytes} B/elem (mamba_ssm_cache_dtype), added to every total "
            f"(estimate from the state shapes); vLLM rule: mamba_cache_mode {s.mamba_cache_mode}, "
            f"{blocks} state page(s) per request per recurrent layer"
            + (f", each padded to one attention page of the hybrid block {s.block_size} tokens "
               f"(platform block {block_size})" if s.block_size and per_token else ""))
    return KVEstimate(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, block_size=s.block_size,
        kv_dtype=resolved, kv_dtype_bytes=s.kv_bytes, state_dtype_bytes=s.cache_bytes,
        layer_counts=layout.counts(), windows_tokens=layout.windows_tokens(),
        bytes_per_token_flat=per_token, bytes_flat=figures["flat"],
        bytes_by_layer_type=figures["by_layer_type"], bytes_vllm=figures["vllm"],
        recurrent_state_bytes=recurrent, evidence=layout.evidence, rules=rules,
        base_block_size=block_size, ssm_state_dtype_bytes=s.ssm_bytes, mamba_cache_mode=s.mamba_cache_mode,
        state_blocks_per_request=blocks, tp_size=tp_size, layer_range=layer_range,
        concurrent_batches=concurrent_batches)


def max_model_len_for(config: Mapping[str, Any], budget_bytes: int, *, max_num_seqs: int = 1,
                      max_num_batched_tokens: int | None = None, kv_dtype: str = "auto",
                      model_dtype: str = "bfloat16", block_size: int | None = None,
                      rule: str = "vllm", concurrent_batches: int = 1,
                      ceiling_tokens: int | None = None, mamba_cache_dtype: str = "auto",
                      mamba_ssm_cache_dtype: str = DEFAULT_MAMBA_SSM_CACHE_DTYPE,
                      enable_prefix_caching: bool | None = None,
                      kernel_block_tokens: int = CPU_ATTN_KERNEL_BLOCK_TOKENS, tp_size: int = 1,
                      layer_range: tuple[int, int] | None = None) -> int:
    """The largest ``max_model_len`` whose KV charge under ``rule`` fits ``budget_bytes``.

    0 when not even one token fits. The answer is capped at ``ceiling_tokens``
    (default: the config's ``max_position_embeddings``, else
    :data:`DEFAULT_CEILING_TOKENS`), since a model with no full-attention
    layer charges a constant past its window. Every rule is non-decreasing in
    ``max_model_len``, so a binary search is exact.
    """
    _check_rule(rule)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise UsageError(f"budget_bytes must be an integer, got {budget_bytes!r}")
    layout = rank_layout(kv_layout(config, tp_size), tp_size, layer_range)
    _, s = _session(layout, kv_dtype, model_dtype, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                    concurrent_batches=concurrent_batches, mamba_cache_dtype=mamba_cache_dtype,
                    mamba_ssm_cache_dtype=mamba_ssm_cache_dtype, enable_prefix_caching=enable_prefix_caching,
                    kernel_block_tokens=kernel_block_tokens, config=config)
    if ceiling_tokens is None:
        ceiling_tokens = _opt(config, CONTEXT_FIELDS) or DEFAULT_CEILING_TOKENS
    _positive(ceiling_tokens, "ceiling_tokens")

    def fits(tokens: int) -> bool:
        return _charge(layout, rule, tokens, s) <= budget_bytes

    return largest_fitting(fits, ceiling_tokens)


def largest_fitting(fits: Callable[[int], bool], ceiling: int) -> int:
    """The largest ``n`` in ``[1, ceiling]`` with ``fits(n)``, or 0 when not even 1 fits.

    ``fits`` must be monotone (true up to some ``n``, false after): every
    charging rule grows with the context, so a binary search is exact. The one
    bisection both the KV inversion and the planner's context remedy use.
    """
    if ceiling < 1 or not fits(1):
        return 0
    lo, hi = 1, ceiling  # invariant: fits(lo); answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
