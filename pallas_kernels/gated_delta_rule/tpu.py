"""The gated DeltaNet kernels for TPU (Mosaic): kernel.py's chunk and row math. The chunked
kernel takes the chunk ranges by scalar prefetch (SMEM) and leaves the chunk arrays in HBM:
each chunk is copied into VMEM scratch, computed, and its output copied back, so VMEM holds
one chunk whatever the step's prompt tokens (the copies are synchronous: no overlap of a
chunk's loads with the previous chunk's math yet)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.gated_delta_rule import kernel


def _chunked_kernel(first_ref, q_hbm, k_hbm, v_hbm, cumc_hbm, cumr_hbm, beta_hbm, h0_ref,
                    o_hbm, hn_ref, q_buf, k_buf, v_buf, cumc_buf, cumr_buf, beta_buf, o_buf):
    h, s = pl.program_id(0), pl.program_id(1)

    def chunk(c, state):
        for src, buf in ((q_hbm, q_buf), (k_hbm, k_buf), (v_hbm, v_buf), (cumc_hbm, cumc_buf),
                         (cumr_hbm, cumr_buf), (beta_hbm, beta_buf)):
            pltpu.sync_copy(src.at[h, c], buf)
        out, state = kernel.chunk_step(q_buf[...], k_buf[...], v_buf[...], cumc_buf[...],
                                       cumr_buf[...], beta_buf[...], state)
        o_buf[...] = out
        pltpu.sync_copy(o_buf, o_hbm.at[h, c])
        return state

    hn_ref[...] = lax.fori_loop(first_ref[s], first_ref[s + 1], chunk, h0_ref[...])


def chunked(first, q, k, v, cumc, cumr, beta, h0, *, interpret: bool = False):
    """kernel.chunk_layout's operands -> (out [H, NC, C, Dv] float32, hn [H, S, Dk, Dv])."""
    H, NC, C, Dk = q.shape
    Dv, S = v.shape[-1], h0.shape[1]
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    state = pl.BlockSpec((None, None, Dk, Dv), lambda h, s, first: (h, s, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(H, S), in_specs=[hbm] * 6 + [state],
        out_specs=[hbm, state],
        scratch_shapes=[pltpu.VMEM(x.shape[2:], x.dtype) for x in (q, k, v, cumc, cumr, beta)]
        + [pltpu.VMEM((C, Dv), jnp.float32)])
    return pl.pallas_call(
        _chunked_kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((H, NC, C, Dv), jnp.float32),
                   jax.ShapeDtypeStruct(h0.shape, jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(first, q, k, v, cumc, cumr, beta, h0)


def recurrent(q, k, v, g, beta, h0, *, interpret: bool = False):
    """kernel.recurrent_layout's operands -> (out [H, T, 1, Dv] float32, hn [H, T, Dk, Dv])."""
    H, T = q.shape[:2]

    def row(x):
        return pl.BlockSpec((None, None) + x.shape[2:], lambda h, t: (h, t, 0, 0))

    return pl.pallas_call(
        kernel.recurrent_kernel, grid=(H, T),
        in_specs=[row(x) for x in (q, k, v, g, beta, h0)], out_specs=[row(v), row(h0)],
        out_shape=[jax.ShapeDtypeStruct(v.shape, jnp.float32),
                   jax.ShapeDtypeStruct(h0.shape, jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(q, k, v, g, beta, h0)
