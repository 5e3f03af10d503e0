"""The paged attention a model layer calls: write this step's K/V into the cache, then attend.

`AttentionMetadata` and `KVCache` are the pytrees the model runner builds on the host each step
and hands to the one jitted step; the layout is documented in
`pallas_kernels/ragged_paged_attention/reference.py`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxllm.config import ConfigError
from pallas_kernels.ragged_paged_attention import kernel_cpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention, write_kv


class KVCache(NamedTuple):
    k: jax.Array  # [L, num_blocks, Hkv, block_size, D]
    v: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array  # int32 [T]: cache slot (block * block_size + offset); -1 = padding
    kv_lens: jax.Array       # int32 [S]: KV length per sequence incl. this step's tokens
    block_tables: jax.Array  # int32 [S, B]
    cu_q_lens: jax.Array     # int32 [S + 1]
    num_seqs: jax.Array      # int32 [1]
    # Static: every sequence has exactly one query (a pure decode step), so the reference can
    # use one-query tiles. The runner compiles both kinds for token buckets <= max_num_seqs
    # unless the native CPU kernel runs all steps (see `native_cpu_attention`).
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))


# The pure-JAX reference's tiling: (queries per tile, tiles per loop step, keys per chunk).
# Decode: one query per sequence, many sequences per step, short chunks so short contexts
# gather little. Mixed/prefill: 16-query tiles so a prompt's pages are gathered once per 16.
REFERENCE_TILING = {True: (1, 16, 128), False: (16, 4, 256)}


def attention_impl(backend: str):
    """The ragged paged attention function for a backend name ('reference', 'cpu' (the
    reference, for what the native CPU kernel does not run, see `paged_attention`) or
    'pallas')."""
    if backend in ("reference", "cpu"):
        return ragged_paged_attention
    if backend == "pallas":
        from pallas_kernels.ragged_paged_attention import kernel
        return kernel.ragged_paged_attention
    raise ValueError(f"unknown attention backend {backend!r}")


def resolve_backend(requested: str, num_devices: int = 1) -> str:
    """auto = Pallas on TPU/GPU; on CPU the native kernel when it builds and the model
    is on one device (XLA cannot partition the FFI call), else the pure-JAX reference."""
    if requested == "cpu" and not kernel_cpu.available():
        raise ConfigError("--attention-backend cpu: the CPU kernel could not be built (is a "
                         "C++ compiler installed? see the log)")
    if requested != "auto":
        return requested
    if jax.default_backend() != "cpu":
        return "pallas"
    return "cpu" if num_devices == 1 and kernel_cpu.available() else "reference"


def native_cpu_attention(backend: str, cache_dtype) -> bool:
    """Whether backend 'cpu' runs every step's attention in the native kernel (an f32 or bf16
    cache; the reference handles the others), so decode steps need no programs of their own."""
    return backend == "cpu" and jnp.dtype(cache_dtype) in (jnp.float32, jnp.bfloat16)


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer,
                    md: AttentionMetadata, *, sm_scale: float, backend: str = "reference",
                    sliding_window=None, soft_cap: Optional[float] = None,
                    k_scale: Optional[float] = None, v_scale: Optional[float] = None
                    ) -> tuple[jax.Array, KVCache]:
    """q [T, Hq, D], k/v [T, Hkv, D] -> (out [T, Hq, D], updated cache)."""
    if native_cpu_attention(backend, cache.k.dtype) and k_scale is None and v_scale is None:
        out, kc, vc = kernel_cpu.ragged_paged_attention(
            q, k, v, cache.k, cache.v, layer, md.slot_mapping, md.kv_lens, md.block_tables,
            md.cu_q_lens, md.num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
            soft_cap=soft_cap)
        return out, KVCache(kc, vc)
    kc, vc = write_kv(cache.k, cache.v, layer, k, v, md.slot_mapping,
                      k_scale=k_scale, v_scale=v_scale)
    tiling = {}
    if backend in ("reference", "cpu"):
        q_tile, groups, keys = REFERENCE_TILING[md.decode_only]
        tiling = dict(q_tile=q_tile, tiles_per_group=groups,
                      chunk_blocks=max(1, keys // kc.shape[3]))
    out = attention_impl(backend)(
        q, kc, vc, layer, md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        k_scale=k_scale, v_scale=v_scale, **tiling)
    return out, KVCache(kc, vc)


def empty_kv_cache(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                   head_dim: int, dtype, sharding=None) -> KVCache:
    shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return KVCache(make(), make())
