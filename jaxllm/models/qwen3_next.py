"""Groups of Qwen3-Next decoder layers (hybrid: gated DeltaNet linear attention in most
layers, gated full attention in the others), each with the dense MLP or the Qwen MoE one.

Linear-attention layers (`GdnLayers`, transformers' Qwen3NextGatedDeltaNet): in_proj_qkvz and
in_proj_ba give, per key head, q, k, (Hv/Hk) v heads, their output gates z, and each v head's
write strength b and decay input a; q, k, v go through a depthwise causal convolution (kernel
W, SiLU), q and k are L2-normed, and the gated delta rule (pallas_kernels/gated_delta_rule)
runs with beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias); its output is RMS-normed
per head and gated by SiLU(z) before out_proj. Such a layer keeps no KV: its group's "cache" is
the per-sequence state, KVCache(conv state [L, N, 1, C, W-1], recurrent state [L, N, Hv, Dk,
Dv]) over N state slots (one per running sequence: `AttentionMetadata.state_slots`), read at a
sequence's first step only when it continues (a chunked prefill, decode), else zero.

Full-attention layers (`GatedAttnLayers`, Qwen3NextAttention): the dense attention (q/k norms,
partial rotary) with an output gate, q_proj producing each head's query and gate; the attention
output is multiplied by sigmoid(gate) before o_proj. All RMSNorms but the DeltaNet's output
norm are zero-centred (scale 1 + w: `norm_offset` 1).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxllm.config import ConfigError
from jaxllm.layers.attention import AttentionMetadata, KVCache
from jaxllm.layers.backends.base import Backend
from jaxllm.models.dense import DenseLayers, project
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.moe import MoeLayers
from jaxllm.models.params import constant, dummy_weight, rms_norm
from jaxllm.models.rope import apply_rope
from pallas_kernels.gated_delta_rule import reference as gdn


def gdn_dims(cfg: ModelConfig) -> tuple[int, int, int, int, int, int]:
    """(Hk, Hv, Dk, Dv, conv channels C, conv kernel W) of a linear-attention layer."""
    Hk, Hv, Dk, Dv = (cfg.linear_num_k_heads, cfg.linear_num_v_heads, cfg.linear_k_dim,
                      cfg.linear_v_dim)
    return Hk, Hv, Dk, Dv, 2 * Hk * Dk + Hv * Dv, cfg.linear_conv_kernel


def state_shapes(cfg: ModelConfig, layers: int, slots: int) -> KVCache:
    """A linear-attention group's state cache shapes: KVCache(conv, recurrent)."""
    Hk, Hv, Dk, Dv, C, W = gdn_dims(cfg)
    return KVCache((layers, slots, 1, C, W - 1), (layers, slots, Hv, Dk, Dv))


def _refuse_unbuilt(cfg: ModelConfig) -> None:
    if cfg.quant is not None or cfg.lora is not None:
        raise ConfigError(f"{cfg.architecture}: "
                          f"{'quantized weights' if cfg.quant else 'LoRA adapters'} are not "
                          "supported for its linear- and gated-attention layers")


def sequence_fresh(md: AttentionMetadata) -> jax.Array:
    """bool [S]: the sequence's first token this step is its position 0 (its state starts at
    zero, whatever its slot holds)."""
    return md.kv_lens == md.cu_q_lens[1:] - md.cu_q_lens[:-1]


