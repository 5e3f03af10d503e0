"""MXFP4 weights kept 4-bit: their layout, their decoding (plain jnp, so the Pallas kernel and
the XLA paths share it) and the grouped-matmul reference.

A weight [K, N] (K inputs) is two uint8 arrays:
  q      [K / 2, N]   byte i of a column holds inputs 2i (low nibble) and 2i + 1 (high nibble),
                      each an e2m1 code: sign, 2 exponent bits, 1 mantissa bit
  scale  [K / 32, N]  e8m0 exponents, biased by 127: one per 32 consecutive inputs
and its value is e2m1(code) * 2 ** (scale - 127), the OCP MX definition and transformers'
`convert_moe_packed_tensors` (GPT-OSS's published experts are these bytes transposed to
[N, K / 32, 16]). Stacked experts put a group axis first ([G, K / 2, N], [G, K / 32, N]).

Packing along the input axis keeps a weight tile's decoding free of lane shuffles: the low
nibbles of q are the even inputs' weights and the high nibbles the odd ones', so
x @ W = x[:, even] @ lo + x[:, odd] @ hi, with x's columns permuted once per matmul.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
GROUP = 32  # inputs per scale


def e2m1(codes: jax.Array) -> jax.Array:
    """4-bit e2m1 codes (any integer dtype, in [0, 16)) -> float32, by arithmetic (no table:
    a gather is slow or absent in kernels). Exponent 0 is subnormal (0 or 0.5), else
    (1 + m / 2) * 2 ** (e - 1); code 8 is -0.0, as transformers' table has it."""
    c = codes.astype(jnp.int32)
    e, m = (c >> 1) & 3, (c & 1).astype(F32)
    mag = jnp.where(e > 0, (2.0 + m) * (jnp.left_shift(1, e).astype(F32) * 0.25), 0.5 * m)
    return jnp.where((c & 8) != 0, -mag, mag)


def pow2(scale: jax.Array) -> jax.Array:
    """e8m0 exponents (uint8) -> float32 2 ** (scale - 127), exactly: built from the bits
    (exp2 need not be exact on every platform); 0 is 2 ** -127, a subnormal."""
    s = scale.astype(jnp.uint32)
    bits = jnp.where(s == 0, jnp.uint32(1 << 22), s << 23)
    return jax.lax.bitcast_convert_type(bits, F32)


def decode_halves(q: jax.Array, scale: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """q [K / 2, N] and scale [K / 32, N] -> (the even inputs' weights, the odd inputs') each
    [K / 2, N] in dtype. Every value is exact in float32 and bfloat16 (one mantissa bit
    times a power of two), short of float32's subnormal range."""
    h, n = q.shape
    s = pow2(scale)[:, None, :]

    def half(codes):
        return (e2m1(codes).reshape(h // 16, 16, n) * s).reshape(h, n).astype(dtype)

    return half(q & 15), half(q >> 4)


def dequantize(q: jax.Array, scale: jax.Array, dtype=F32) -> jax.Array:
    """q [K / 2, N], scale [K / 32, N] -> the float weight [K, N] in dtype."""
    lo, hi = decode_halves(q, scale, dtype)
    return jnp.stack([lo, hi], axis=1).reshape(2 * q.shape[0], q.shape[1])


def quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A float weight [K, N] -> (q, scale): per 32 inputs of a column the power of two that
    brings the largest magnitude to at most 6, each value then rounded to the nearest e2m1
    value (ties to the smaller magnitude). For tests and dummy weights."""
    K, N = w.shape
    g = w.astype(F32).reshape(K // GROUP, GROUP, N)
    amax = jnp.max(jnp.abs(g), axis=1, keepdims=True)
    exp = jnp.ceil(jnp.log2(jnp.maximum(amax, 2.0 ** -126) / 6.0)).astype(jnp.int32)
    exp = jnp.clip(exp, -127, 127)
    y = g / pow2((exp + 127).astype(jnp.uint8))
    grid = e2m1(jnp.arange(8))
    codes = jnp.argmin(jnp.abs(jnp.abs(y)[..., None] - grid), axis=-1)
    codes = (codes | jnp.where(y < 0, 8, 0)).astype(jnp.uint8).reshape(K, N)
    q = codes[0::2] | (codes[1::2] << 4)
    return q, (exp[:, 0] + 127).astype(jnp.uint8)


def even_odd(x: jax.Array, chunk: int) -> jax.Array:
    """x [M, K] with each `chunk` consecutive columns reordered evens first, then odds (what
    the kernel's two half dots over a chunk of q's rows read)."""
    M, K = x.shape
    return x.reshape(M, K // chunk, chunk // 2, 2).swapaxes(2, 3).reshape(M, K)


def grouped_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, group_sizes: jax.Array
                   ) -> jax.Array:
    """The reference: float32 [M, N], rows of group g (group_sizes[g] consecutive rows of x,
    in order) times the dequantized expert g ([G, K / 2, N], [G, K / 32, N]); rows past the
    groups zero. Dequantizes every expert at once: an oracle for tests, not a runtime path."""
    w = jax.vmap(lambda q, s: dequantize(q, s, F32))(q, scale)
    return jax.lax.ragged_dot(x.astype(F32), w, group_sizes,
                              precision=jax.lax.Precision.HIGHEST)
