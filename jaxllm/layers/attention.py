"""The paged-attention data the step program carries: per-step metadata and the KV caches.

`AttentionMetadata` and `KVCache` are the pytrees the model runner builds on the host each step
and hands to the one jitted step; the layout is documented in
`pallas_kernels/ragged_paged_attention/reference.py`. The attention itself is a backend op
(`jaxllm.layers.backends`). There is one KVCache per layer group of the model, each stacked
over that group's layers, so groups (and pipeline stages) need not share one layout.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllm.parallel.mesh import named_sharding

KV_CACHE_AXES = ("layers", "cache_blocks", "kv_heads", "cache_block_size", "head_dim")


class KVCache(NamedTuple):
    k: jax.Array  # [L, num_blocks, Hkv, block_size, D]: L = the layers of one group
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
    # unless the backend runs all steps alike (`Backend.decode_programs`).
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # int32 [S]: each sequence's state slot in a hybrid model's linear-attention state cache
    # (jaxllm/models/qwen3_next.py; -1: padding); None for models without one.
    state_slots: Optional[jax.Array] = None
    # int32 [T]: the last key position each token attends to (>= its own position): a
    # bidirectional image token's is its image's last token (Gemma 3, jaxllm/models/
    # gemma3_vision.py); None (static) for causal-only models.
    attend_to: Optional[jax.Array] = None


# The pure-JAX reference's tiling: (queries per tile, tiles per loop step, keys per chunk).
# Decode: one query per sequence, many sequences per step, short chunks so short contexts
# gather little. Mixed/prefill: 16-query tiles so a prompt's pages are gathered once per 16.
REFERENCE_TILING = {True: (1, 16, 128), False: (16, 4, 256)}


# The KV cache dtypes the native CPU attention kernel reads and writes (float8 ones with or
# without per-layer scales; pallas_kernels/ragged_paged_attention/kernel_cpu_fp8.h).
NATIVE_CPU_CACHE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2)


def native_cpu_attention(backend: str, cache_dtype) -> bool:
    """Whether backend 'cpu' runs every step's attention in the native kernel (an f32, bf16 or
    float8 e4m3fn/e5m2 cache; the reference handles the others, float16), so decode steps need
    no programs of their own."""
    return backend == "cpu" and jnp.dtype(cache_dtype) in NATIVE_CPU_CACHE_DTYPES


def kv_cache_shardings(shapes: Sequence[tuple], mesh: Mesh) -> tuple[KVCache, ...]:
    """The sharding of each group's cache (of `Decoder.kv_cache_shapes`: one shape for K and
    V, or a KVCache of their two shapes), from its axes."""
    return tuple(KVCache(*[named_sharding(mesh, KV_CACHE_AXES, s) for s in _pair(s)])
                 for s in shapes)


def _pair(shape) -> KVCache:
    """A group's cache shapes as KVCache(k shape, v shape)."""
    return shape if isinstance(shape, KVCache) else KVCache(shape, shape)


def empty_kv_caches(shapes: Sequence[tuple], dtype, shardings: Sequence[KVCache]
                    ) -> tuple[KVCache, ...]:
    """Zeroed caches, one per layer group, created in place with their shardings."""
    def make(shape, sharding):
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

    return tuple(KVCache(make(_pair(s).k, sh.k), make(_pair(s).v, sh.v))
                 for s, sh in zip(shapes, shardings))
