"""Pallas ragged paged attention: the entry point `jaxllm.layers.attention` calls for 'pallas'.

Same contract as `reference.ragged_paged_attention` (see its docstring). Both variants share
one plan, set here:
  * q is regrouped per KV head into rows [Hkv, T * group, D] (row = token * group + head in
    the group), so one grid step (kv head h, query block i) owns a [queries * group, D] tile
    holding every query head that reads KV head h: GQA/MQA read each KV page once per block.
  * A block of query tokens may span several sequences (decode packs many in one block); the
    step walks the sequences that own rows of the block, and for each one only the KV steps
    its rows can see (causal end, sliding-window start) with an online softmax in float32.
    Rows of other sequences are masked, which leaves their running state untouched.
  * Matmul inputs are in `compute_dtype` (a cache dtype that converts exactly), accumulation
    in float32; fp8 scales are applied to the f32 scores (k) and to the output (v): static
    floats folded into the kernel's constants, or run-time values (`scales`, a layer's own,
    from SMEM on TPU, a pointer on GPU).
Variant by backend: 'tpu' (Mosaic) on TPU, 'gpu' (Triton) on GPU. On CPU the default is the
GPU variant in interpret mode: the same algorithm, and orders of magnitude faster to interpret
than the TPU variant, whose simulated DMAs and semaphores are host callbacks
(docs/performance.md has the figures). The tests run both.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.ragged_paged_attention import block_sizes

# Layout of the int32 `meta` vector handed to both variants.
META_NUM_SEQS, META_LAYER, META_WINDOW, META_CHUNK = 0, 1, 2, 3


class Span(NamedTuple):
    """Where one sequence meets the query block [t0, t1), as int32 scalars."""
    lo: Any         # first token of the sequence in the block
    hi: Any         # one past its last token in the block (hi <= lo: none)
    delta: Any      # a token t sits at position t + delta
    key_start: Any  # keys [key_start, key_end) are visible to some row of the block
    key_end: Any
    kb_lo: Any      # KV steps [kb_lo, kb_hi) cover those keys
    kb_hi: Any


def seq_span(q_start, q_end, kv_len, t0, t1, window, keys_per_step: int, chunk=None) -> Span:
    """The rows and keys of a sequence inside a query block; `window` None = full attention,
    `chunk` None = no chunked local attention (both may be <= 0 at run time: none). The first
    row's window and chunk start before any later row's, so they bound the block's keys."""
    delta = kv_len - q_end
    lo, hi = jnp.maximum(q_start, t0), jnp.minimum(q_end, t1)
    key_end = hi + delta
    key_start = kb_lo = 0
    if window is not None:
        key_start = jnp.where(window > 0, jnp.maximum(lo + delta - window + 1, 0), 0)
    if chunk is not None:
        key_start = jnp.maximum(key_start, jnp.where(chunk > 0, chunk_start(lo + delta, chunk), 0))
    if window is not None or chunk is not None:
        kb_lo = lax.div(key_start, keys_per_step)
    kb_hi = jnp.where(hi > lo, lax.div(key_end + keys_per_step - 1, keys_per_step), kb_lo)
    return Span(lo, hi, delta, key_start, key_end, kb_lo, kb_hi)


def visible(kpos, qpos, window, chunk):
    """The causal mask, narrowed by the sliding window and the attention chunk where the
    kernel was built with them (None: statically absent; <= 0 at run time: none)."""
    mask = kpos <= qpos
    if window is not None:
        mask &= (window <= 0) | (kpos > qpos - window)
    if chunk is not None:
        mask &= (chunk <= 0) | (kpos >= chunk_start(qpos, chunk))
    return mask


def chunk_start(pos, chunk):
    """The first position of pos's attention chunk (the divisor kept >= 1 for chunk <= 0,
    which the callers mask off)."""
    c = jnp.maximum(chunk, 1)
    return lax.div(pos, c) * c


def compute_dtype(q_dtype, cache_dtype):
    """Matmul input dtype: one the cache converts to exactly (fp8 -> q's dtype), else f32."""
    q_dtype, cache_dtype = jnp.dtype(q_dtype), jnp.dtype(cache_dtype)
    if cache_dtype.itemsize == 1 or cache_dtype == q_dtype:
        return q_dtype
    return jnp.dtype(jnp.float32)


def default_variant() -> str:
    return "tpu" if jax.default_backend() == "tpu" else "gpu"


def _float_or(x, default: Optional[float]) -> Optional[float]:
    return default if x is None else float(x)


