"""Few-row matmul for XLA:CPU (`kernel_cpu.cc` via the XLA FFI): decode-step projections that
read one layer of the stacked weights in place, bf16 or f32, at memory speed.

`available()` says whether the kernel could be built here; callers fall back to `jnp` dots.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_ffi

TARGET = "jaxllm_matmul"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_cpu.cc")


def available() -> bool:
    """Build (once) and register the kernel; False if this machine cannot build it."""
    return cpu_ffi.register(_SOURCE, ((TARGET, "JaxllmMatmul"),))


def matmul(x: jax.Array, w: jax.Array, layer=0, *, transposed: bool = False) -> jax.Array:
    """float32 [M, N] = x [M, K] @ w[layer] ([K, N]; `transposed`: w[layer] is [N, K]).

    w is stacked [L, K, N] (or [L, N, K]) in float32, bfloat16 or uint16 (bfloat16 bits).
    """
    if not available():
        raise RuntimeError("the CPU matmul kernel could not be built (see the log)")
    n = w.shape[1] if transposed else w.shape[2]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x.astype(jnp.float32), w, jnp.asarray(layer, jnp.int32), transposed=transposed)
