"""The plain random draw for XLA:CPU (`kernel_cpu.cc` via the XLA FFI): tokens from float32
logits with temperature and min_p, as `reference.draw` defines them, in two passes over each
row while it is in cache. `available()` says whether the kernel could be built here; the
sampler's XLA path runs otherwise."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_ffi

TARGET = "jaxllm_draw"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_cpu.cc")


def available() -> bool:
    """Build (once) and register the kernel; False if this machine cannot build it."""
    return cpu_ffi.register(_SOURCE, ((TARGET, "JaxllmDraw"),))


def draw(logits: jax.Array, temperature: jax.Array, min_p: jax.Array, uniforms: jax.Array,
         greedy: jax.Array, live=None) -> jax.Array:
    """int32 [N]: `reference.draw` of float32 logits [N, V]; rows where `live` (bool [N]) is
    False are not read and come out 0."""
    if not available():
        raise RuntimeError("the CPU sampling kernel could not be built (see the log)")
    N = logits.shape[0]
    mode = jnp.where(greedy, 1, 2)
    if live is not None:
        mode = jnp.where(live, mode, 0)
    f32 = lambda a: jnp.asarray(a, jnp.float32).reshape(N)  # noqa: E731
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((N,), jnp.int32))
    return call(logits.astype(jnp.float32), f32(temperature), f32(min_p), f32(uniforms),
                mode.astype(jnp.int32))
