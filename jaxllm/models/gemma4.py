"""Gemma 4 text (transformers' Gemma4TextModel) as groups of the one decoder.

Its layer types differ in geometry: sliding layers have `head_dim` and `num_key_value_heads`,
full ones `global_head_dim` and (with `attention_k_eq_v`) `num_global_key_value_heads`, each
type its own RoPE (sliding `default`, full `proportional`). So every run of one layer type is
a group of its own (`group_kinds`), built from a copy of the model config with that type's
head dim and KV heads (`group_config`), with its own cache shape and RoPE tables.

A layer: q/k RMSNorms with weights (scaling by w), a weightless v norm, attention scale 1;
full layers with `attention_k_eq_v` take V from the K projection (before its norm and RoPE:
the loader writes k_proj into both slots of the fused projection). Gemma's sandwich norms
around attention and the GELU-tanh MLP; then the per-layer input (`hidden_size_per_layer_input`
P: a [T, layers, P] tensor made once per step, `PerLayerInputs`) gates a projection added to
the residual, and the layer's output is scaled by its `layer_scalar`.

KV sharing (`num_kv_shared_layers`): the last layers project no K/V; each attends over the
cache of the last earlier layer of its type (`Gemma4Spec.kv_producer`). Their groups own no
cache (a zero-layer array, so no KV block is spent on them); the group runs on its producer
group's cache, writing back this step's K/V as the producer wrote them (read from the cache
at the step's slots), which changes nothing and lets every backend's attention run unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ConfigError
from jaxllm.layers.attention import AttentionMetadata, KVCache
from jaxllm.layers.backends.base import Backend
from jaxllm.layers.backends.reference import ACTIVATIONS
from jaxllm.layers.quantization import QuantizedWeight
from jaxllm.models.dense import DenseLayers, gated_mlp, project
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.params import constant, dummy_weight, rms_norm
from jaxllm.models.rope import apply_rope, rope_tables


def group_kinds(cfg: ModelConfig) -> list[str]:
    """Each layer's group kind: `gemma4_sliding` / `gemma4_full`, `_shared` when it reads
    another layer's cache."""
    return [f"gemma4_{'full' if f else 'sliding'}{'_shared' if p >= 0 else ''}"
            for f, p in zip(cfg.gemma4.full_layers, cfg.gemma4.kv_producer)]


def group_config(cfg: ModelConfig, full: bool, shared: bool) -> ModelConfig:
    """The model config as a group of one layer type sees it: its head dim and KV heads (and
    the double-wide FFN of KV-shared layers)."""
    g = cfg.gemma4
    if full:
        if cfg.num_heads % g.global_kv_heads:
            raise ConfigError(f"Gemma 4: {cfg.num_heads} attention heads do not divide into "
                              f"{g.global_kv_heads} global KV heads")
        cfg = dataclasses.replace(cfg, head_dim=g.global_head_dim,
                                  num_kv_heads=g.global_kv_heads)
    if shared and g.double_wide_mlp:
        cfg = dataclasses.replace(cfg, intermediate_size=2 * cfg.intermediate_size)
    return cfg


def _rms(x: jax.Array, eps: float) -> jax.Array:
    """Gemma4RMSNorm without a weight (the v norm), in float32."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype)


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, K] @ w [K, N] in float32, back in x's dtype (weights the backends do not pack)."""
    return jnp.einsum("tk,kn->tn", x, w.astype(x.dtype),
                      preferred_element_type=jnp.float32).astype(x.dtype)


