"""How many bytes of KV cache a text model needs, and how long a context fits a budget.

Input is a model's *text* config as a plain dict (``config.json``, with a
multimodal wrapper's ``text_config`` already resolved by the caller); nothing
is imported from transformers. :func:`kv_layout` classifies every layer
(full, MLA, sliding window, chunked local, recurrent state, none);
:func:`estimate_kv` charges a session three ways, side by side:

* ``flat`` — every attention layer holds every token (the naive figure);
* ``by_layer_type`` — a sliding layer holds its window, a chunked layer its
  chunk (SPEC section 6's hybrid reference figure);
* ``vllm`` — what vLLM's own allocator reserves (in-flight tokens, whole
  blocks, group padding, the null block), so the planner can hand vLLM a
  ``kv_cache_memory_bytes`` it will accept.

Recurrent (Mamba, linear-attention, short-conv) state is per sequence, not per
token, and is added to all three totals. :func:`max_model_len_for` inverts a
rule: the longest context whose charge fits a byte budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

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

_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_KV_HEAD_FIELDS = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
_HIDDEN_FIELDS = ("hidden_size", "n_embd", "d_model")
_HEAD_DIM_FIELDS = ("head_dim", "kv_channels")
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")

# layer_types vocabulary seen in published configs (Gemma-2/3, gpt-oss, Qwen2,
# Qwen3-Next, Granite-4.0-H, LFM2, Llama-4, MiniMax).
_FULL_NAMES = frozenset({"full_attention", "attention", "global_attention", "global", "full"})
_SLIDING_NAMES = frozenset({"sliding_attention", "sliding_window", "local_attention", "local",
                            "sliding", "window_attention"})
_CHUNKED_NAMES = frozenset({"chunked_attention"})
_RECURRENT_NAMES = frozenset({"mamba", "mamba2", "linear_attention", "conv", "ssm", "recurrent"})
_NONE_NAMES = frozenset({"mlp", "moe", "none", "dense", "ffn"})

# NemotronH's hybrid_override_pattern: M = Mamba-2, * = attention, - = MLP, E = MoE.
_PATTERN_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}

_REMEDY = ("check the checkpoint's config.json (or its text_config) against the model card; "
           "re-download it if it is truncated or hand-edited")


@dataclass(frozen=True)
class LayerKV:
    """What one decoder layer keeps per sequence.

    ``elements_per_token`` counts cached elements per token (K and V together;
    the latent for MLA), 0 for recurrent and ``none`` layers.
    ``window_tokens`` is the sliding window or attention chunk, else None.
    ``state_elements`` is the recurrent state per sequence, else 0.
    """

    index: int
    kind: str
    elements_per_token: int = 0
    window_tokens: int | None = None
    state_elements: int = 0

    @property
    def attention(self) -> bool:
        return self.kind in ("full", "mla", "sliding", "chunked")

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "elements_per_token": self.elements_per_token,
            "window_tokens": self.window_tokens,
            "state_elements": self.state_elements,
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
            "source": self.source,
            "evidence": self.evidence,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class KVEstimate:
    """A session's KV charge under each rule, in bytes, with how each was computed.

    Every ``bytes_*`` total covers ``max_num_seqs`` sequences of
    ``max_model_len`` tokens and includes ``recurrent_state_bytes``.
    ``bytes_per_token_flat`` is one token of one sequence in every attention
    layer. ``rules`` holds one note per figure.
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
            "tokens": self.tokens,
            "kv_dtype": self.kv_dtype,
            "kv_dtype_bytes": self.kv_dtype_bytes,
            "state_dtype_bytes": self.state_dtype_bytes,
            "layer_counts": dict(self.layer_counts),
            "windows_tokens": list(self.windows_tokens),
            "bytes_per_token_flat": self.bytes_per_token_flat,
            "bytes_flat": self.bytes_flat,
            "bytes_by_layer_type": self.bytes_by_layer_type,
            "bytes_vllm": self.bytes_vllm,
            "recurrent_state_bytes": self.recurrent_state_bytes,
            "evidence": self.evidence,
            "rules": dict(self.rules),
        }


# ---------------------------------------------------------------- config fields

def _unreadable(message: str) -> ArtifactError:
    return ArtifactError("config_unreadable", message, _REMEDY)


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
        raise _unreadable(f"config has no {' / '.join(repr(n) for n in names)}{label}")
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
    heads = _req(config, _HEAD_FIELDS, what="attention heads")
    kv_heads = _opt(config, _KV_HEAD_FIELDS)
    if kv_heads is None:
        kv_heads = 1 if config.get("multi_query") is True else heads
    head_dim = _opt(config, _HEAD_DIM_FIELDS)
    if head_dim is None:
        hidden = _req(config, _HIDDEN_FIELDS, what="needed when head_dim is absent")
        if hidden < heads:
            raise _unreadable(f"hidden_size {hidden} is smaller than num_attention_heads {heads}")
        head_dim = hidden // heads
    return 2 * kv_heads * head_dim, kv_heads, head_dim, False


