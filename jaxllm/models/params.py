"""Parameter helpers shared by the model's modules: dummy-weight initialisers, the layer
projections' parameters (float or quantized) and RMSNorm."""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.layers.quantization import QuantizedWeight
from jaxllm.layers.reductions import rowsum
from jaxllm.models.model_config import ModelConfig
from pallas_kernels.grouped_matmul import mxfp4


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


def projection(cfg: ModelConfig, seed: int, name: str, shape, axes, inputs: int,
               prefix: str = "", first: int = 1) -> dict[str, nnx.Param]:
    """A stacked layer projection's parameters, by attribute name: its float weight `name`
    [L, in..., out...] (`inputs` input axes from axis `first`: 2 for stacked experts
    [L, X, in..., out...]), or with `cfg.quant`
    its quantized values `name` (same shape and axes; int4's last axis halved, two values a
    byte), float32 scales `name`_scale
    [L, groups, out...] ([L, X, groups, out...]) and, asymmetric, zero points `name`_zero
    (`QuantizedWeight`'s
    layout). Dummy quantized weights are the float dummy weights (named prefix + name)
    quantized. A spec for the experts only (MXFP4) leaves the other projections float; MXFP4
    values are e2m1 codes two a byte along the input axis, scales e8m0 bytes
    (`pallas_kernels.grouped_matmul.mxfp4`)."""
    spec = cfg.quant
    if spec is None or (spec.experts_only and first != 2):
        return {name: dummy_weight(seed, prefix + name, shape, axes, cfg.jnp_dtype)}
    if spec.weight_dtype == "mxfp4":
        return _mxfp4_projection(seed, prefix + name, name, shape, axes, first)
    lead, ins, outs = shape[:first], shape[first:first + inputs], shape[first + inputs:]
    groups = spec.groups(math.prod(ins))
    scale_shape = (*lead, groups, *outs)
    scale_axes = (*axes[:first], None, *axes[first + inputs:])
    w = dummy_weight(seed, prefix + name, shape, axes, jnp.float32)[...]
    top = 448.0 if spec.weight_dtype.startswith("float8") else 7.0
    q = (w * (top / 0.05)).astype(spec.storage_dtype if spec.weight_dtype != "int4" else jnp.int8)
    if spec.weight_dtype == "int4":  # two values a byte along the last axis (`pack_int4`)
        u = (q + 8).astype(jnp.uint8)
        q = u[..., 0::2] | (u[..., 1::2] << 4)
    out = {name: nnx.Param(q, out_sharding=axes),
           f"{name}_scale": constant(0.05 / top, scale_shape, scale_axes, jnp.float32)}
    if not spec.symmetric:
        out[f"{name}_zero"] = constant(0.0, scale_shape, scale_axes, jnp.float32)
    return out


def _mxfp4_projection(seed: int, full_name: str, name: str, shape, axes, first: int
                      ) -> dict[str, nnx.Param]:
    """Stacked experts [L, X, in, out...] as MXFP4 dummy weights: the float dummy weights
    quantized (one input axis, at `first`)."""
    lead, K, outs = shape[:first], shape[first], shape[first + 1:]
    w = dummy_weight(seed, full_name, shape, axes, jnp.float32)[...]
    w = w.reshape(-1, K, math.prod(outs))
    q, scale = jax.vmap(mxfp4.quantize)(w)
    return {name: nnx.Param(q.reshape(*lead, K // 2, *outs), out_sharding=axes),
            f"{name}_scale": nnx.Param(scale.reshape(*lead, K // mxfp4.GROUP, *outs),
                                       out_sharding=axes)}


def lora_slots(cfg: ModelConfig, name: str, L: int, ins: tuple, in_axes: tuple, outs: tuple,
               out_axes: tuple, parts: int) -> dict[str, nnx.Param]:
    """The LoRA adapter slots of a stacked projection `name` (zeros: empty; the engine writes
    adapters in): `name`_lora_a [L, in..., S, parts·R] and `name`_lora_b [L, S, R, out...],
    S = --max-loras, R = --max-lora-rank (jaxllm/layers/lora.py). The input and
    output axes keep the projection's logical names, so tensor parallelism shards them as it
    shards the projection."""
    lora = cfg.lora
    S, R = lora.max_loras, lora.max_lora_rank
    dt = jnp.dtype(cfg.dtype if lora.lora_dtype == "auto" else lora.lora_dtype)
    return {f"{name}_lora_a": constant(0.0, (L, *ins, S, parts * R),
                                       ("layers", *in_axes, None, None), dt),
            f"{name}_lora_b": constant(0.0, (L, S, R, *outs), ("layers", None, None, *out_axes),
                                       dt)}


def with_quantized(weights: dict) -> dict:
    """Layer weights by name with each quantized projection's values, scales and zero points
    (`projection`) gathered into one `QuantizedWeight` under the projection's name."""
    out = {}
    for name, w in weights.items():
        if f"{name}_scale" in weights:
            w = QuantizedWeight(w, weights[f"{name}_scale"], weights.get(f"{name}_zero"))
        elif name.endswith(("_scale", "_zero")) and name.rsplit("_", 1)[0] in weights:
            continue
        out[name] = w
    return out


def constant(value: float, shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, dtype), out_sharding=axes)


def rms_norm(x: jax.Array, w: jax.Array, cfg: ModelConfig) -> jax.Array:
    """RMSNorm over the last axis in float32; Gemma's (1 + w) and GPT-OSS's w scale in float32
    too, Llama's w after casting back (each as transformers does it)."""
    xf = x.astype(jnp.float32)
    ms = rowsum(xf * xf)[..., None] / x.shape[-1]  # jnp.mean's order varied with the row count
    y = xf * jax.lax.rsqrt(ms + cfg.rms_norm_eps)
    if cfg.norm_offset:
        return (y * (cfg.norm_offset + w.astype(jnp.float32))).astype(x.dtype)
    if cfg.norm_scale_f32:
        return (w.astype(jnp.float32) * y).astype(x.dtype)
    return w * y.astype(x.dtype)
