"""Matmul for XLA:CPU (`kernel_cpu.cc` via the XLA FFI): the projections and the LM head read one
layer of the stacked weights in place, bf16 or f32; few rows at memory speed.

`available()` says whether the kernel could be built here; callers fall back to `jnp` dots.
Weights are first laid out by `pack` (strips of 16 columns, so that every read is sequential and
no step repacks them); quantized ones (int8, int4) by `pack_quantized`, for `matmul_quantized`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi

TARGET = "jaxllm_matmul"
ARGMAX_TARGET = "jaxllm_matmul_argmax"
SILU_TARGET = "jaxllm_matmul_silu"
QUANT_TARGET = "jaxllm_matmul_quant"
QUANT_SILU_TARGET = "jaxllm_matmul_quant_silu"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_cpu.cc")
STRIP = 16  # columns per packed strip
GROUP = {jnp.dtype(jnp.int8): 2, jnp.dtype(jnp.uint8): 4}  # strips stored side by side


def available() -> bool:
    """Build (once) and register the kernel; False if this machine cannot build it."""
    return cpu_ffi.register(_SOURCE, ((TARGET, "JaxllmMatmul"),
                                      (ARGMAX_TARGET, "JaxllmMatmulArgmax"),
                                      (SILU_TARGET, "JaxllmMatmulSilu"),
                                      (QUANT_TARGET, "JaxllmMatmulQuant"),
                                      (QUANT_SILU_TARGET, "JaxllmMatmulQuantSilu")))


def _paired(w: jax.Array) -> bool:
    return w.dtype in (jnp.bfloat16, jnp.uint16)


def pack(w: jax.Array) -> jax.Array:
    """Stacked [L, K, N] -> strips of 16 columns, each contiguous, the last zero-padded: float32
    [L, S, K, 16]; bfloat16 (or its uint16 bits) [L, S, ceil(K / 2), 32], rows in pairs
    (w[2p, c], w[2p + 1, c]) for c < 16, an odd K padded with a zero row."""
    L, K, N = w.shape
    S = -(-N // STRIP)
    w = jnp.pad(w, ((0, 0), (0, K % 2 if _paired(w) else 0), (0, S * STRIP - N)))
    if _paired(w):
        P = w.shape[1] // 2
        return w.reshape(L, P, 2, S, STRIP).transpose(0, 3, 1, 4, 2).reshape(L, S, P, 2 * STRIP)
    return w.reshape(L, K, S, STRIP).transpose(0, 2, 1, 3)


def unpack(w: jax.Array, k: int, n: int) -> jax.Array:
    """`pack`'s inverse: [L, k, n]."""
    L, S = w.shape[:2]
    if _paired(w):
        w = w.reshape(L, S, -1, STRIP, 2).transpose(0, 1, 2, 4, 3).reshape(L, S, -1, STRIP)
    return w.transpose(0, 2, 1, 3).reshape(L, -1, S * STRIP)[:, :k, :n]


def matmul(x: jax.Array, w: jax.Array, layer=0, *, n: int, out_dtype=jnp.float32,
           gated: bool = False) -> jax.Array:
    """[M, n] = x [M, K] @ w[layer], summed in float32, w `pack`ed from n columns, in float32,
    bfloat16 or uint16 (bfloat16 bits). A bfloat16 x against bfloat16 weights stays bfloat16
    (the products are exact either way; with AMX or AVX512_BF16 the kernel multiplies pairs
    natively), any other x is taken as float32. out_dtype float32, or bfloat16: the sums rounded
    as `astype(bfloat16)` would, in the kernel.

    gated: w is a gate/up projection of 2 n columns (gate, then up) and the result is
    `activation.reference.silu_and_mul` of its float32 product in out_dtype, computed while the
    product is in cache (it is never written)."""
    x = _operand(x, w, 2 * n if gated else n)
    _check_out(out_dtype)
    call = jax.ffi.ffi_call(SILU_TARGET if gated else TARGET,
                            jax.ShapeDtypeStruct((x.shape[0], n), out_dtype))
    return call(x, w, jnp.asarray(layer, jnp.int32))


