"""Pure-JAX ragged paged attention: the reference every kernel is tested against, and the CPU path.

Layout (shared by the reference, the Pallas kernels and the model runner):
  q             [T, Hq, D]              flat ragged batch: the tokens of sequence s are
                                        q[cu_q_lens[s]:cu_q_lens[s+1]]
  k_cache/v_cache [L, NB, Hkv, BS, D]   all layers stacked; page `b` of layer `l` is cache[l, b]
  layer         int32 scalar            which layer of the stacked cache to read
  kv_lens       int32 [S]               KV length of each sequence, this step's tokens included
  block_tables  int32 [S, B]            page ids of each sequence, in order
  cu_q_lens     int32 [S + 1]           cumulative query lengths (non-decreasing; padding
                                        sequences repeat the last value)
  num_seqs      int32 [1]               sequences past this are padding and ignored
Query i of sequence s sits at position kv_lens[s] - q_len[s] + i and sees keys at positions
<= its own (causal), and > position - sliding_window when a window is given.

The algorithm gathers each sequence's queries into a [S, max_q_len] tile, then walks the
sequence's pages in chunks with an online softmax (float32) whose trip count is set by the
longest live sequence, so the cost follows the real context length, not the table width.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp

ArrayOrInt = Union[jax.Array, int]


def _dequant(x: jax.Array, scale: Optional[float]) -> jax.Array:
    x = x.astype(jnp.float32)
    return x if scale is None else x * scale


def write_kv(k_cache: jax.Array, v_cache: jax.Array, layer: ArrayOrInt, k: jax.Array,
             v: jax.Array, slot_mapping: jax.Array, *, k_scale: Optional[float] = None,
             v_scale: Optional[float] = None) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's k/v [T, Hkv, D] into slots (block * BS + offset); slot < 0 = padding.

    Run under jit with the caches donated, this updates them in place.
    """
    nb, bs = k_cache.shape[1], k_cache.shape[3]
    blk = jnp.where(slot_mapping < 0, nb, slot_mapping // bs)  # out of range -> dropped
    off = slot_mapping % bs

    def quant(x, scale):
        x = x.astype(jnp.float32) / scale if scale is not None else x
        return x.astype(k_cache.dtype)

    k_cache = k_cache.at[layer, blk, :, off].set(quant(k, k_scale), mode="drop")
    v_cache = v_cache.at[layer, blk, :, off].set(quant(v, v_scale), mode="drop")
    return k_cache, v_cache


def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: ArrayOrInt,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: Optional[ArrayOrInt] = None,
    soft_cap: Optional[float] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    max_q_len: Optional[int] = None,
    chunk_blocks: Optional[int] = None,
) -> jax.Array:
    """Attention output [T, Hq, D] in q's dtype. See the module docstring for the layout.

    sliding_window: None or <= 0 means full attention; may be a traced scalar (per layer).
    max_q_len: static bound on any sequence's query count this step (default T).
    chunk_blocks: pages per online-softmax step (default: ~512 keys per step).
    """
    T, hq, d = q.shape
    _, _, hkv, bs, _ = k_cache.shape
    S, B = block_tables.shape
    g = hq // hkv
    Q = T if max_q_len is None else min(max_q_len, T)
    cb = chunk_blocks or max(1, min(B, 512 // bs))
    if B % cb:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, cb - B % cb)))
    C = cb * bs

    seq_valid = jnp.arange(S) < num_seqs.reshape(())
    q_lens = jnp.where(seq_valid, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    kv_lens = jnp.where(seq_valid, kv_lens, 0)

    # Queries of each sequence as a [S, Q] tile.
    qi = jnp.arange(Q)
    tok = jnp.clip(cu_q_lens[:-1, None] + qi, 0, T - 1)  # [S, Q]
    q_valid = qi[None, :] < q_lens[:, None]
    qpos = kv_lens[:, None] - q_lens[:, None] + qi[None, :]  # [S, Q]
    qs = q[tok].astype(jnp.float32) * sm_scale  # [S, Q, Hq, D]
    qs = qs.reshape(S, Q, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(S, hkv, g * Q, d)

    window = None
    if sliding_window is not None:
        window = jnp.asarray(sliding_window, jnp.int32)

    def body(i, carry):
        m, l, acc = carry
        blk = jax.lax.dynamic_slice_in_dim(block_tables, i * cb, cb, axis=1)  # [S, cb]
        k = _dequant(k_cache[layer, blk], k_scale)  # [S, cb, Hkv, BS, D]
        v = _dequant(v_cache[layer, blk], v_scale)
        k = k.transpose(0, 2, 1, 3, 4).reshape(S, hkv, C, d)
        v = v.transpose(0, 2, 1, 3, 4).reshape(S, hkv, C, d)
        s = jnp.einsum("shqd,shkd->shqk", qs, k)  # [S, Hkv, G*Q, C]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = i * C + jnp.arange(C)
        mask = (kpos[None, None, :] <= qpos[:, :, None]) & q_valid[:, :, None]  # [S, Q, C]
        if window is not None:
            mask &= (window <= 0) | (kpos[None, None, :] > qpos[:, :, None] - window)
        s = s.reshape(S, hkv, g, Q, C)
        s = jnp.where(mask[:, None, None], s, -jnp.inf).reshape(S, hkv, g * Q, C)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("shqk,shkd->shqd", p, v)
        return m_new, l, acc

    init = (jnp.full((S, hkv, g * Q), -jnp.inf, jnp.float32),
            jnp.zeros((S, hkv, g * Q), jnp.float32),
            jnp.zeros((S, hkv, g * Q, d), jnp.float32))
    n_chunks = (kv_lens.max() + C - 1) // C
    _, l, acc = jax.lax.fori_loop(0, n_chunks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [S, Hkv, G*Q, D]
    out = out.reshape(S, hkv, g, Q, d).transpose(0, 3, 1, 2, 4).reshape(S, Q, hq, d)

    # Back to the flat token order.
    t = jnp.arange(T)
    seq_of = jnp.clip(jnp.searchsorted(cu_q_lens[1:], t, side="right"), 0, S - 1)
    live = t < cu_q_lens[num_seqs.reshape(())]
    o = out[seq_of, jnp.clip(t - cu_q_lens[seq_of], 0, Q - 1)]
    return jnp.where(live[:, None, None], o, 0).astype(q.dtype)
