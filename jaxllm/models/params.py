"""Parameter helpers shared by the model's modules: dummy-weight initialisers and RMSNorm."""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.layers.reductions import rowsum
from jaxllm.models.model_config import ModelConfig


def dummy_weight(seed: int, name: str, shape, axes, dtype) -> nnx.Param:
    """Pseudo-random values in [-0.05, 0.05) (the dummy weights) from an integer hash of the
    element index: jax.random's threefry is slow for XLA:CPU to compile, and every call (every
    weight) would compile it."""
    x = jax.lax.iota(jnp.uint32, math.prod(shape)) * jnp.uint32(0x9E3779B9)
    x = x + jnp.uint32(zlib.crc32(f"{seed}/{name}".encode()))
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    x = (x ^ (x >> 16)).astype(jnp.float32) * (0.1 / 2**32) - 0.05
    return nnx.Param(x.reshape(shape).astype(dtype), out_sharding=axes)


def constant(value: float, shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, dtype), out_sharding=axes)


def rms_norm(x: jax.Array, w: jax.Array, cfg: ModelConfig) -> jax.Array:
    """RMSNorm over the last axis in float32; Gemma's (1 + w) scales in float32 too, Llama's w
    after casting back (both as transformers does it)."""
    xf = x.astype(jnp.float32)
    ms = rowsum(xf * xf)[..., None] / x.shape[-1]  # jnp.mean's order varied with the row count
    y = xf * jax.lax.rsqrt(ms + cfg.rms_norm_eps)
    if cfg.norm_offset:
        return (y * (cfg.norm_offset + w.astype(jnp.float32))).astype(x.dtype)
    return w * y.astype(x.dtype)
