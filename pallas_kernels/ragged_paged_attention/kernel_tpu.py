"""Mosaic TPU variant: grid (kv head, query block); KV pages DMA'd from HBM, double-buffered.

The scalar metadata (meta, per-block first sequence, cu_q_lens, kv_lens, flat block table) is
prefetched into SMEM, so page ids are known before any vector work. The stacked caches stay in
HBM (`pl.ANY`); each KV step copies `pages` whole [BS, D] slabs `cache[layer, page, head]`
into one slot of a 2-slot VMEM buffer while the other slot is being computed on. Whole slabs
keep the DMA a plain strided copy (no ref reshape, which also keeps the interpreter working).
Pages a step does not need (past the causal end, before the window or the attention chunk) are
not fetched; their stale slots are masked. Each grid step primes its own first copy, so steps are independent
("parallel"): megacore may split them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.block_sizes import Blocks
from pallas_kernels.ragged_paged_attention.kernel import (
    META_CHUNK, META_LAYER, META_NUM_SEQS, META_WINDOW, seq_span, visible)

LANES = 128  # running max / sum are kept lane-replicated, the layout TPU vregs want


def _start(copy):
    copy.start()


def _wait(copy):
    copy.wait()


def _kernel(meta_ref, first_ref, cu_ref, kv_lens_ref, tables_ref,  # SMEM (scalar prefetch)
            q_ref, k_hbm, v_hbm,                                     # q tile in VMEM; caches
            *refs,  # [sinks tile,] [scales,] out tile, then scratch: k_buf, v_buf, sems,
            # m, l, acc
            queries, group, pages, table_width, num_seq_slots, sm_scale, v_scale, soft_cap,
            has_window, has_chunk, compute_dtype, has_sinks, has_scales):
    sink_ref = refs[0] if has_sinks else None
    scale_ref = refs[int(has_sinks)] if has_scales else None
    o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref = refs[-7:]
    if scale_ref is not None:  # run-time scales (SMEM): the layer's own
        sm_scale, v_scale = sm_scale * scale_ref[0], scale_ref[1]
    h, i = pl.program_id(0), pl.program_id(1)
    num_seqs, layer = meta_ref[META_NUM_SEQS], meta_ref[META_LAYER]
    window = meta_ref[META_WINDOW] if has_window else None
    chunk = meta_ref[META_CHUNK] if has_chunk else None
    rows, d = q_ref.shape
    bs = k_buf.shape[2]
    keys = pages * bs
    t0 = i * queries
    t1 = t0 + queries

    def span(s):
        s = jnp.minimum(s, num_seq_slots - 1)  # callers may probe one past the last sequence
        return seq_span(cu_ref[s], cu_ref[s + 1], kv_lens_ref[s], t0, t1, window, keys, chunk)

    def live(s):  # sequence s is real and owns rows at or after this block's start
        return (s < num_seqs) & (cu_ref[jnp.minimum(s, num_seq_slots)] < t1)

    def advance(s, kb):
        """First (sequence, kv step) at or after (s, kb) that has work in this block."""
        def more(c):
            return live(c[0]) & (c[1] >= span(c[0]).kb_hi)
        return lax.while_loop(more, lambda c: (c[0] + 1, span(c[0] + 1).kb_lo), (s, kb))

    def for_each_copy(s, kb, slot, op):
        """Apply op (start or wait) to the K and V copies of the pages step (s, kb) needs."""
        sp = span(s)
        for p in range(pages):
            pos = kb * pages + p

            @pl.when((pos * bs < sp.key_end) & ((pos + 1) * bs > sp.key_start))
            def _():
                page = tables_ref[s * table_width + jnp.minimum(pos, table_width - 1)]
                op(pltpu.make_async_copy(k_hbm.at[layer, page, h], k_buf.at[slot, p],
                                         sems.at[0, slot]))
                op(pltpu.make_async_copy(v_hbm.at[layer, page, h], v_buf.at[slot, p],
                                         sems.at[1, slot]))

    def attend_step(s, kb, slot):
        sp = span(s)
        q = q_ref[...].astype(compute_dtype)
        k = k_buf[slot].astype(compute_dtype).reshape(keys, d)
        v = v_buf[slot].astype(compute_dtype).reshape(keys, d)
        kpos_v = kb * keys + lax.broadcasted_iota(jnp.int32, (keys, d), 0)
        v = jnp.where((kpos_v >= sp.key_start) & (kpos_v < sp.key_end), v, 0)  # stale slots

        scores = jnp.einsum("rd,kd->rk", q, k, preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        tok = t0 + lax.div(lax.broadcasted_iota(jnp.int32, (rows, keys), 0), group)
        kpos = kb * keys + lax.broadcasted_iota(jnp.int32, (rows, keys), 1)
        qpos = tok + sp.delta
        mask = (tok >= sp.lo) & (tok < sp.hi) & visible(kpos, qpos, window, chunk)
        scores = jnp.where(mask, scores, -jnp.inf)

        m_prev, l_prev = m_ref[...][:, :1], l_ref[...][:, :1]
        m_new = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
        p = jnp.exp(scores - m_use)
        corr = jnp.exp(m_prev - m_use)
        m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(corr * l_prev + p.sum(axis=1, keepdims=True), l_ref.shape)
        acc_ref[...] = corr * acc_ref[...] + jnp.dot(
            p.astype(compute_dtype), v, preferred_element_type=jnp.float32)

    if sink_ref is None:
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    else:  # attention sinks: each row's running max starts at its head's sink, its sum at 1
        m_ref[...] = jnp.broadcast_to(sink_ref[...], m_ref.shape)
        l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    s0 = first_ref[i]
    s0, kb0 = advance(s0, span(s0).kb_lo)
    pl.when(live(s0))(lambda: for_each_copy(s0, kb0, 0, _start))

    def body(c):
        s, kb, slot = c
        s_next, kb_next = advance(s, kb + 1)
        pl.when(live(s_next))(lambda: for_each_copy(s_next, kb_next, 1 - slot, _start))
        for_each_copy(s, kb, slot, _wait)
        attend_step(s, kb, slot)
        return s_next, kb_next, 1 - slot

    lax.while_loop(lambda c: live(c[0]), body, (s0, kb0, 0))
    l = l_ref[...][:, :1]
    o_ref[...] = (acc_ref[...] * (v_scale / jnp.where(l > 0, l, 1.0))).astype(o_ref.dtype)


def attend(rows, k_cache, v_cache, meta, first_seq, cu_q_lens, kv_lens, block_tables, *,
           blocks: Blocks, sm_scale, v_scale, soft_cap, has_window, has_chunk,
           compute_dtype, interpret, sinks=None, scales=None) -> jax.Array:
    """rows [Hkv, T_pad * group, D] -> attention rows of the same shape (see kernel.py);
    sinks: None or float32 [Hkv, T_pad * group], each row's sink logit; scales: None or
    float32 [2], run-time (k, v) scales (in SMEM)."""
    hkv, n_rows, d = rows.shape
    _, _, _, bs, _ = k_cache.shape
    num_seq_slots, table_width = block_tables.shape
    tile = blocks.queries * blocks.group
    kernel = functools.partial(
        _kernel, queries=blocks.queries, group=blocks.group, pages=blocks.pages,
        table_width=table_width, num_seq_slots=num_seq_slots, sm_scale=sm_scale,
        v_scale=v_scale, soft_cap=soft_cap, has_window=has_window, has_chunk=has_chunk,
        compute_dtype=compute_dtype, has_sinks=sinks is not None,
        has_scales=scales is not None)
    q_spec = pl.BlockSpec((None, tile, d), lambda h, i, *_: (h, i, 0))
    buf = (2, blocks.pages, bs, d)
    if interpret is True:
        interpret = pltpu.InterpretParams()
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(hkv, n_rows // tile),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY),
                      pl.BlockSpec(memory_space=pl.ANY)]
            + ([] if sinks is None
               else [pl.BlockSpec((None, tile, 1), lambda h, i, *_: (h, i, 0))])
            + ([] if scales is None else [pl.BlockSpec(memory_space=pltpu.SMEM)]),
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM(buf, k_cache.dtype), pltpu.VMEM(buf, v_cache.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.VMEM((tile, LANES), jnp.float32), pltpu.VMEM((tile, LANES), jnp.float32),
                pltpu.VMEM((tile, d), jnp.float32),
            ]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype),
        interpret=interpret or False,
    )(meta, first_seq, cu_q_lens, kv_lens, block_tables.reshape(-1), rows, k_cache, v_cache,
      *(() if sinks is None else (sinks[..., None],)), *(() if scales is None else (scales,)))
