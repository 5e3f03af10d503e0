"""SiLU-and-multiply for XLA:CPU (`kernel_cpu.cc` via the XLA FFI): the gated MLP's activation
straight from the gate/up matmul's float32 output, in the model's dtype. `available()` says
whether the kernel could be built here; callers fall back to `reference.silu_and_mul`."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_ffi

TARGET = "jaxllm_silu_mul"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_cpu.cc")


def available() -> bool:
    """Build (once) and register the kernel; False if this machine cannot build it."""
    return cpu_ffi.register(_SOURCE, ((TARGET, "JaxllmSiluMul"),))


def silu_and_mul(x: jax.Array, dtype) -> jax.Array:
    """`reference.silu_and_mul` of float32 x [T, 2, F] for dtype float32 or bfloat16: [T, F]."""
    if not available():
        raise RuntimeError("the CPU activation kernel could not be built (see the log)")
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"silu_and_mul: float32 or bfloat16 out, got {dtype}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], x.shape[2]), dtype))
    return call(x.astype(jnp.float32))
