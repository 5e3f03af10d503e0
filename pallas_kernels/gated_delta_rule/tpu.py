"""The gated DeltaNet kernels for TPU (Mosaic): kernel.py's bodies with scalar prefetch of
the chunk ranges (SMEM); a head's chunk arrays are one VMEM block, resident while the head's
sequences run (the sequence axis is sequential, "arbitrary")."""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.gated_delta_rule import kernel


def chunked(first, q, k, v, cumc, cumr, beta, h0, *, interpret: bool = False):
    """kernel.chunk_layout's operands -> (out [H, NC, C, Dv] float32, hn [H, S, Dk, Dv])."""
    H, NC, C, Dk = q.shape
    Dv, S = v.shape[-1], h0.shape[1]

    def whole(x):  # the head's chunk array
        return pl.BlockSpec((None,) + x.shape[1:], lambda h, s, first: (h,) + (0,) * (x.ndim - 1))

    state = pl.BlockSpec((None, None, Dk, Dv), lambda h, s, first: (h, s, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(H, S),
        in_specs=[whole(q), whole(k), whole(v), whole(cumc), whole(cumr), whole(beta), state],
        out_specs=[whole(v), state])
    return pl.pallas_call(
        kernel.chunked_kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((H, NC, C, Dv), jax.numpy.float32),
                   jax.ShapeDtypeStruct(h0.shape, jax.numpy.float32)],
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
        out_shape=[jax.ShapeDtypeStruct(v.shape, jax.numpy.float32),
                   jax.ShapeDtypeStruct(h0.shape, jax.numpy.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(q, k, v, g, beta, h0)