def _check_out(out_dtype) -> None:
    if jnp.dtype(out_dtype) not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")


def _operand(x: jax.Array, w: jax.Array, n: int) -> jax.Array:
    """x as the kernel takes it, after checking that the kernel is here and n fits w."""
    if not available():
        raise RuntimeError("the CPU matmul kernel could not be built (see the log)")
    return operand(x, w, n)


def operand(x: jax.Array, w: jax.Array, n: int) -> jax.Array:
    """x as a kernel on packed weights w takes it (bfloat16 against bfloat16 weights, else
    float32), after checking that n columns fit w's strips."""
    if not STRIP * (w.shape[1] - 1) < n <= STRIP * w.shape[1]:
        raise ValueError(f"packed weights of {w.shape[1]} strips need n in "
                         f"({STRIP * (w.shape[1] - 1)}, {STRIP * w.shape[1]}], got {n}")
    return x if x.dtype == jnp.bfloat16 and _paired(w) else x.astype(jnp.float32)


def argmax(x: jax.Array, w: jax.Array, layer=0, *, n: int) -> jax.Array:
    """int32 [M]: the first column of each row's maximum of `matmul(x, w, layer, n=n)` (as
    jnp.argmax of the float32 result; a row with a NaN: unspecified), for a greedy LM head: the
    kernel keeps each strip's maximum while the products are in cache and never writes them."""
    x = _operand(x, w, n)
    M, S = x.shape[0], w.shape[1]
    call = jax.ffi.ffi_call(ARGMAX_TARGET, (jax.ShapeDtypeStruct((M, S), jnp.float32),
                                            jax.ShapeDtypeStruct((M, S), jnp.int32)))
    best, col = call(x, w, jnp.asarray(layer, jnp.int32), n=np.int64(n))
    # The first strip holding the maximum has the smallest column: two plain reductions
    # (jnp.argmax's index-carrying reduction is much slower on XLA:CPU); a NaN row gives n - 1.
    top = jnp.where(best == best.max(axis=1, keepdims=True), col, n - 1)
    return jnp.min(top, axis=1)


def packed_rows(w: jax.Array, ids: jax.Array, k: int) -> jax.Array:
    """Rows `ids` of the [N, k] matrix whose transpose `pack` made into w (an embedding packed as
    LM head, looked up in place): [len(ids), k]."""
    s, c = ids // STRIP, ids % STRIP
    if _paired(w):  # [1, S, P, 32]: value k of column c at [k // 2, 2 * c + k % 2]
        rows = w[0, s[:, None], :, 2 * c[:, None] + jnp.arange(2)]  # [n, 2, P]
        return rows.transpose(0, 2, 1).reshape(len(ids), -1)[:, :k]
    return w[0, s, :, c]