def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer,
                           kv_lens: jax.Array, block_tables: jax.Array, cu_q_lens: jax.Array,
                           num_seqs: jax.Array, *, k_scale=None, v_scale=None, **kw) -> jax.Array:
    """Attention output [T, Hq, D] in q's dtype; arguments as in the reference (see
    `_attention` for the kernel's own). k_scale / v_scale: None, a Python float (folded into
    the kernel as a constant), or a float32 scalar array, maybe traced (a layer's scale read
    from the checkpoint: passed to the kernel as an operand, so one program serves every
    layer)."""
    static = {}
    arrays = []
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None or isinstance(x, (int, float)):
            static[name] = None if x is None else float(x)
            arrays.append(1.0 if x is None else float(x))
        else:
            arrays.append(x)
    scales = None
    if len(static) < 2:  # an array among them: both go as one float32 [2] operand
        scales = jnp.stack([jnp.asarray(x, jnp.float32).reshape(()) for x in arrays])
        static = {}
    return _attention(q, k_cache, v_cache, layer, kv_lens, block_tables, cu_q_lens, num_seqs,
                      scales=scales, **static, **kw)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "soft_cap", "k_scale", "v_scale", "max_q_len", "chunk_blocks",
    "q_tile", "variant", "interpret"))
def _attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window=None,
    soft_cap: Optional[float] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    q_tile: Optional[int] = None,
    chunk_blocks: Optional[int] = None,
    max_q_len: Optional[int] = None,
    variant: Optional[str] = None,
    interpret: Any = None,
    sinks: Optional[jax.Array] = None,
    attention_chunk=None,
    scales: Optional[jax.Array] = None,
) -> jax.Array:
    """Attention output [T, Hq, D] in q's dtype; arguments as in the reference.

    q_tile / chunk_blocks override the block-size table (query tokens per grid step, pages
    per KV step). max_q_len: optional static bound on any sequence's query count this step
    (smaller query blocks for decode-only steps). variant: 'tpu' | 'gpu' | None (by backend).
    interpret: None = when the backend is CPU; the TPU variant also takes
    `pltpu.InterpretParams`. sinks: None or float32 [Hq] (the reference's attention sinks);
    attention_chunk: None or an int32 scalar, the reference's chunked local attention; both
    variants take both. scales: None, or float32 [2], (k_scale, v_scale) as run-time values
    (then k_scale / v_scale, the static ones, are None).
    """
    variant = variant or default_variant()
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    T, hq, d = q.shape
    _, _, hkv, bs, _ = k_cache.shape
    g = hq // hkv
    blk = block_sizes.choose(variant, head_dim=d, page_size=bs, group=g,
                             max_q_len=min(max_q_len or T, T),
                             table_width=block_tables.shape[1], queries=q_tile,
                             pages=chunk_blocks)
    nqb = -(-T // blk.queries)
    t_pad = nqb * blk.queries

    rows = q.reshape(T, hkv, g, d)
    rows = jnp.pad(rows, ((0, t_pad - T), (0, 0), (0, blk.group - g), (0, 0)))
    rows = rows.transpose(1, 0, 2, 3).reshape(hkv, t_pad * blk.group, d)

    cu_q_lens = cu_q_lens.astype(jnp.int32)
    n = num_seqs.reshape(()).astype(jnp.int32)
    # First sequence owning a row of each query block (the first whose tokens end past it).
    first_seq = jnp.minimum(
        jnp.searchsorted(cu_q_lens[1:], jnp.arange(nqb) * blk.queries, side="right"), n)
    window = 0 if sliding_window is None else sliding_window
    chunk = 0 if attention_chunk is None else attention_chunk
    meta = jnp.stack([n, jnp.asarray(layer, jnp.int32).reshape(()),
                      jnp.asarray(window, jnp.int32).reshape(()),
                      jnp.asarray(chunk, jnp.int32).reshape(())])

    extra = {}
    if sinks is not None:  # one sink per row, in the rows' layout: the running max starts there
        sk = jnp.pad(sinks.astype(jnp.float32).reshape(hkv, g), ((0, 0), (0, blk.group - g)))
        extra["sinks"] = jnp.tile(sk, (1, t_pad))  # [Hkv, T_pad * group]
    if scales is not None:  # the kernel multiplies sm_scale by scales[0], its output by [1]
        extra["scales"] = scales.astype(jnp.float32).reshape(2)
    impl = importlib.import_module(f"pallas_kernels.ragged_paged_attention.kernel_{variant}")
    out = impl.attend(
        rows, k_cache, v_cache, meta, first_seq.astype(jnp.int32), cu_q_lens,
        kv_lens.astype(jnp.int32), block_tables.astype(jnp.int32), blocks=blk,
        sm_scale=float(sm_scale) * _float_or(k_scale, 1.0), v_scale=_float_or(v_scale, 1.0),
        soft_cap=_float_or(soft_cap, None),
        has_window=sliding_window is not None, has_chunk=attention_chunk is not None,
        compute_dtype=compute_dtype(q.dtype, k_cache.dtype), interpret=interpret, **extra)
    out = out.reshape(hkv, t_pad, blk.group, d)[:, :T, :g].transpose(1, 0, 2, 3)
    return out.reshape(T, hq, d)