def _recurrent_state_elements(config: Mapping[str, Any], layer_type: str) -> tuple[int, str]:
    """Per-sequence state elements of one recurrent layer, and which formula.

    Shapes follow vLLM's MambaStateShapeCalculator (mamba_utils.py) at tensor
    parallel size 1 and no speculative tokens.
    """
    if layer_type == "linear_attention" and config.get("linear_num_value_heads") is not None:
        # Gated DeltaNet (Qwen3-Next): conv over q,k,v plus a k x v state per v head.
        nk = _req(config, ("linear_num_key_heads",))
        nv = _req(config, ("linear_num_value_heads",))
        dk = _req(config, ("linear_key_head_dim",))
        dv = _req(config, ("linear_value_head_dim",))
        kernel = _req(config, ("linear_conv_kernel_dim",))
        return (kernel - 1) * (2 * nk * dk + nv * dv) + nv * dv * dk, "gated_deltanet"
    if layer_type == "linear_attention":
        # Lightning attention (MiniMax): a head_dim x head_dim state per head.
        heads = _req(config, _HEAD_FIELDS)
        head_dim = _opt(config, _HEAD_DIM_FIELDS) or _req(config, _HIDDEN_FIELDS) // heads
        return heads * head_dim * head_dim, "linear_attention"
    if layer_type == "conv":
        # LFM2 short convolution: the last conv_L_cache - 1 inputs.
        kernel = _req(config, ("conv_L_cache",))
        dim = _opt(config, ("conv_dim",)) or _req(config, _HIDDEN_FIELDS)
        return (kernel - 1) * dim, "short_conv"
    d_state = _req(config, ("mamba_d_state", "ssm_state_size", "state_size"),
                   what="Mamba state size")
    kernel = _req(config, ("mamba_d_conv", "conv_kernel"), what="Mamba conv kernel")
    # A pure Mamba-2 config names its heads plainly; a hybrid's plain names are attention's.
    plain = config.get("model_type") == "mamba2"
    ssm_heads = _opt(config, ("mamba_n_heads", "mamba_num_heads") + (("num_heads",) if plain else ()))
    expand = _opt(config, ("mamba_expand", "expand"))
    inner = _opt(config, ("mamba_d_ssm",))
    if ssm_heads is not None:
        head_dim = _req(config, ("mamba_d_head", "mamba_head_dim")
                        + (("head_dim",) if plain else ()), what="Mamba-2 head dim")
        groups = _opt(config, ("mamba_n_groups", "n_groups")) or 1
        if inner is None:
            inner = expand * _req(config, _HIDDEN_FIELDS) if expand else ssm_heads * head_dim
        return (kernel - 1) * (inner + 2 * groups * d_state) + ssm_heads * head_dim * d_state, "mamba2"
    if inner is None:
        inner = (expand * _req(config, _HIDDEN_FIELDS) if expand
                 else _req(config, ("intermediate_size",), what="Mamba inner width"))
    return (kernel - 1) * inner + inner * d_state, "mamba1"


# ------------------------------------------------------------------ layer kinds