class PerLayerInputs(nnx.Module):
    """The per-layer inputs' weights (transformers' embed_tokens_per_layer,
    per_layer_model_projection, per_layer_projection_norm) and their [T, layers, P] tensor."""

    def __init__(self, cfg: ModelConfig, seed: int):
        g, dt = cfg.gemma4, cfg.jnp_dtype
        LP = cfg.num_layers * g.per_layer_size
        self.cfg = cfg
        self.embed = dummy_weight(seed, "ple_embed", (g.per_layer_vocab, LP), ("vocab", None), dt)
        self.proj = dummy_weight(seed, "ple_proj", (cfg.hidden_size, LP), ("embed", None), dt)
        self.norm = constant(1.0, (g.per_layer_size,), (None,), dt)

    def __call__(self, backend: Backend, token_ids: jax.Array, h: jax.Array) -> jax.Array:
        """token ids [T] and the scaled input embeddings h [T, E] -> [T, layers, P]."""
        cfg, P = self.cfg, self.cfg.gemma4.per_layer_size
        T, L, dt = h.shape[0], cfg.num_layers, h.dtype
        tok = backend.embed(self.embed[...], token_ids, L * P) * jnp.asarray(P ** 0.5, dt)
        ctx = _dot(h, backend.weight(self.proj[...])) * jnp.asarray(cfg.hidden_size ** -0.5, dt)
        ctx = rms_norm(ctx.reshape(T, L, P), backend.weight(self.norm[...]), cfg)
        return (ctx + tok.reshape(T, L, P)) * jnp.asarray(2.0 ** -0.5, dt)


