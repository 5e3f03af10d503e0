"""Pallas GPU (Triton) variant: grid (kv head, query block); pages gathered through the table.

Triton has no scalar prefetch or manual DMA: the caches and metadata are passed whole (raw
pointers), and each KV step loads its [keys, D] K and V tiles with one masked gather,
`cache[layer, table[s, key // BS], head, key % BS, :]`; keys outside the visible range are
not read. Triton pipelines the loads of the loop itself (num_stages). Tiles are powers of 2
(block_sizes pads the GQA group; q's head dim is zero-padded here and the padded lanes of the
cache are masked off, never read).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention import block_sizes
from pallas_kernels.ragged_paged_attention.block_sizes import Blocks
from pallas_kernels.ragged_paged_attention.kernel import (
    META_CHUNK, META_LAYER, META_NUM_SEQS, META_WINDOW, seq_span, visible)


def _kernel(meta_ref, first_ref, cu_ref, kv_lens_ref, tables_ref, q_ref, k_ref, v_ref, *refs,
            queries, group, pages, sm_scale, v_scale, soft_cap, has_window, has_chunk,
            compute_dtype, has_sinks, has_scales):
    sink_ref = refs[0] if has_sinks else None
    scale_ref = refs[int(has_sinks)] if has_scales else None
    o_ref = refs[-1]
    if scale_ref is not None:  # run-time scales: the layer's own
        sm_scale, v_scale = sm_scale * scale_ref[0], scale_ref[1]
    h, i = pl.program_id(0), pl.program_id(1)
    num_seqs, layer = meta_ref[META_NUM_SEQS], meta_ref[META_LAYER]
    window = meta_ref[META_WINDOW] if has_window else None
    chunk = meta_ref[META_CHUNK] if has_chunk else None
    rows, lanes = q_ref.shape
    bs, d = k_ref.shape[3:]
    table_width = tables_ref.shape[1]
    keys = pages * bs
    t0 = i * queries
    t1 = t0 + queries
    q = q_ref[...].astype(compute_dtype)
    tok = t0 + lax.div(jnp.arange(rows, dtype=jnp.int32), group)[:, None]  # [rows, 1]
    lane = jnp.arange(lanes, dtype=jnp.int32)[None, :]  # all-array indices: one gather

    def live(s):  # sequence s is real and owns rows at or after this block's start
        return (s < num_seqs) & (cu_ref[s] < t1)

    def attend_seq(carry):
        s, m, l, acc = carry
        sp = seq_span(cu_ref[s], cu_ref[s + 1], kv_lens_ref[s], t0, t1, window, keys, chunk)
        qpos = tok + sp.delta

        def step(kb, state):
            m_prev, l_prev, acc_prev = state
            kpos = kb * keys + jnp.arange(keys, dtype=jnp.int32)
            page = tables_ref[s, jnp.minimum(lax.div(kpos, bs), table_width - 1)]
            need = ((kpos >= sp.key_start) & (kpos < sp.key_end))[:, None] & (lane < d)
            at = (layer, page[:, None], h, lax.rem(kpos, bs)[:, None], jnp.minimum(lane, d - 1))
            # Masked-off keys and lanes are not read; what the load leaves there is zeroed.
            k = plgpu.load(k_ref.at[at], mask=need).astype(compute_dtype)
            v = plgpu.load(v_ref.at[at], mask=need).astype(compute_dtype)
            k, v = jnp.where(need, k, 0), jnp.where(need, v, 0)

            scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * sm_scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            kp = kpos[None, :]
            mask = (tok >= sp.lo) & (tok < sp.hi) & visible(kp, qpos, window, chunk)
            scores = jnp.where(mask, scores, -jnp.inf)

            m_new = jnp.maximum(m_prev, scores.max(axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
            p = jnp.exp(scores - m_use[:, None])
            corr = jnp.exp(m_prev - m_use)
            pv = jnp.dot(p.astype(compute_dtype), v, preferred_element_type=jnp.float32)
            return m_new, corr * l_prev + p.sum(axis=1), corr[:, None] * acc_prev + pv

        m, l, acc = lax.fori_loop(sp.kb_lo, sp.kb_hi, step, (m, l, acc))
        return s + 1, m, l, acc

    if sink_ref is None:
        m0, l0 = jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32)
    else:  # attention sinks: each row's running max starts at its head's sink, its sum at 1
        m0, l0 = sink_ref[...], jnp.ones((rows,), jnp.float32)
    init = (first_ref[i], m0, l0, jnp.zeros((rows, lanes), jnp.float32))
    _, _, l, acc = lax.while_loop(lambda c: live(c[0]), attend_seq, init)
    o_ref[...] = (acc * (v_scale / jnp.where(l > 0, l, 1.0))[:, None]).astype(o_ref.dtype)


def attend(rows, k_cache, v_cache, meta, first_seq, cu_q_lens, kv_lens, block_tables, *,
           blocks: Blocks, sm_scale, v_scale, soft_cap, has_window, has_chunk,
           compute_dtype, interpret, sinks=None, scales=None) -> jax.Array:
    """rows [Hkv, T_pad * group, D] -> attention rows of the same shape (see kernel.py);
    sinks: None or float32 [Hkv, T_pad * group], each row's sink logit; scales: None or
    float32 [2], run-time (k, v) scales."""
    hkv, n_rows, d = rows.shape
    lanes = max(block_sizes.pow2_ceil(d), block_sizes.GPU_MIN_HEAD_DIM)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, lanes - d)))
    tile = blocks.queries * blocks.group
    kernel = functools.partial(
        _kernel, queries=blocks.queries, group=blocks.group, pages=blocks.pages,
        sm_scale=sm_scale, v_scale=v_scale, soft_cap=soft_cap, has_window=has_window,
        has_chunk=has_chunk, compute_dtype=compute_dtype, has_sinks=sinks is not None,
        has_scales=scales is not None)
    whole = pl.BlockSpec(memory_space=pl.ANY)
    q_spec = pl.BlockSpec((None, tile, lanes), lambda h, i: (h, i, 0))
    out = pl.pallas_call(
        kernel,
        grid=(hkv, n_rows // tile),
        in_specs=[whole] * 5 + [q_spec, whole, whole]
        + ([] if sinks is None else [pl.BlockSpec((None, tile), lambda h, i: (h, i))])
        + ([] if scales is None else [whole]),
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.GPU_NUM_WARPS,
                                             num_stages=block_sizes.GPU_NUM_STAGES),
        interpret=bool(interpret),
    )(meta, first_seq, cu_q_lens, kv_lens, block_tables, rows, k_cache, v_cache,
      *(() if sinks is None else (sinks,)), *(() if scales is None else (scales,)))
    return out[..., :d]