def _layer_names(config: Mapping[str, Any], n: int) -> tuple[list[str], str, str]:
    """Per-layer type names, where they came from, and the evidence class."""
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise _unreadable(
                f"config field 'layer_types' must be a list of strings, got {types!r}")
        if len(types) != n:
            raise _unreadable(f"config field 'layer_types' lists {len(types)} layers but "
                              f"num_hidden_layers is {n}")
        return [t.lower() for t in types], "layer_types", "D"
    pattern = config.get("hybrid_override_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or len(pattern) != n or set(pattern) - set(_PATTERN_KINDS):
            raise _unreadable(f"config field 'hybrid_override_pattern' must be {n} of "
                              f"{''.join(_PATTERN_KINDS)}, got {pattern!r}")
        return [_PATTERN_KINDS[c] for c in pattern], "hybrid_override_pattern", "D"
    if config.get("attn_type_list") is not None:
        # MiniMax-Text-01: 1 = softmax attention, 0 = lightning (linear) attention.
        flags = config["attn_type_list"]
        if not isinstance(flags, list) or len(flags) != n or set(flags) - {0, 1}:
            raise _unreadable(f"config field 'attn_type_list' must be {n} zeros and ones")
        names = ["full_attention" if f else "linear_attention" for f in flags]
        return names, "attn_type_list", "D"
    if config.get("attn_layer_indices") is not None:
        # Bamba: attention at the listed indices, Mamba-2 elsewhere.
        idx = config["attn_layer_indices"]
        if not isinstance(idx, list) or not all(isinstance(i, int) and 0 <= i < n for i in idx):
            raise _unreadable(
                f"config field 'attn_layer_indices' must list layer indices below {n}")
        return ["attention" if i in idx else "mamba" for i in range(n)], "attn_layer_indices", "D"
    if config.get("attn_layer_period") is not None:
        # Jamba: attention where i % attn_layer_period == attn_layer_offset.
        period = _req(config, ("attn_layer_period",))
        offset = _req(config, ("attn_layer_offset",), minimum=0)
        return (["attention" if i % period == offset else "mamba" for i in range(n)],
                "attn_layer_period/offset", "E")
    if config.get("model_type") in ("mamba", "mamba2", "falcon_mamba"):
        return ["mamba"] * n, f"model_type {config['model_type']} (attention-free)", "E"
    llama4 = config.get("model_type") in ("llama4", "llama4_text")
    if config.get("attention_chunk_size") and llama4:
        # Llama-4: layers with RoPE use chunked local attention; every
        # no_rope_layer_interval-th layer (NoPE) attends globally (HF Llama4TextConfig).
        rope = config.get("no_rope_layers")
        if not rope:
            interval = _opt(config, ("no_rope_layer_interval",)) or 4
            rope = [int((i + 1) % interval != 0) for i in range(n)]
        if not isinstance(rope, list) or len(rope) != n:
            raise _unreadable(f"config field 'no_rope_layers' must list {n} flags")
        return (["chunked_attention" if r else "full_attention" for r in rope],
                "llama4 no_rope_layers + attention_chunk_size", "E")
    window = _window(config)
    if window is None:
        return ["full_attention"] * n, "no sliding_window: all layers full", "D"
    if config.get("sliding_window_pattern") is not None:
        # Gemma-3 / Cohere2: every pattern-th layer (1-based) is global.
        every = _req(config, ("sliding_window_pattern",))
        names = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                 for i in range(n)]
        return names, f"sliding_window_pattern {every} (Gemma-3 rule)", "E"
    if config.get("model_type") == "gemma2":
        # Gemma-2: layers alternate, starting with a sliding one (even 0-based indices).
        return (["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
                "gemma2 alternating rule", "E")
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


def kv_layout(config: Mapping[str, Any]) -> KVLayout:
    """Classify every layer of a text config.

    Raises :class:`~edge_core.errors.ArtifactError` ``config_unreadable``
    naming the field when the config lacks or garbles one the answer needs.
    """
    if not isinstance(config, Mapping):
        raise _unreadable(f"text config must be a JSON object, got {type(config).__name__}")
    n = _req(config, _LAYER_FIELDS, what="number of layers")
    names, source, evidence = _layer_names(config, n)
    parallel_hybrid = config.get("model_type") == "falcon_h1"
    if parallel_hybrid:
        source += "; falcon_h1: a Mamba-2 state beside attention in every layer"
    notes: list[str] = []
    attention_shape = None
    state_cache: dict[str, tuple[int, str]] = {}
    layers = []
    for i, name in enumerate(names):
        if name in _FULL_NAMES or name in _SLIDING_NAMES or name in _CHUNKED_NAMES or (
                name.endswith("attention") and name not in _RECURRENT_NAMES):
            if attention_shape is None:
                attention_shape = _attention_shape(config)
            elements, _, _, mla = attention_shape
            if name in _SLIDING_NAMES:
                window = _window(config)
                if window is None:
                    raise _unreadable(f"layer {i} is {name!r} but config has no 'sliding_window'")
                layers.append(LayerKV(i, "sliding", elements, window))
            elif name in _CHUNKED_NAMES:
                chunk = _window(config, "attention_chunk_size")
                if chunk is None:
                    raise _unreadable(
                        f"layer {i} is {name!r} but config has no 'attention_chunk_size'")
                layers.append(LayerKV(i, "chunked", elements, chunk))
            else:
                if name not in _FULL_NAMES:
                    note = f"layer type {name!r} is not one edge knows; charged as full attention"
                    if note not in notes:
                        notes.append(note)
                    evidence = "E"
                state = 0
                if parallel_hybrid:
                    # Falcon-H1 runs attention and a Mamba-2 mixer side by side in
                    # every layer: the layer keeps both a KV cache and a state.
                    state = _recurrent_state_elements(config, "mamba")[0]
                    evidence = "E"
                layers.append(LayerKV(i, "mla" if mla else "full", elements,
                                      state_elements=state))
        elif name in _RECURRENT_NAMES:
            if name not in state_cache:
                state_cache[name] = _recurrent_state_elements(config, name)
                notes.append(f"{name!r} state per sequence from the {state_cache[name][1]} "
                             f"shape (estimate)")
            evidence = "E"
            layers.append(LayerKV(i, "recurrent", state_elements=state_cache[name][0]))
        elif name in _NONE_NAMES:
            layers.append(LayerKV(i, "none"))
        else:
            raise _unreadable(f"layer {i} has layer type {name!r}, which edge does not know "
                              f"how to size (known: attention kinds, "
                              f"{', '.join(sorted(_RECURRENT_NAMES | _NONE_NAMES))})")
    kv_heads = head_dim = 0
    mla = False
    if attention_shape is not None:
        _, kv_heads, head_dim, mla = attention_shape
    return KVLayout(tuple(layers), kv_heads, head_dim, mla, source, evidence, tuple(notes))


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


def _vllm_group_layers(buckets: dict[tuple[Any, ...], int]) -> tuple[dict[tuple[Any, ...], int], int]:
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


def _charge(layout: KVLayout, rule: str, *, max_model_len: int, max_num_seqs: int,
            max_num_batched_tokens: int | None, block_size: int | None,
            concurrent_batches: int, kv_bytes: int, state_bytes: int) -> int:
    """Bytes for one rule; the KV pool plus recurrent state for every sequence."""
    if rule != "vllm":
        per_seq = 0
        for layer in layout.layers:
            if layer.attention:
                tokens = max_model_len
                if rule == "by_layer_type" and layer.window_tokens:
                    tokens = min(layer.window_tokens, max_model_len)
                per_seq += tokens * layer.elements_per_token * kv_bytes
            per_seq += layer.state_elements * state_bytes
        return per_seq * max_num_seqs

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
    #  MambaSpec (mamba_cache_mode "none"): one page per request.
    # A request is charged pages over all groups (_max_memory_usage_bytes_from_groups),
    # and check_enough_kv_cache_memory first subtracts the null block the
    # BlockPool holds back: one pool block (group size x page).
    in_flight = (max_num_batched_tokens if max_num_batched_tokens is not None
                 else max_model_len) * concurrent_batches
    promote = any(l.kind == "chunked" for l in layout.layers)
    buckets: dict[tuple[Any, ...], int] = {}
    for layer in layout.layers:
        keys = []
        if layer.attention:
            keys.append(("sliding", layer.window_tokens)
                        if layer.kind == "sliding" and not promote else ("full", None))
        if layer.state_elements:
            # vLLM gives a recurrent mixer its own MambaSpec layer.
            keys.append(("recurrent", layer.state_elements))
        for key in keys:
            buckets[key] = buckets.get(key, 0) + 1
    charged, group_size = _vllm_group_layers(buckets)
    elements = max((l.elements_per_token for l in layout.layers), default=0)
    per_token_layer = elements * kv_bytes
    page = per_token_layer * block_size if block_size else 0
    per_seq = 0
    for (kind, value), n in charged.items():
        if kind == "recurrent":
            state = value * state_bytes
            if page:
                # vLLM unifies page sizes in hybrids: a Mamba page is padded to
                # the attention page (whose block grows to hold the state).
                state = _cdiv(state, page) * page
            per_seq += n * state
            continue
        if kind == "full":
            tokens = max_model_len
        else:
            tokens = min(value - 1 + in_flight, max_model_len)
        if block_size:
            blocks = _cdiv(tokens, block_size) + (1 if kind == "sliding" else 0)
            per_seq += n * blocks * page
        else:
            per_seq += n * tokens * per_token_layer
    null_block = group_size * page if page and any(k != "recurrent" for k, _ in charged) else 0
    return per_seq * max_num_seqs + null_block


def _session_args(kv_dtype: str, model_dtype: str, *, max_num_seqs: int,
                  max_num_batched_tokens: int | None, block_size: int | None,
                  concurrent_batches: int) -> tuple[str, int, int]:
    _positive(max_num_seqs, "max_num_seqs")
    _positive(max_num_batched_tokens, "max_num_batched_tokens", optional=True)
    _positive(block_size, "block_size", optional=True)
    _positive(concurrent_batches, "concurrent_batches")
    model_bytes = _dtype_bytes(model_dtype, "model dtype")
    if str(kv_dtype).lower() == "auto":
        return str(model_dtype).lower(), model_bytes, model_bytes
    return str(kv_dtype).lower(), _dtype_bytes(kv_dtype, "KV cache dtype"), model_bytes


def estimate_kv(config: Mapping[str, Any], *, max_model_len: int, max_num_seqs: int = 1,
                max_num_batched_tokens: int | None = None, kv_dtype: str = "auto",
                model_dtype: str = "bfloat16", block_size: int | None = None,
                concurrent_batches: int = 1) -> KVEstimate:
    """Charge a session's KV cache three ways (see the module docstring).

    ``kv_dtype`` ``auto`` stores KV in ``model_dtype``; fp8 variants take one
    byte. Recurrent state is stored in the model dtype (vLLM's
    ``mamba_cache_dtype`` auto). ``max_num_batched_tokens`` None is charged as
    ``max_model_len`` in flight — vLLM's bound without chunked prefill, and the
    conservative one; pass the engine's value to get its real sliding charge.
    ``concurrent_batches`` is vLLM's ``max_concurrent_batches``: 1 on the CPU
    build (platforms/cpu.py forces async scheduling off), 2 under async
    scheduling (the CUDA default), the pipeline size under pipeline parallelism.
    ``block_size`` None charges exact tokens: no block rounding, no null block.
    """
    _positive(max_model_len, "max_model_len")
    resolved, kv_bytes, state_bytes = _session_args(
        kv_dtype, model_dtype, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
        concurrent_batches=concurrent_batches)
    layout = kv_layout(config)
    figures = {rule: _charge(layout, rule, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                             concurrent_batches=concurrent_batches, kv_bytes=kv_bytes, state_bytes=state_bytes)
               for rule in RULES}
    recurrent = sum(l.state_elements for l in layout.layers) * state_bytes * max_num_seqs
    per_token = sum(l.elements_per_token for l in layout.layers if l.attention) * kv_bytes
    if max_num_batched_tokens is None:
        in_flight = "max_model_len (max_num_batched_tokens not given)"
    else:
        in_flight = f"{concurrent_batches} x max_num_batched_tokens {max_num_batched_tokens}"
    rounding = (f"whole blocks of {block_size} tokens per layer per sequence, "
                f"+1 block per sliding layer, group padding, plus one null block"
                if block_size else "exact tokens (no block_size given), group padding")
    rules = {
        "flat": "every attention layer holds max_model_len tokens per sequence",
        "by_layer_type": "full/MLA layers hold max_model_len tokens; sliding and chunked "
                         "layers hold min(window, max_model_len)",
        "vllm": "vLLM 0.32 allocator: full layers max_model_len; sliding layers "
                f"min(window - 1 + in-flight tokens, max_model_len), in flight = {in_flight}; "
                f"chunked layers as full (hybrid manager off); {rounding}",
    }
    if recurrent:
        rules["recurrent"] = ("recurrent state per sequence in the model dtype, added to every "
                              "total (estimate from the state shapes); vLLM also enlarges the "
                              "attention block of hybrids, so its rounding may be coarser")
    return KVEstimate(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
        kv_dtype=resolved, kv_dtype_bytes=kv_bytes, state_dtype_bytes=state_bytes,
        layer_counts=layout.counts(), windows_tokens=layout.windows_tokens(),
        bytes_per_token_flat=per_token, bytes_flat=figures["flat"],
        bytes_by_layer_type=figures["by_layer_type"], bytes_vllm=figures["vllm"],
        recurrent_state_bytes=recurrent, evidence=layout.evidence, rules=rules)


def max_model_len_for(config: Mapping[str, Any], budget_bytes: int, *, max_num_seqs: int = 1,
                      max_num_batched_tokens: int | None = None, kv_dtype: str = "auto",
                      model_dtype: str = "bfloat16", block_size: int | None = None,
                      rule: str = "vllm", concurrent_batches: int = 1,
                      ceiling_tokens: int | None = None) -> int:
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
    _, kv_bytes, state_bytes = _session_args(
        kv_dtype, model_dtype, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
        concurrent_batches=concurrent_batches)
    layout = kv_layout(config)
    if ceiling_tokens is None:
        ceiling_tokens = _opt(config, _CONTEXT_FIELDS) or DEFAULT_CEILING_TOKENS
    _positive(ceiling_tokens, "ceiling_tokens")

    def fits(tokens: int) -> bool:
        return _charge(layout, rule, max_model_len=tokens, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                       concurrent_batches=concurrent_batches, kv_bytes=kv_bytes,
                       state_bytes=state_bytes) <= budget_bytes

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