class Gemma4Layers(DenseLayers):
    """`count` consecutive Gemma 4 layers of one type (`full`), owning their KV cache or
    (`shared`) reading another layer's."""
    full = False
    shared = False

    def __init__(self, cfg: ModelConfig, seed: int, count: int, prefix: str = ""):
        if cfg.quant is not None or cfg.lora is not None:
            raise ConfigError(f"Gemma 4: {'quantized weights' if cfg.quant else 'LoRA adapters'}"
                              " are not supported (its layer types differ in head dim)")
        super().__init__(group_config(cfg, self.full, self.shared), seed, count, prefix)
        c, L, dt = self.cfg, count, cfg.jnp_dtype
        self.layer_scalar = constant(1.0, (L,), ("layers",), dt)
        P, E = c.gemma4.per_layer_size, c.hidden_size
        if P:
            self.ple_gate = dummy_weight(seed, prefix + "ple_gate", (L, E, P),
                                         ("layers", "embed", None), dt)
            self.ple_proj = dummy_weight(seed, prefix + "ple_proj", (L, P, E),
                                         ("layers", None, "embed"), dt)
            self.ple_norm = constant(1.0, (L, E), ("layers", "embed"), dt)

    def _init_mlp(self, cfg: ModelConfig, seed: int, L: int, prefix: str) -> None:
        """The dense MLP, and with `enable_moe_block` the experts beside it (not instead):
        router (weightless norm, its `scale` as `router_norm` (not `*_scale`: the name of
        quantized scales), E^-1/2, projection), `per_expert_scale`,
        stacked experts, and the norms around them."""
        super()._init_mlp(cfg, seed, L, prefix)
        if not cfg.num_experts:
            return
        if cfg.expert_parallel or cfg.count_expert_load:
            raise ConfigError("Gemma 4 MoE: --enable-expert-parallel and "
                              "--enable-expert-load-metrics are not supported")
        E, X, F, dt = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.jnp_dtype
        self.router = dummy_weight(seed, prefix + "router", (L, E, X), ("layers", "embed", None),
                                   dt)
        self.router_norm = constant(1.0, (L, E), ("layers", "embed"), dt)
        self.per_expert_scale = constant(1.0, (L, X), ("layers", None), dt)
        self._projection(seed, prefix, "experts_gate_up", (L, X, E, 2, F),
                         ("layers", None, "embed", None, "mlp"), 1, first=2)
        self._projection(seed, prefix, "experts_down", (L, X, F, E),
                         ("layers", None, "mlp", "embed"), 1, first=2)
        norm = lambda: constant(1.0, (L, E), ("layers", "embed"), dt)  # noqa: E731
        self.moe_pre_norm, self.mlp_post_norm, self.moe_post_norm = norm(), norm(), norm()

    def _experts(self, backend: Backend, w: dict, h: jax.Array, layer) -> jax.Array:
        """The MoE block over the residual h [T, E] (transformers' Gemma4TextRouter and
        Gemma4TextExperts): softmax over the router's logits in float32, the top k
        renormalized, times their per_expert_scale."""
        cfg, f32, dt = self.cfg, jnp.float32, h.dtype
        x = _rms(h, cfg.rms_norm_eps) * w["router_norm"].astype(dt) \
            * jnp.asarray(cfg.hidden_size ** -0.5, dt)
        logits = backend.project(x, w["router"], layer, n=cfg.num_experts, out_dtype=dt)
        probs = jax.nn.softmax(logits.astype(f32), axis=-1)
        weights, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
        weights = weights / weights.sum(-1, keepdims=True)
        weights = weights * w["per_expert_scale"].astype(f32)[ids]
        out = backend.moe(rms_norm(h, w["moe_pre_norm"], cfg), ids.astype(jnp.int32), weights,
                          w["experts_gate_up"], w["experts_down"], layer,
                          experts=cfg.num_experts, ffn=cfg.moe_intermediate_size,
                          activation=cfg.activation, dtype=dt, expert_parallel=False)
        return out.astype(dt)

    def _init_attention(self, cfg: ModelConfig, seed: int, L: int, prefix: str) -> None:
        super()._init_attention(cfg, seed, L, prefix)
        if self.shared:  # q only: the K/V come from the producer's cache
            K, G, D = cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim
            self._projection(seed, prefix, "qkv", (L, cfg.hidden_size, K, G, D),
                             ("layers", "embed", "kv_heads", "q_per_kv", "head_dim"), 1)
            self.k_norm = None

    def widths(self) -> dict[str, int]:
        c = self.cfg
        heads = c.num_kv_heads * (c.q_per_kv + (0 if self.shared else 2))
        return {**super().widths(), "qkv": heads * c.head_dim}

    def layer(self, backend: Backend, w: dict, h: jax.Array, cache: KVCache, layer,
              md: AttentionMetadata, cos, sin, window, lora, local: Optional[dict] = None
              ) -> tuple[jax.Array, KVCache, Optional[jax.Array]]:
        """One layer: (h, cache, None). local: {"ple": this layer's per-layer input [T, P]
        or None, "read": the producer's layer in `cache` (KV-shared groups)}."""
        cfg, widths = self.cfg, self.widths()
        T, dt = h.shape[0], h.dtype
        K, G, D = cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim

        def project_(name, x):
            return project(backend, w, name, x, layer, widths[name], dt, None)

        x = rms_norm(h, w["attn_norm"], cfg)
        at = layer  # the cache layer attended over
        if self.shared:
            q = project_("qkv", x).reshape(T, K * G, D)
            at = local["read"]
            k, v = _cached_kv(cache, at, md.slot_mapping)
            k, v = k.astype(dt), v.astype(dt)
        else:
            qkv = project_("qkv", x).reshape(T, K, G + 2, D)
            q, k, v = qkv[:, :, :G].reshape(T, K * G, D), qkv[:, :, G], qkv[:, :, G + 1]
            k = apply_rope(rms_norm(k, w["k_norm"], cfg), cos, sin)
            v = _rms(v, cfg.rms_norm_eps)
        q = apply_rope(rms_norm(q, w["q_norm"], cfg), cos, sin)
        o, cache = backend.attention(q, k, v, cache, at, md, sm_scale=cfg.sm_scale,
                                     sliding_window=window, soft_cap=None)
        a = rms_norm(project_("o", o.reshape(T, K * G * D)), w["post_attn_norm"], cfg)
        h = h + a
        m = gated_mlp(backend, widths, w, rms_norm(h, w["mlp_norm"], cfg), layer,
                      cfg.activation)
        if cfg.num_experts:  # the MoE block beside the MLP, each output normed, then summed
            m = rms_norm(m, w["mlp_post_norm"], cfg) \
                + rms_norm(self._experts(backend, w, h, layer), w["moe_post_norm"], cfg)
        h = h + rms_norm(m, w["post_mlp_norm"], cfg)
        if local["ple"] is not None:
            g = ACTIVATIONS[cfg.activation](_dot(h, w["ple_gate"])) * local["ple"]
            h = h + rms_norm(_dot(g, w["ple_proj"]), w["ple_norm"], cfg)
        return h * w["layer_scalar"].astype(dt), cache, None

    def __call__(self, backend: Backend, h: jax.Array, cache: KVCache, md: AttentionMetadata,
                 rope: tuple, start: int, end: int, per_layer: Optional[jax.Array] = None,
                 read: int = 0) -> tuple[jax.Array, KVCache]:
        """Layers [start, end) (local) over h [T, E]. rope: (cos, sin, window) of the group's
        type; per_layer: their per-layer inputs [end - start, T, P] or None; read: the
        producer's layer in `cache` (KV-shared groups, whose cache is the producer group's)."""
        cos, sin, window = rope
        weights = {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}
        resident = {k: weights.pop(k) for k in backend.resident
                    if k in weights and not isinstance(weights[k], QuantizedWeight)}
        if (start, end) != (0, self.count):
            weights = jax.tree.map(lambda v: v[start:end], weights)

        def body(carry, xs):
            h, cache = carry
            w, layer, ple = xs
            w = {**{k: backend.weight(v) for k, v in w.items()}, **resident}
            h, cache, _ = self.layer(backend, w, h, cache, layer, md, cos, sin, window, None,
                                     local={"ple": ple, "read": read})
            return (h, cache), None

        layers = jnp.arange(start, end, dtype=jnp.int32)
        (h, cache), _ = jax.lax.scan(body, (h, cache), (weights, layers, per_layer))
        return h, cache


