"""Ragged paged attention for XLA:CPU: `kernel_cpu.cc`, built with the system C++ compiler on
first use (cached per source and machine) and called through the XLA FFI.

Every step kind (decode, prefill, chunked prefill, mixed) with an f32 cache on one device; the
pure-JAX reference runs the rest (quantized caches, sharded models). `available()` says whether
the kernel could be built here.
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi

TARGET = "jaxllm_paged_attention"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_cpu.cc")


def available() -> bool:
    """Build (once) and register the kernel; False if this machine cannot build it."""
    return cpu_ffi.register(_SOURCE, ((TARGET, "JaxllmPagedAttention"),))


def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer,
                           kv_lens: jax.Array, block_tables: jax.Array, cu_q_lens: jax.Array,
                           num_seqs: jax.Array, *, sm_scale: float, sliding_window=None,
                           soft_cap: Optional[float] = None) -> jax.Array:
    """Attention output [T, Hq, D] in q's dtype; the reference's layout and semantics.

    Caches must be float32; q is computed in float32. sliding_window may be traced (per layer).
    """
    if not available():
        raise RuntimeError("the CPU paged attention kernel could not be built (see the log)")
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), k_cache, v_cache, jnp.asarray(layer, jnp.int32),
               kv_lens, block_tables, cu_q_lens, num_seqs, window,
               sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0))
    return out.astype(q.dtype)
