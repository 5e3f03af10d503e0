"""The gated DeltaNet kernels for GPU (Triton): kernel.py's bodies. Triton has no scalar
prefetch: the chunk ranges are passed whole (a raw pointer). Its tiles must be powers of 2 of
at least 16 for the dots: Dk and Dv are zero-padded to that (zero key lanes add nothing to any
product, zero value lanes stay zero) and sliced off after."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta_rule import kernel

MIN_DIM = 16


def _lanes(d: int) -> int:
    return max(1 << max(d - 1, 0).bit_length(), MIN_DIM)


def _pad(x, axis, to):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, to - x.shape[axis])
    return jnp.pad(x, pad)


def chunked(first, q, k, v, cumc, cumr, beta, h0, *, interpret: bool = False):
    """kernel.chunk_layout's operands -> (out [H, NC, C, Dv] float32, hn [H, S, Dk, Dv])."""
    H, NC, C, Dk = q.shape
    Dv, S = v.shape[-1], h0.shape[1]
    dk, dv = _lanes(Dk), _lanes(Dv)
    q, k, v = _pad(q, 3, dk), _pad(k, 3, dk), _pad(v, 3, dv)
    h0 = _pad(_pad(h0, 2, dk), 3, dv)

    def whole(x):
        return pl.BlockSpec((None,) + x.shape[1:], lambda h, s: (h,) + (0,) * (x.ndim - 1))

    state = pl.BlockSpec((None, None, dk, dv), lambda h, s: (h, s, 0, 0))
    out, hn = pl.pallas_call(
        kernel.chunked_kernel, grid=(H, S),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), whole(q), whole(k), whole(v), whole(cumc),
                  whole(cumr), whole(beta), state],
        out_specs=[whole(v), state],
        out_shape=[jax.ShapeDtypeStruct((H, NC, C, dv), jnp.float32),
                   jax.ShapeDtypeStruct(h0.shape, jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(first, q, k, v, cumc, cumr, beta, h0)
    return out[..., :Dv], hn[:, :, :Dk, :Dv]


def recurrent(q, k, v, g, beta, h0, *, interpret: bool = False):
    """kernel.recurrent_layout's operands -> (out [H, T, 1, Dv] float32, hn [H, T, Dk, Dv])."""
    H, T, Dk, _ = q.shape
    Dv = v.shape[-1]
    dk, dv = _lanes(Dk), _lanes(Dv)
    q, k, v = _pad(q, 2, dk), _pad(k, 2, dk), _pad(v, 3, dv)
    h0 = _pad(_pad(h0, 2, dk), 3, dv)

    def row(x):
        return pl.BlockSpec((None, None) + x.shape[2:], lambda h, t: (h, t, 0, 0))

    out, hn = pl.pallas_call(
        kernel.recurrent_kernel, grid=(H, T),
        in_specs=[row(x) for x in (q, k, v, g, beta, h0)], out_specs=[row(v), row(h0)],
        out_shape=[jax.ShapeDtypeStruct(v.shape, jnp.float32),
                   jax.ShapeDtypeStruct(h0.shape, jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(q, k, v, g, beta, h0)
    return out[..., :Dv], hn[:, :, :Dk, :Dv]