class GdnLayers(DenseLayers):
    """`count` consecutive gated DeltaNet layers with the dense MLP."""

    def _init_attention(self, cfg: ModelConfig, seed: int, L: int, prefix: str) -> None:
        _refuse_unbuilt(cfg)
        E, dt = cfg.hidden_size, cfg.jnp_dtype
        Hk, Hv, Dk, Dv, C, W = gdn_dims(cfg)
        r = Hv // Hk
        norm = lambda: constant(0.0, (L, E), ("layers", "embed"), dt)  # noqa: E731
        self.attn_norm, self.mlp_norm = norm(), norm()
        self._projection(seed, prefix, "qkvz", (L, E, Hk, 2 * Dk + 2 * r * Dv),
                         ("layers", "embed", None, None), 1)
        self._projection(seed, prefix, "ba", (L, E, Hk, 2 * r), ("layers", "embed", None, None),
                         1)
        self.conv = dummy_weight(seed, prefix + "conv", (L, C, W), ("layers", None, None), dt)
        self.dt_bias = constant(1.0, (L, Hv), ("layers", None), dt)
        self.A_log = constant(0.0, (L, Hv), ("layers", None), dt)
        self.gdn_norm = constant(1.0, (L, Dv), ("layers", None), dt)
        self._projection(seed, prefix, "gdn_out", (L, Hv * Dv, E), ("layers", None, "embed"), 1)

    def widths(self) -> dict[str, int]:
        Hk, Hv, Dk, Dv, _, _ = gdn_dims(self.cfg)
        return {**super().widths(), "qkvz": 2 * Hk * Dk + 2 * Hv * Dv, "ba": 2 * Hv,
                "gdn_out": self.cfg.hidden_size}

    def layer(self, backend: Backend, w: dict, h: jax.Array, cache: KVCache, layer,
              md: AttentionMetadata, cos, sin, window, lora
              ) -> tuple[jax.Array, KVCache, Optional[jax.Array]]:
        cfg, widths = self.cfg, self.widths()
        T = h.shape[0]
        Hk, Hv, Dk, Dv, C, W = gdn_dims(cfg)
        r = Hv // Hk

        def project_(name, x):
            return _dot(x, w[name], widths[name])

        x = rms_norm(h, w["attn_norm"], cfg)
        qkvz = project_("qkvz", x).reshape(T, Hk, 2 * Dk + 2 * r * Dv)
        q, k = qkvz[..., :Dk], qkvz[..., Dk:2 * Dk]
        v, z = qkvz[..., 2 * Dk:2 * Dk + r * Dv], qkvz[..., 2 * Dk + r * Dv:]
        ba = project_("ba", x).reshape(T, Hk, 2 * r)
        b, a = ba[..., :r].reshape(T, Hv), ba[..., r:].reshape(T, Hv)
        mixed = jnp.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], -1)
        slots, fresh = md.state_slots, sequence_fresh(md)
        conv_state = cache.k[layer][:, 0]
        mixed, conv_state = gdn.causal_conv1d(mixed, w["conv"], conv_state, slots, fresh,
                                              md.cu_q_lens, md.num_seqs, activation="silu")
        q = mixed[:, :Hk * Dk].reshape(T, Hk, Dk)
        k = mixed[:, Hk * Dk:2 * Hk * Dk].reshape(T, Hk, Dk)
        v = mixed[:, 2 * Hk * Dk:].reshape(T, Hv, Dv)
        beta = jax.nn.sigmoid(b)
        g = -jnp.exp(w["A_log"].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + w["dt_bias"].astype(jnp.float32))
        o, rec = backend.gated_delta_rule(q, k, v, g, beta, cache.v[layer], slots, fresh,
                                          md.cu_q_lens, md.num_seqs,
                                          decode_only=T == 1 or md.decode_only)
        o = gated_rms_norm(o, z.reshape(T, Hv, Dv), w["gdn_norm"], cfg.rms_norm_eps)
        h = h + project_("gdn_out", o.reshape(T, Hv * Dv))
        cache = KVCache(cache.k.at[layer].set(conv_state[:, None].astype(cache.k.dtype)),
                        cache.v.at[layer].set(rec.astype(cache.v.dtype)))
        m, routes = self.mlp(backend, w, rms_norm(h, w["mlp_norm"], cfg), layer, lora)
        return h + m, cache, routes


def gated_rms_norm(x: jax.Array, gate: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """transformers' Qwen3NextRMSNormGated: w * rmsnorm(x) (in x's dtype) * silu(gate), the
    product in float32."""
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    y = w * y
    return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class GatedAttnLayers(DenseLayers):
    """`count` consecutive full-attention layers with an output gate, dense MLP."""

    def _init_attention(self, cfg: ModelConfig, seed: int, L: int, prefix: str) -> None:
        _refuse_unbuilt(cfg)
        super()._init_attention(cfg, seed, L, prefix)
        self._projection(seed, prefix, "attn_gate",
                         (L, cfg.hidden_size, cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim),
                         ("layers", "embed", "kv_heads", "q_per_kv", "head_dim"), 1)

    def widths(self) -> dict[str, int]:
        c = self.cfg
        return {**super().widths(), "attn_gate": c.num_heads * c.head_dim}

    def layer(self, backend: Backend, w: dict, h: jax.Array, cache: KVCache, layer,
              md: AttentionMetadata, cos, sin, window, lora
              ) -> tuple[jax.Array, KVCache, Optional[jax.Array]]:
        cfg, widths = self.cfg, self.widths()
        T, dt = h.shape[0], h.dtype
        K, G, D = cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim

        def project_(name, x):
            return project(backend, w, name, x, layer, widths[name], dt, None)

        x = rms_norm(h, w["attn_norm"], cfg)
        qkv = project_("qkv", x).reshape(T, K, G + 2, D)
        gate = _dot(x, w["attn_gate"], widths["attn_gate"])
        q, k, v = qkv[:, :, :G].reshape(T, K * G, D), qkv[:, :, G], qkv[:, :, G + 1]
        q, k = rms_norm(q, w["q_norm"], cfg), rms_norm(k, w["k_norm"], cfg)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o, cache = backend.attention(q, k, v, cache, layer, md, sm_scale=cfg.sm_scale,
                                     sliding_window=window, soft_cap=None)
        o = o.reshape(T, K * G * D) * jax.nn.sigmoid(gate)
        h = h + project_("o", o)
        m, routes = self.mlp(backend, w, rms_norm(h, w["mlp_norm"], cfg), layer, lora)
        return h + m, cache, routes


def _dot(x: jax.Array, w: jax.Array, n: int) -> jax.Array:
    """x [T, K] @ w (any layout flattening to [K, n]) in float32, back in x's dtype: XLA's
    dot, not the backend's projections (the CPU backend reads those packed, and packs only
    the dense layers' own)."""
    return jnp.einsum("tk,kn->tn", x, w.reshape(x.shape[-1], n).astype(x.dtype),
                      preferred_element_type=jnp.float32).astype(x.dtype)


class GdnMoeLayers(GdnLayers, MoeLayers):
    """Gated DeltaNet layers with the sparse MoE MLP (routed experts, gated shared expert)."""


class GatedAttnMoeLayers(GatedAttnLayers, MoeLayers):
    """Gated full-attention layers with the sparse MoE MLP."""
