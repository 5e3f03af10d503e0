"""Groups of DeepSeek-V2/V3 decoder layers: multi-head latent attention (MLA) over a paged
latent cache, then the dense MLP (`MlaLayers`, the first `first_k_dense_replace` layers) or the
routed and shared experts (`MlaMoeLayers`; routing in jaxllm/models/moe.py's `route`).

The attention is transformers' DeepseekV3Attention / DeepseekV2Attention in the absorbed form
every step (decode, prefill and mixed alike): the cache holds one latent per token and layer,
the normed compressed KV c (kv_lora_rank R values) and the rotated shared key (qk_rope_head_dim
Dr values); the query's no-RoPE part is folded through W_UK (kv_b_proj's key half) into the
latent space, attention runs over the latent (the backend's `mla_attention`) and W_UV
(kv_b_proj's value half) maps each head's result back before o_proj. The expanded form (keys
and values per head) is never materialized, not even for a prefill.

RoPE: V3 with `rope_interleave` (its default) and V2 rotate the rope dims as (even, odd) pairs;
a q.k product is unchanged when q and k are permuted alike, so both are de-interleaved (evens,
then odds) and rotated in the half-split layout, which is what V3's transformers code outputs.
The softmax scale is (qk_nope + qk_rope)^-1/2, times mscale(factor, mscale_all_dim)^2 under a
scaled RoPE, as transformers' `yarn_apply_mscale`.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ConfigError
from jaxllm.layers.attention import AttentionMetadata, KVCache
from jaxllm.layers.backends.base import Backend
from jaxllm.models.dense import DenseLayers
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.moe import MoeLayers
from jaxllm.models.params import constant, rms_norm
from jaxllm.models.rope import apply_rope

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default


def mla_sm_scale(cfg: ModelConfig) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
    spec = cfg.rope[0]
    if spec.rope_type != "default" and spec.mscale_all_dim and spec.factor > 1:
        m = 0.1 * spec.mscale_all_dim * math.log(spec.factor) + 1.0
        scale = scale * m * m
    return scale


class MlaLayers(DenseLayers):
    """`count` consecutive DeepSeek layers with a dense MLP."""

    def _init_attention(self, cfg: ModelConfig, seed: int, L: int, prefix: str) -> None:
        if cfg.quant is not None or cfg.lora is not None:
            raise ConfigError(f"{cfg.architecture}: multi-head latent attention with "
                              f"{'quantized weights' if cfg.quant else 'LoRA adapters'} is "
                              "not supported")
        E, H, dt = cfg.hidden_size, cfg.num_heads, cfg.jnp_dtype
        R, Rq, Dr = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.head_dim
        Dq, Dn, Dv = cfg.qk_nope_head_dim + Dr, cfg.qk_nope_head_dim, cfg.v_head_dim
        norm = partial(constant, 1.0, (L, E), ("layers", "embed"), dt)
        self.attn_norm, self.mlp_norm = norm(), norm()
        if Rq:
            self._projection(seed, prefix, "q_a", (L, E, Rq), ("layers", "embed", None), 1)
            self.q_a_norm = constant(1.0, (L, Rq), ("layers", None), dt)
            self._projection(seed, prefix, "q_b", (L, Rq, H, Dq),
                             ("layers", None, "heads", None), 1)
        else:
            self._projection(seed, prefix, "q", (L, E, H, Dq), ("layers", "embed", "heads", None),
                             1)
        self._projection(seed, prefix, "kv_a", (L, E, R + Dr), ("layers", "embed", None), 1)
        self.kv_a_norm = constant(1.0, (L, R), ("layers", None), dt)
        self._projection(seed, prefix, "kv_b", (L, R, H, Dn + Dv), ("layers", None, "heads", None),
                         1)
        self._projection(seed, prefix, "o", (L, H, Dv, E), ("layers", "heads", None, "embed"), 2)

    def widths(self) -> dict[str, int]:
        cfg = self.cfg
        return {**super().widths(), "q_a": cfg.q_lora_rank,
                "q": cfg.num_heads * (cfg.qk_nope_head_dim + cfg.head_dim),
                "kv_a": cfg.kv_lora_rank + cfg.head_dim, "o": cfg.hidden_size}

    def layer(self, backend: Backend, w: dict, h: jax.Array, cache: KVCache, layer,
              md: AttentionMetadata, cos, sin, window, lora
              ) -> tuple[jax.Array, KVCache, Optional[jax.Array]]:
        cfg, widths = self.cfg, self.widths()
        T, dt, H = h.shape[0], h.dtype, cfg.num_heads
        R, Dr, Dn, Dv = cfg.kv_lora_rank, cfg.head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        latent_cfg = dataclasses.replace(cfg, rms_norm_eps=LATENT_NORM_EPS)

        def project(name, x):
            return backend.project(x, w[name], layer, n=widths[name], out_dtype=dt)

        x = rms_norm(h, w["attn_norm"], cfg)
        if cfg.q_lora_rank:
            # q_b and kv_b have neither axis of the hidden size: XLA's dot, not the backend's
            # projections (the CPU backend packs those by the hidden size).
            qa = rms_norm(project("q_a", x), w["q_a_norm"], latent_cfg)
            q = _dot("tr,rhd->thd", qa, w["q_b"])
        else:
            q = project("q", x).reshape(T, H, Dn + Dr)
        q_nope, q_rot = q[..., :Dn], q[..., Dn:]
        ckv = project("kv_a", x)
        c, k_rot = rms_norm(ckv[:, :R], w["kv_a_norm"], latent_cfg), ckv[:, None, R:]
        if cfg.rope_interleave:
            order = np.concatenate([np.arange(0, Dr, 2), np.arange(1, Dr, 2)])
            q_rot, k_rot = q_rot[..., order], k_rot[..., order]
        q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)[:, 0]
        w_uk, w_uv = w["kv_b"][..., :Dn], w["kv_b"][..., Dn:]
        q_lat = _dot("thd,rhd->thr", q_nope, w_uk)  # W_UK folded into the query
        o, cache = backend.mla_attention(
            jnp.concatenate([q_lat, q_rot], axis=-1), jnp.concatenate([c, k_rot], axis=-1),
            cache, layer, md, sm_scale=mla_sm_scale(cfg), kv_lora_rank=R)
        o = _dot("thr,rhv->thv", o, w_uv)  # W_UV after the attention
        h = h + project("o", o.reshape(T, H * Dv))
        m, routes = self.mlp(backend, w, rms_norm(h, w["mlp_norm"], cfg), layer, lora)
        return h + m, cache, routes


class MlaMoeLayers(MlaLayers, MoeLayers):
    """`count` consecutive DeepSeek layers with routed and shared experts."""


def _dot(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, w.astype(x.dtype),
                      preferred_element_type=jnp.float32).astype(x.dtype)
