"""Pallas grouped matmul over MXFP4 experts (`mxfp4`'s layout), decoded tile by tile in the
kernel: no float copy of an expert is ever written to memory.

The rows (sorted by group, as `jax.lax.ragged_dot` takes them) are first spread, in XLA, into
whole tiles of `tm` rows that each belong to one group (`tile_rows`: at most M / tm + G
tiles). The grid is (tile, column block); each program reads its tile's rows [tm, K], its
group's q [K / 2, tn] and scales [K / 32, tn], and runs the inputs in chunks of `tk`: the
chunk's nibbles decoded to two [tk / 2, tn] halves (even and odd inputs) times their scales,
then two dots against the chunk's even and odd columns (x's columns are reordered per chunk
beforehand, `mxfp4.even_odd`), summed in float32. Tiles past the used ones write zeros.

Variants: `tpu` (Mosaic) selects the group's q and scales through the block index maps (the
tile -> group table is a scalar-prefetch operand); `gpu` (Triton, which has neither) takes q
and scales whole and loads the group's slices in the kernel. Both run in interpret mode on
CPU (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.grouped_matmul.mxfp4 import GROUP, e2m1, even_odd, pow2

F32 = jnp.float32


def tile_rows(group_sizes: jax.Array, rows: int, tm: int):
    """Rows sorted by group -> (each row's place in the tiled layout [P] (rows past the groups:
    P, a spare row), each tile's group [P / tm], the number of tiles used), P = (rows / tm +
    G) * tm: each group's rows padded to whole tiles, in order."""
    G = group_sizes.shape[0]
    starts = jnp.cumsum(group_sizes) - group_sizes
    tiles = (group_sizes + tm - 1) // tm
    tile_ends = jnp.cumsum(tiles)
    P = (-(-rows // tm) + G) * tm
    r = jnp.arange(rows)
    group = jnp.searchsorted(starts + group_sizes, r, side="right")
    g = jnp.minimum(group, G - 1)
    place = jnp.where(group < G, (tile_ends[g] - tiles[g]) * tm + r - starts[g], P)
    tile_group = jnp.minimum(jnp.searchsorted(tile_ends, jnp.arange(P // tm), side="right"),
                             G - 1).astype(jnp.int32)
    return place, tile_group, tile_ends[-1].astype(jnp.int32)


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def block_sizes(M: int, K: int, N: int, variant: str = "gpu") -> tuple[int, int, int]:
    """(tm, tk, tn): 16 rows a tile at decode sizes, up to 128 for many rows; tk a power-of-two
    multiple of the 32-input scale group (up to 512) dividing K, at least 64 where K allows
    (whole 32-row uint8 tiles of q per chunk on TPU); tn a power of two dividing N, up to 128
    (Triton's blocks must be powers of two), on TPU 128 or, where 128 does not divide N, all
    of N (Mosaic's blocks: whole 128-lane tiles or the whole axis)."""
    tm = 16 if M <= 64 else 64 if M <= 1024 else 128
    tk = GROUP * _pow2_divisor(K // GROUP, 16)
    if variant == "tpu":
        return tm, tk, 128 if N % 128 == 0 else N
    return tm, tk, _pow2_divisor(N, 128)


def _tile(load_x, load_q, load_s, o_ref, *, K, tk, dtype, used, t):
    """One program: o [tm, tn] = the tile's rows [tm, K] @ its group's decoded columns, chunk
    by chunk. load_x(start, n): rows' columns [tm, n]; load_q(start, n): q rows [n, tn];
    load_s(start, n): the scales of q rows [start, start + n) as float32 [n, tn], each of
    those rows' own (a 32-input group spans 16 rows)."""
    tm, tn = o_ref.shape
    h = tk // 2

    @pl.when(t < used)
    def _():
        def chunk(c, acc):
            q, s = load_q(c * h, h).astype(jnp.int32), load_s(c * h, h)  # (no 8-bit vector ops)
            lo = (e2m1(q & 15) * s).astype(dtype)
            hi = (e2m1(q >> 4) * s).astype(dtype)
            acc += jnp.dot(load_x(c * tk, h).astype(dtype), lo, preferred_element_type=F32)
            return acc + jnp.dot(load_x(c * tk + h, h).astype(dtype), hi,
                                 preferred_element_type=F32)

        o_ref[...] = lax.fori_loop(0, K // tk, chunk, jnp.zeros((tm, tn), F32))

    @pl.when(t >= used)
    def _():
        o_ref[...] = jnp.zeros((tm, tn), F32)


def _mxfp4_tpu_kernel(tg_ref, used_ref, x_ref, q_ref, s_ref, o_ref, *, K, tk, dtype):
    def load_s(a, n):  # a group's scale row repeated over its 16 rows
        s = pow2(s_ref[pl.ds(lax.div(a, 16), n // 16), :])
        return jnp.broadcast_to(s[:, None, :], (n // 16, 16, s.shape[-1])).reshape(n, -1)

    _tile(lambda a, n: x_ref[:, pl.ds(a, n)], lambda a, n: q_ref[pl.ds(a, n), :], load_s,
          o_ref, K=K, tk=tk, dtype=dtype, used=used_ref[0], t=pl.program_id(0))


def _mxfp4_gpu_kernel(tg_ref, used_ref, x_ref, q_ref, s_ref, o_ref, *, K, tk, dtype):
    t, j = pl.program_id(0), pl.program_id(1)
    g, tn = tg_ref[t], o_ref.shape[1]
    cols = j * tn + jnp.arange(tn)

    def load_s(a, n):  # one gather: each q row's group's scale
        return pow2(s_ref[g, lax.div(a + jnp.arange(n), 16)[:, None], cols[None, :]])

    _tile(lambda a, n: x_ref[:, pl.ds(a, n)], lambda a, n: q_ref[g, pl.ds(a, n), pl.ds(j * tn, tn)],
          load_s, o_ref, K=K, tk=tk, dtype=dtype, used=used_ref[0], t=t)


@functools.partial(jax.jit, static_argnames=("variant", "interpret", "compute_dtype"))
def grouped_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, group_sizes: jax.Array, *,
                   variant: str = "tpu", interpret: bool = False, compute_dtype=None
                   ) -> jax.Array:
    """float32 [M, N]: rows of group g (group_sizes[g] consecutive rows of x [M, K], in
    order) times MXFP4 expert g (q [G, K / 2, N], scale [G, K / 32, N] uint8); rows past the
    groups zero (they are `mxfp4.grouped_matmul`'s, the reference). compute_dtype: the dots'
    operand dtype (default x's; every decoded weight is exact in bfloat16)."""
    M, K = x.shape
    G, _, N = q.shape
    dtype = jnp.dtype(compute_dtype or x.dtype)
    tm, tk, tn = block_sizes(M, K, N, variant)
    place, tile_group, used = tile_rows(group_sizes, M, tm)
    P = tile_group.shape[0] * tm
    xs = jnp.zeros((P + 1, K), x.dtype).at[place].set(even_odd(x, tk))[:P]
    grid = (P // tm, N // tn)
    out_shape = jax.ShapeDtypeStruct((P, N), F32)
    used = used.reshape(1)
    if variant == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=grid,
            in_specs=[pl.BlockSpec((tm, K), lambda t, j, tg, u: (t, 0)),
                      pl.BlockSpec((None, K // 2, tn), lambda t, j, tg, u: (tg[t], 0, j)),
                      pl.BlockSpec((None, K // GROUP, tn), lambda t, j, tg, u: (tg[t], 0, j))],
            out_specs=pl.BlockSpec((tm, tn), lambda t, j, tg, u: (t, j)))
        out = pl.pallas_call(functools.partial(_mxfp4_tpu_kernel, K=K, tk=tk, dtype=dtype),
                             out_shape=out_shape, grid_spec=spec, interpret=interpret,
                             )(tile_group, used, xs, q, scale)
    elif variant == "gpu":
        out = pl.pallas_call(
            functools.partial(_mxfp4_gpu_kernel, K=K, tk=tk, dtype=dtype), out_shape=out_shape,
            grid=grid,
            in_specs=[pl.no_block_spec, pl.no_block_spec,
                      pl.BlockSpec((tm, K), lambda t, j: (t, 0)),
                      pl.no_block_spec, pl.no_block_spec],
            out_specs=pl.BlockSpec((tm, tn), lambda t, j: (t, j)),
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
            interpret=interpret)(tile_group, used, xs, q, scale)
    else:
        raise ValueError(f"variant must be 'tpu' or 'gpu', got {variant!r}")
    return out[jnp.minimum(place, P - 1)] * (place < P)[:, None]
