"""Llama 4's attention, as transformers' Llama4TextAttention, inside the generic dense/MoE layers.

Per layer (traced in the scan over a group's layers, so that RoPE and NoPE layers share one
group): a RoPE layer rotates q and k, then, with `use_qk_norm`, divides each head's q and k by
their root mean square (no weight); a NoPE layer (`no_rope_layers[i] == 0`) skips both and,
with `attn_temperature_tuning`, scales q by 1 + attn_scale * log1p(floor((pos + 1) /
floor_scale)) (the temperature tuning of arXiv:2501.19399, which grows with the position).
RoPE layers attend within chunks of `attention_chunk_size` positions (the backend's
`attention_chunk`); NoPE layers see the whole sequence.

Llama 4 rotates (even, odd) channel pairs (transformers' complex form). The loader permutes
each head's q_proj and k_proj rows so that those pairs become the (i, i + D/2) pairs of the
decoder's `apply_rope` (`deinterleave_rows`): q . k is the same under one permutation of both,
and neither the norm nor the temperature depends on the channel order.

The MoE layers route top-1 by a sigmoid of the router logit, and that weight scales the
expert's input, not its output (`ModelConfig.router_scales_input`, applied in
jaxllm/models/moe.py); a shared expert without a gate is added.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.model_config import ModelConfig
from jaxllm.models.rope import apply_rope


def layer_inputs(cfg: ModelConfig, start: int, end: int, positions: jax.Array
                 ) -> Optional[tuple[dict, Optional[jax.Array]]]:
    """For layers [start, end) of a Llama 4 model: (per-layer arrays the scan slices: `nope`
    bool and `chunk` int32, each [end - start]; the step's temperature [T] float32 or None),
    None for other models."""
    if not cfg.nope_layers:
        return None
    per_layer = {"nope": jnp.asarray(cfg.nope_layers[start:end], bool),
                 "chunk": jnp.asarray(cfg.attention_chunk[start:end], jnp.int32)}
    return per_layer, temperature(cfg, positions)


def temperature(cfg: ModelConfig, positions: jax.Array) -> Optional[jax.Array]:
    """float32 [T]: each query's NoPE-layer scale (None without temperature tuning)."""
    if cfg.attn_temperature is None:
        return None
    floor_scale, attn_scale = cfg.attn_temperature
    pos = positions.astype(jnp.float32)
    return jnp.log1p(jnp.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0


def _l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """Llama4TextL2Norm: x / rms(x) over the head dim in float32, no weight."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


def qk(cfg: ModelConfig, q: jax.Array, k: jax.Array, cos, sin, local: dict
       ) -> tuple[jax.Array, jax.Array]:
    """q [T, Hq, D], k [T, Hkv, D] as the layer attends with them: RoPE and the q/k norm on a
    RoPE layer, the temperature on a NoPE one (`local`: this layer's `nope`, the step's
    `temp`)."""
    nope = local["nope"]
    qr, kr = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cfg.qk_l2_norm:
        qr, kr = _l2_norm(qr, cfg.rms_norm_eps), _l2_norm(kr, cfg.rms_norm_eps)
    qn = q
    if local["temp"] is not None:
        qn = (q.astype(jnp.float32) * local["temp"][:, None, None]).astype(q.dtype)
    return jnp.where(nope, qn, qr), jnp.where(nope, k, kr)


def deinterleave_rows(x: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """A q_proj/k_proj weight [heads * D, E] with each head's rows (0, 2, 4, .., 1, 3, ..):
    the (even, odd) rotary pairs become (i, i + D/2) pairs."""
    order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return x.reshape(heads, head_dim, -1)[:, order].reshape(x.shape)