def pack_quantized(q: jax.Array, scale: jax.Array, zero=None) -> tuple:
    """Quantized weights (`jaxllm.layers.quantization.QuantizedWeight`'s form, stacked) -> the
    arrays `matmul_quantized` reads: (q, scale) or (q, scale, zero).

    q int8 [L, K, N], or int4 as uint8 [L, K, N / 2] (column 2i in the low nibble, 2i + 1 in the
    high one, each plus 8); scale, zero float32 [L, G, N] (G groups of K / G inputs; with G > 1
    a multiple of 2, int4 of 4). Packed in strips of 16 columns (S of them, the last padded),
    each strip a run of 32-byte loads: int8 rows 2p and 2p + 1 (an odd K padded with a zero row);
    int4 rows 4b .. 4b + 3 (K padded with zeros to a multiple of 4), byte 2j + t holding
    q[4b + t, j] + 8 in its low nibble and q[4b + 2 + t, j] + 8 in its high one (the order of the
    kernel's bf16 pairs). The strips are stored in groups of W (int8 2, int4 4; the last group
    padded), the group's loads side by side, so that a task's strips are one sequential read:
    int8 [L, ceil(S / 2), ceil(K / 2), 64], int4 uint8 [L, ceil(S / 4), ceil(K / 4), 128];
    scale, zero float32 [L, S, G, 16]."""
    if q.dtype not in GROUP:
        raise ValueError(f"q must be int8, or uint8 (int4 pairs), got {q.dtype}")
    L, K = q.shape[:2]
    G, W = scale.shape[1], GROUP[q.dtype]
    rows = 4 if q.dtype == jnp.uint8 else 2  # a load's rows: a group of inputs holds whole loads
    if K % G or (G > 1 and K // G % rows):
        raise ValueError(f"{G} groups of {K} inputs: the kernel needs groups of a multiple of "
                         f"{rows} inputs")
    if q.dtype == jnp.uint8:
        q = jnp.stack([q & 15, q >> 4], axis=-1).reshape(L, K, -1)  # values plus 8
    N = q.shape[2]
    S = -(-N // STRIP)
    pad = ((0, 0), (0, -K % rows), (0, -(-S // W) * W * STRIP - N))
    if rows == 4:  # rows 4b + 2h + t: [L, K' / 4, h, t, S' / W, W, 16], nibble h of byte 2j + t
        u = jnp.pad(q, pad, constant_values=8).reshape(L, -1, 2, 2, -(-S // W), W, STRIP)
        packed = (u[:, :, 0] | (u[:, :, 1] << 4)).transpose(0, 3, 1, 4, 5, 2)
    else:  # rows 2p + t: [L, K' / 2, t, S' / W, W, 16]
        packed = jnp.pad(q, pad).reshape(L, -1, 2, -(-S // W), W, STRIP).transpose(0, 3, 1, 4, 2, 5)

    def strips(a):
        a = jnp.pad(a.astype(jnp.float32), ((0, 0), (0, 0), (0, S * STRIP - N)))
        return a.reshape(L, G, S, STRIP).transpose(0, 2, 1, 3)

    packed = packed.reshape(L, -(-S // W), -1, W * 32)
    return (packed, strips(scale)) + (() if zero is None else (strips(zero),))


def matmul_quantized(x: jax.Array, packed: tuple, layer=0, *, n: int, out_dtype=jnp.float32,
                     gated: bool = False) -> jax.Array:
    """[M, n] = x [M, K] @ ((q - zero) * scale)[layer] of `pack_quantized` weights, summed in
    float32 (per group: the products of x and q, less zero times x's sum over the group, times
    the scale; one order whatever M, so a row's bits do not depend on the other rows). x
    float32 or bfloat16 (with AVX512_BF16, bfloat16 x multiplies q natively); out_dtype and
    gated as `matmul`'s."""
    _check_out(out_dtype)
    if not available():
        raise RuntimeError("the CPU matmul kernel could not be built (see the log)")
    q, scale = packed[:2]
    zero = packed[2] if len(packed) > 2 else jnp.zeros((0,), jnp.float32)
    cols = 2 * n if gated else n
    if not STRIP * (scale.shape[1] - 1) < cols <= STRIP * scale.shape[1]:
        raise ValueError(f"packed weights of {scale.shape[1]} strips need n in "
                         f"({STRIP * (scale.shape[1] - 1)}, {STRIP * scale.shape[1]}], got {cols}")
    if x.dtype != jnp.bfloat16:
        x = x.astype(jnp.float32)
    call = jax.ffi.ffi_call(QUANT_SILU_TARGET if gated else QUANT_TARGET,
                            jax.ShapeDtypeStruct((x.shape[0], n), out_dtype))
    return call(x, q, scale, zero, jnp.asarray(layer, jnp.int32))
