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
<= its own (causal), and > position - sliding_window when a window is given, and, with an
attention_chunk C (Llama 4's chunked local attention), only keys of its own chunk: positions
>= (position // C) * C.
  attend_to     int32 [T] or None       the last key position each query sees (>= its own):
                                        Gemma 3's bidirectional image tokens see their whole
                                        image (the window's start still applies)
  sinks         float32 [Hq] or None    attention sinks (GPT-OSS): one learned logit per query
                                        head that joins the softmax's denominator and adds no
                                        value, so a head can attend to "nothing"

The algorithm splits each sequence's queries into small tiles, takes the tiles in groups, and
for each group walks the pages in chunks with an online softmax in float32. Both loops have
dynamic trip counts (live tiles; keys up to the group's last query position, from the sliding
window's start), so the cost follows the real ragged work, while the shapes depend only on T
and the metadata sizes: one compiled step per token bucket.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp

ArrayOrInt = Union[jax.Array, int]


# A KV scale: None (statically absent: values stored as they are), a float, or a float32
# scalar array, maybe traced (per layer: the layer scan's slice of the checkpoint's scales).
Scale = Union[jax.Array, float, None]


def _dequant(x: jax.Array, scale: Scale) -> jax.Array:
    x = x.astype(jnp.float32)
    return x if scale is None else x * scale


def quantize_kv(x: jax.Array, scale: Scale, dtype) -> jax.Array:
    """k or v as a cache of `dtype` stores it: divided by its scale (if any), and for a float8
    cache saturated to the format's largest finite value (as vLLM's conversion does; a plain
    cast makes e4m3 overflow NaN and e5m2 overflow inf). Values in range convert as a plain
    cast does."""
    if scale is not None:
        x = x.astype(jnp.float32) / scale
    if jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -top, top)
    return x.astype(dtype)


def chunk_start(pos, chunk):
    """The first position of the attention chunk holding `pos` (chunk <= 0: read as 1, the
    caller masks that case off; it keeps the division defined)."""
    return pos // jnp.maximum(chunk, 1) * jnp.maximum(chunk, 1)


def write_kv(k_cache: jax.Array, v_cache: jax.Array, layer: ArrayOrInt, k: jax.Array,
             v: jax.Array, slot_mapping: jax.Array, *, k_scale: Scale = None,
             v_scale: Scale = None) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's k/v [T, Hkv, D] into slots (block * BS + offset); slot < 0 = padding.
    The cache stores k / k_scale and v / v_scale (`quantize_kv`); attention multiplies back.

    Run under jit with the caches donated, this updates them in place.
    """
    nb, bs = k_cache.shape[1], k_cache.shape[3]
    blk = jnp.where(slot_mapping < 0, nb, slot_mapping // bs)  # out of range -> dropped
    off = slot_mapping % bs
    k_cache = k_cache.at[layer, blk, :, off].set(quantize_kv(k, k_scale, k_cache.dtype),
                                                 mode="drop")
    v_cache = v_cache.at[layer, blk, :, off].set(quantize_kv(v, v_scale, v_cache.dtype),
                                                 mode="drop")
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
    k_scale: Scale = None,
    v_scale: Scale = None,
    sinks: Optional[jax.Array] = None,
    attention_chunk: Optional[ArrayOrInt] = None,
    attend_to: Optional[jax.Array] = None,
    q_tile: int = 8,
    tiles_per_group: int = 8,
    chunk_blocks: Optional[int] = None,
) -> jax.Array:
    """Attention output [T, Hq, D] in q's dtype. See the module docstring for the layout.

    sliding_window: None or <= 0 means full attention; may be a traced scalar (per layer).
    attention_chunk: None or <= 0 means no chunking; may be a traced scalar (per layer). A
      query sees only keys of its own chunk of that many positions (it combines with a window:
      the later of the two starts wins).
    attend_to: None (static: causal) or int32 [T]: query t sees keys up to position
      max(its own, attend_to[t]) instead of its own (Gemma 3's token_type_ids mask: an image
      token attends to its whole image; those keys must be in the cache, i.e. in this step).
    q_tile: queries per tile (a sequence's queries are split into tiles of this many).
    tiles_per_group: tiles processed together per loop step.
    chunk_blocks: pages per online-softmax step (default: ~256 keys per step).
    sinks: None (static: no cost) or float32 [Hq]; the online softmax then starts from the
      sink's logit (running max = sink, denominator = exp(0) = 1, no value).
    k_scale / v_scale: None, or what the cache's values are multiplied by when read (a float8
      cache holds k / k_scale; a float32 scalar, maybe traced: the layer's own).
    """
    T, hq, d = q.shape
    _, _, hkv, bs, _ = k_cache.shape
    S, B = block_tables.shape
    g = hq // hkv
    qt = min(q_tile, T)
    cb = chunk_blocks or max(1, min(B, 256 // bs))
    if B % cb:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, cb - B % cb)))
    C = cb * bs

    seq_valid = jnp.arange(S) < num_seqs.reshape(())
    q_lens = jnp.where(seq_valid, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    kv_lens = jnp.where(seq_valid, kv_lens, 0)

    # Split every sequence's queries into tiles of qt; tile j belongs to sequence tile_seq[j].
    n_tiles_max = min(T, -(-T // qt) + S)
    tg = min(tiles_per_group, n_tiles_max)
    tiles_per_seq = (q_lens + qt - 1) // qt
    tile_end = jnp.cumsum(tiles_per_seq)
    num_tiles = tile_end[-1]
    j = jnp.arange(n_tiles_max)
    tile_seq = jnp.clip(jnp.searchsorted(tile_end, j, side="right"), 0, S - 1)
    tile_q0 = (j - (tile_end[tile_seq] - tiles_per_seq[tile_seq])) * qt

    window = None if sliding_window is None else jnp.asarray(sliding_window, jnp.int32)
    local = None if attention_chunk is None else jnp.asarray(attention_chunk, jnp.int32)

    def group(gi, out):
        jj = jnp.minimum(gi * tg + jnp.arange(tg), n_tiles_max - 1)
        seq = tile_seq[jj]
        qi = tile_q0[jj][:, None] + jnp.arange(qt)  # [tg, qt] query index within its sequence
        live = ((gi * tg + jnp.arange(tg)) < num_tiles)[:, None] & (qi < q_lens[seq][:, None])
        tok = jnp.where(live, cu_q_lens[seq][:, None] + qi, T)  # T = out of range: dropped
        qpos = kv_lens[seq][:, None] - q_lens[seq][:, None] + qi
        qhi = qpos  # the last key position each query sees
        if attend_to is not None:
            qhi = jnp.maximum(qpos, attend_to[jnp.minimum(tok, T - 1)])
        qg = q[jnp.minimum(tok, T - 1)].astype(jnp.float32) * sm_scale  # [tg, qt, Hq, D]
        qg = qg.reshape(tg, qt, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(tg, hkv, g * qt, d)
        tables = block_tables[seq]
        hi = (jnp.max(jnp.where(live, qhi, -1)) + C) // C  # causal: no key past the last query
        lo = 0
        first = jnp.min(jnp.where(live, qpos, jnp.iinfo(jnp.int32).max))
        if window is not None:
            lo = jnp.where(window > 0, jnp.maximum(first - window + 1, 0) // C, 0)
            lo = jnp.minimum(lo, hi)
        if local is not None:  # the group's first query's chunk starts before any later one's
            lo = jnp.maximum(lo, jnp.where(local > 0, chunk_start(first, local) // C, 0))
            lo = jnp.minimum(lo, hi)

        def chunk(i, carry):
            m, l, acc = carry
            blk = jax.lax.dynamic_slice_in_dim(tables, i * cb, cb, axis=1)  # [tg, cb]
            k = _dequant(k_cache[layer, blk], k_scale)  # [tg, cb, Hkv, BS, D]
            v = _dequant(v_cache[layer, blk], v_scale)
            k = k.transpose(0, 2, 1, 3, 4).reshape(tg, hkv, C, d)
            v = v.transpose(0, 2, 1, 3, 4).reshape(tg, hkv, C, d)
            s = jnp.einsum("thqd,thkd->thqk", qg, k)  # [tg, Hkv, G*qt, C]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            kpos = i * C + jnp.arange(C)
            mask = (kpos[None, None, :] <= qhi[:, :, None]) & live[:, :, None]  # [tg, qt, C]
            if window is not None:
                mask &= (window <= 0) | (kpos[None, None, :] > qpos[:, :, None] - window)
            if local is not None:
                start = chunk_start(qpos, local)[:, :, None]
                mask &= (local <= 0) | (kpos[None, None, :] >= start)
            s = s.reshape(tg, hkv, g, qt, C)
            s = jnp.where(mask[:, None, None], s, -jnp.inf).reshape(tg, hkv, g * qt, C)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_safe[..., None])
            corr = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
            l = l * corr + p.sum(-1)
            acc = acc * corr[..., None] + jnp.einsum("thqk,thkd->thqd", p, v)
            return m_new, l, acc

        if sinks is None:
            m0 = jnp.full((tg, hkv, g * qt), -jnp.inf, jnp.float32)
            l0 = jnp.zeros((tg, hkv, g * qt), jnp.float32)
        else:  # rows are (kv head, group member, query) in that order
            sk = jnp.repeat(sinks.astype(jnp.float32).reshape(hkv, g), qt, axis=1)
            m0 = jnp.broadcast_to(sk, (tg, hkv, g * qt))
            l0 = jnp.ones((tg, hkv, g * qt), jnp.float32)
        init = (m0, l0,
                jnp.zeros((tg, hkv, g * qt, d), jnp.float32))
        _, l, acc = jax.lax.fori_loop(lo, hi, chunk, init)
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]
        o = o.reshape(tg, hkv, g, qt, d).transpose(0, 3, 1, 2, 4).reshape(tg, qt, hq, d)
        return out.at[tok].set(o.astype(out.dtype), mode="drop")

    out = jnp.zeros((T, hq, d), q.dtype)
    return jax.lax.fori_loop(0, (num_tiles + tg - 1) // tg, group, out)
