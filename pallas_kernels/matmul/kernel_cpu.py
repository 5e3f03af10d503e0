"""Matmul for XLA:CPU (`kernel_cpu.cc` via the XLA FFI): the projections and the LM head read one
layer of the stacked weights in place, bf16 or f32; few rows at memory speed.

`available()` says whether the kernel could be built here; callers fall back to `jnp` dots.
Weights are first laid out by `pack` (strips of 16 columns, so that every read is sequential and
no step repacks them).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi

TARGET = "jaxllm_matmul"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_cpu.cc")
STRIP = 16  # columns per packed strip
# bf16 strips hold column BF16_ORDER[j] at position j: the kernel's shift-and-mask conversion
# reads even and odd positions as columns 0-7 and 8-15.
BF16_ORDER = np.array([(j % 2) * 8 + j // 2 for j in range(STRIP)])
_BF16_POSITION = np.argsort(BF16_ORDER)  # where column c of a bf16 strip sits


def available() -> bool:
    """Build (once) and register the kernel; False if this machine cannot build it."""
    return cpu_ffi.register(_SOURCE, ((TARGET, "JaxllmMatmul"),))


def pack(w: jax.Array) -> jax.Array:
    """Stacked [L, K, N] -> [L, ceil(N / 16), K, 16]: strips of 16 columns, each contiguous,
    the last zero-padded; bf16 (or its uint16 bits) in BF16_ORDER within a strip."""
    L, K, N = w.shape
    S = -(-N // STRIP)
    w = jnp.pad(w, ((0, 0), (0, 0), (0, S * STRIP - N))).reshape(L, K, S, STRIP)
    if w.dtype in (jnp.bfloat16, jnp.uint16):
        w = w[..., BF16_ORDER]
    return w.transpose(0, 2, 1, 3)


def unpack(w: jax.Array, n: int) -> jax.Array:
    """`pack`'s inverse: [L, S, K, 16] -> [L, K, n]."""
    if w.dtype in (jnp.bfloat16, jnp.uint16):
        w = w[..., _BF16_POSITION]
    L, S, K, _ = w.shape
    return w.transpose(0, 2, 1, 3).reshape(L, K, S * STRIP)[..., :n]


def matmul(x: jax.Array, w: jax.Array, layer=0, *, n: int) -> jax.Array:
    """float32 [M, n] = x [M, K] @ w[layer], w `pack`ed [L, S, K, 16] from n columns, in float32,
    bfloat16 or uint16 (bfloat16 bits). A bfloat16 x against bfloat16 weights stays bfloat16 (the
    products are exact either way; with AVX512_BF16 the kernel multiplies pairs natively), any
    other x is taken as float32."""
    if not available():
        raise RuntimeError("the CPU matmul kernel could not be built (see the log)")
    if not STRIP * (w.shape[1] - 1) < n <= STRIP * w.shape[1]:
        raise ValueError(f"packed weights of {w.shape[1]} strips need n in "
                         f"({STRIP * (w.shape[1] - 1)}, {STRIP * w.shape[1]}], got {n}")
    if not (x.dtype == jnp.bfloat16 and w.dtype in (jnp.bfloat16, jnp.uint16)):
        x = x.astype(jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, w, jnp.asarray(layer, jnp.int32))


def packed_rows(w: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows `ids` of the [N, K] matrix whose transpose `pack` made into w [1, S, K, 16] (an
    embedding packed as LM head, looked up in place): [len(ids), K]."""
    pos = ids % STRIP
    if w.dtype in (jnp.bfloat16, jnp.uint16):
        pos = jnp.asarray(_BF16_POSITION, jnp.int32)[pos]
    return w[0, ids // STRIP, :, pos]