def _cached_kv(cache: KVCache, layer, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The K and V [T, Hkv, D] that layer `layer` of the cache holds at `slots` (padding
    slots read block 0; their write is dropped)."""
    bs = cache.k.shape[3]
    blk, off = jnp.maximum(slots, 0) // bs, jnp.maximum(slots, 0) % bs
    return cache.k[layer, blk, :, off], cache.v[layer, blk, :, off]


class SlidingLayers(Gemma4Layers):
    pass


class FullLayers(Gemma4Layers):
    full = True


class SlidingSharedLayers(Gemma4Layers):
    shared = True


class FullSharedLayers(Gemma4Layers):
    full = True
    shared = True


GROUP_KINDS = {"gemma4_sliding": SlidingLayers, "gemma4_full": FullLayers,
               "gemma4_sliding_shared": SlidingSharedLayers,
               "gemma4_full_shared": FullSharedLayers}


def kv_cache_shapes(cfg: ModelConfig, groups, num_blocks: int, block_size: int
                    ) -> tuple[tuple, ...]:
    """Each group's cache shape with its type's KV heads and head dim; a KV-shared group's
    has no layers (it runs on its producer's cache)."""
    out = []
    for g in groups:
        c = group_config(cfg, g.kind.startswith("gemma4_full"), False)
        layers = 0 if g.kind.endswith("_shared") else g.count
        out.append((layers, num_blocks, c.num_kv_heads, block_size, c.head_dim))
    return tuple(out)


def _producer(groups, layer: int) -> tuple[int, int]:
    """(group index, layer within it) of a model layer."""
    for i, g in enumerate(groups):
        if g.first <= layer < g.first + g.count:
            return i, layer - g.first
    raise ValueError(layer)


def run_layers(decoder, h: jax.Array, kv_caches: tuple[KVCache, ...], positions: jax.Array,
               md: AttentionMetadata, start: int, end: int, per_layer: Optional[jax.Array]
               ) -> tuple[jax.Array, tuple[KVCache, ...]]:
    """`Decoder.run_layers` for Gemma 4: each group with its type's RoPE tables, its layers'
    per-layer inputs, and a KV-shared group on its producer group's cache."""
    cfg, groups = decoder.cfg, decoder.groups
    caches = list(kv_caches)
    for i, (g, layers) in enumerate(zip(groups, decoder.layers)):
        a, b = max(start, g.first), min(end, g.first + g.count)
        if a >= b:
            continue
        c = layers.cfg
        cos, sin = rope_tables((cfg.rope[a],), c.head_dim, positions, h.dtype)
        window = cfg.sliding_window[a] or None
        ple = None if per_layer is None else jnp.swapaxes(per_layer[:, a:b], 0, 1)
        target, read = i, 0
        if layers.shared:
            target, read = _producer(groups, cfg.gemma4.kv_producer[a])
        h, caches[target] = layers(decoder.backend, h, caches[target], md,
                                   (cos[0], sin[0], window), a - g.first, b - g.first, ple,
                                   read)
    return h, tuple(caches)
