"""A group of dense decoder layers: weights stacked on a leading 'layers' axis, run by one
`lax.scan`, so compile time does not grow with depth.

The group's KV cache rides in the scan carry; each layer writes its K/V before it reads the
cache, which lets XLA update the donated cache in place. Q/K/V and gate/up are fused into one
matmul each (fewer, larger dots run fastest on XLA:CPU). Every weight carries logical axis names
(`out_sharding` metadata) that `jaxllm.parallel.mesh` maps onto the device mesh. Every op runs
through the model's backend (`jaxllm.layers.backends`).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.layers.attention import AttentionMetadata, KVCache
from jaxllm.layers.backends.base import Backend
from jaxllm.layers.quantization import QuantizedWeight
from jaxllm.models.model_config import ModelConfig
from jaxllm.layers.lora import LORA_PROJECTIONS, LoraBatch
from jaxllm.models.params import constant, lora_slots, projection, rms_norm, with_quantized
from jaxllm.models import llama4
from jaxllm.models.rope import apply_rope


class DenseLayers(nnx.Module):
    """`count` consecutive layers of the model, all dense (attention + gated MLP); `prefix`
    tells their dummy weights apart from other groups'."""

    def __init__(self, cfg: ModelConfig, seed: int, count: int, prefix: str = ""):
        self.cfg, self.count = cfg, count
        self._init_attention(cfg, seed, count, prefix)
        self._init_mlp(cfg, seed, count, prefix)

    def _init_attention(self, cfg: ModelConfig, seed: int, L: int, prefix: str) -> None:
        """The attention's weights and the norms around it and the MLP."""
        E, D, dt = cfg.hidden_size, cfg.head_dim, cfg.jnp_dtype
        K, G = cfg.num_kv_heads, cfg.q_per_kv
        one = 1.0 - cfg.norm_offset  # a norm weight that scales by one
        norm = partial(constant, one, (L, E), ("layers", "embed"), dt)
        self.attn_norm = norm()
        self._projection(seed, prefix, "qkv", (L, E, K, G + 2, D),
                         ("layers", "embed", "kv_heads", "q_per_kv", "head_dim"), 1)
        self.qkv_bias = (constant(0.0, (L, K, G + 2, D),
                                  ("layers", "kv_heads", "q_per_kv", "head_dim"), dt)
                         if cfg.qkv_bias else None)
        head_norm = partial(constant, one, (L, D), ("layers", "head_dim"), dt)
        if cfg.qk_norm_whole:  # one norm over every head's q (and k), sharded like the heads
            self.q_norm = constant(one, (L, K, G, D),
                                   ("layers", "kv_heads", "q_per_kv", "head_dim"), dt)
            self.k_norm = constant(one, (L, K, D), ("layers", "kv_heads", "head_dim"), dt)
        else:
            self.q_norm = head_norm() if cfg.qk_norm else None
            self.k_norm = head_norm() if cfg.qk_norm else None
        self._projection(seed, prefix, "o", (L, K, G, D, E),
                         ("layers", "kv_heads", "q_per_kv", "head_dim", "embed"), 3)
        if cfg.lora is not None:
            self._lora("qkv", L, (E,), ("embed",), (K, G + 2, D),
                       ("kv_heads", "q_per_kv", "head_dim"))
            self._lora("o", L, (K, G, D), ("kv_heads", "q_per_kv", "head_dim"), (E,), ("embed",))
        self.o_bias = constant(0.0, (L, E), ("layers", "embed"), dt) if cfg.o_bias else None
        # GPT-OSS: each query head's learned sink logit, sharded with the heads
        self.sinks = (constant(0.0, (L, K, G), ("layers", "kv_heads", "q_per_kv"), dt)
                      if cfg.attention_sinks else None)
        # fp8 KV cache: each layer's (k_scale, v_scale), float32 (jaxllm/models/kv_scales.py)
        self.kv_scales = (constant(1.0, (L, 2), ("layers", None), jnp.float32)
                          if cfg.kv_scales else None)
        self.post_attn_norm = norm() if cfg.sandwich_norms else None
        self.mlp_norm = norm()
        self.post_mlp_norm = norm() if cfg.sandwich_norms else None

    def _init_mlp(self, cfg: ModelConfig, seed: int, L: int, prefix: str) -> None:
        E, F = cfg.hidden_size, cfg.intermediate_size
        self._gated_mlp(seed, L, prefix, F)
        if cfg.lora is not None:
            self._lora("gate_up", L, (E,), ("embed",), (2, F), (None, "mlp"))
            self._lora("down", L, (F,), ("mlp",), (E,), ("embed",))

    def _lora(self, name: str, L: int, ins, in_axes, outs, out_axes) -> None:
        """Set a projection's LoRA adapter slots (`lora_slots`)."""
        for attr, param in lora_slots(self.cfg, name, L, ins, in_axes, outs, out_axes,
                                      len(LORA_PROJECTIONS[name])).items():
            setattr(self, attr, param)

    def _projection(self, seed: int, prefix: str, name: str, shape, axes, inputs: int,
                    first: int = 1) -> None:
        """Set a layer projection's parameters (`projection`: float, or quantized)."""
        for attr, param in projection(self.cfg, seed, name, shape, axes, inputs, prefix,
                                      first).items():
            setattr(self, attr, param)

    def _gated_mlp(self, seed: int, L: int, prefix: str, F: int) -> None:
        """A gated MLP's stacked fused gate/up [L, E, 2, F] and down [L, F, E] projections (the
        dense MLP's, or Qwen2-MoE's shared expert)."""
        E = self.cfg.hidden_size
        self._projection(seed, prefix, "gate_up", (L, E, 2, F), ("layers", "embed", None, "mlp"),
                         1)
        self._projection(seed, prefix, "down", (L, F, E), ("layers", "mlp", "embed"), 1)

    def widths(self) -> dict[str, int]:
        """Output columns of each projection the backend runs."""
        cfg = self.cfg
        return {"qkv": cfg.num_kv_heads * (cfg.q_per_kv + 2) * cfg.head_dim,
                "o": cfg.hidden_size, "gate_up": 2 * cfg.intermediate_size,
                "down": cfg.hidden_size}

    def mlp(self, backend: Backend, w: dict, x: jax.Array, layer, lora=None
            ) -> tuple[jax.Array, Optional[jax.Array]]:
        """The normed hidden states x [T, E] -> the MLP's output [T, E] in x's dtype, and the
        experts each token was routed to [T, k] when the step counts them (a dense MLP routes
        nothing: None). lora: each token's adapter slot (`LoraBatch`), when the model has
        LoRA slots."""
        return gated_mlp(backend, self.widths(), w, x, layer, self.cfg.activation, lora), None

    def layer(self, backend: Backend, w: dict, h: jax.Array, cache: KVCache, layer,
              md: AttentionMetadata, cos, sin, window, lora, local: Optional[dict] = None
              ) -> tuple[jax.Array, KVCache, Optional[jax.Array]]:
        """One layer (its weights w) over hidden states h [T, E]: (h, cache, routes).
        local: Llama 4's inputs of this layer (jaxllm/models/llama4.py), else None."""
        return _layer(self, backend, w, h, cache, layer, md, cos, sin, window, lora, local)

    def __call__(self, backend: Backend, h: jax.Array, cache: KVCache, md: AttentionMetadata,
                 rope: tuple, start: int, end: int, lora: Optional[LoraBatch] = None
                 ) -> tuple[jax.Array, KVCache]:
        """Run the group's layers [start, end) (local indices) over hidden states h [T, E].
        rope: (cos, sin) tables per distinct RoPE setting, then each of those layers' table
        index and sliding window (None when no layer has one), and for Llama 4
        `llama4.layer_inputs`. lora: each token's adapter slot (`LoraBatch`; None: no adapters
        in this model)."""
        cos, sin, rope_ids, windows, *extra = rope
        per_layer, temp = extra[0] if extra else (None, None)
        weights = with_quantized({k: v[...] for k, v in vars(self).items()
                                  if isinstance(v, nnx.Param)})
        # Read in place by the backend (indexed by layer), not sliced per layer by the scan;
        # quantized projections only where the backend reads them so.
        resident = {k: weights.pop(k) for k in backend.resident
                    if k in weights and (not isinstance(weights[k], QuantizedWeight)
                                         or k in backend.resident_quantized)}
        # A part of the group (Qwen3-VL's deepstack runs the layers in ranges): each layer's
        # weights read from the whole stack in the loop; a slice of the stack before the scan
        # would be a copy of those layers' weights in every step.
        whole = None
        if (start, end) != (0, self.count):
            whole, weights = weights, None

        def body(carry, xs):
            h, cache = carry
            w, layer, rope_id, window, here = xs
            if whole is not None:
                w = jax.tree.map(lambda v: v[layer], whole)
            w = {**{k: v if isinstance(v, QuantizedWeight) else backend.weight(v)
                    for k, v in w.items()}, **resident}
            local = {} if here is None else {"local": dict(here, temp=temp)}
            h, cache, routes = self.layer(backend, w, h, cache, layer, md, cos[rope_id],
                                          sin[rope_id], window, lora, **local)
            return (h, cache), routes

        layers = jnp.arange(start, end, dtype=jnp.int32)
        (h, cache), routes = jax.lax.scan(body, (h, cache),
                                          (weights, layers, rope_ids, windows, per_layer))
        if routes is not None:  # [end - start, T, k]: only MoE layers that count them route
            self.record_routes(routes, md.slot_mapping >= 0, start)
        return h, cache


def gated_mlp(backend: Backend, widths: dict, w: dict, x: jax.Array, layer, activation: str,
              lora: Optional[LoraBatch] = None) -> jax.Array:
    """down(activation(gate(x)) * up(x)) through the backend's projections (and the LoRA
    adapters', where the layers hold slots for them)."""
    F = widths["gate_up"] // 2
    if lora is None or "gate_up_lora_a" not in w:
        h = backend.gated_project(x, w["gate_up"], layer, n=F, activation=activation,
                                  dtype=x.dtype)
    else:  # the adapter's delta joins gate/up before the activation
        gate_up = project(backend, w, "gate_up", x, layer, 2 * F, jnp.float32, lora,
                          split=(0, (1, 1)))
        h = backend.gated_activation(gate_up.reshape(x.shape[0], 2, F), activation, x.dtype)
    return project(backend, w, "down", h, layer, widths["down"], x.dtype, lora)


def project(backend: Backend, w: dict, name: str, x: jax.Array, layer, n: int, out_dtype,
            lora: Optional[LoraBatch], bias: Optional[jax.Array] = None,
            split: Optional[tuple] = None) -> jax.Array:
    """The layer's projection `name` of x [T, K] -> [T, n] (backend.project), plus each
    token's LoRA delta where the layers hold adapter slots for it (summed in float32; split:
    a fused projection's parts, `lora_delta`'s)."""
    if lora is None or f"{name}_lora_a" not in w:
        return backend.project(x, w[name], layer, n=n, out_dtype=out_dtype, bias=bias)
    y = backend.project(x, w[name], layer, n=n, out_dtype=jnp.float32, bias=bias)
    delta = backend.lora(x, w[f"{name}_lora_a"], w[f"{name}_lora_b"], lora, split)
    return (y + delta).astype(out_dtype)


def _layer(group: DenseLayers, backend: Backend, w: dict, h: jax.Array, cache: KVCache, layer,
           md: AttentionMetadata, cos, sin, window, lora, local: Optional[dict] = None
           ) -> tuple[jax.Array, KVCache, Optional[jax.Array]]:
    cfg, widths = group.cfg, group.widths()
    T, dt = h.shape[0], h.dtype
    K, G, D = cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim

    def project_(name, x, bias=None, split=None):
        return project(backend, w, name, x, layer, widths[name], dt, lora, bias, split)

    x = rms_norm(h, w["attn_norm"], cfg)
    qkv = project_("qkv", x, bias=w["qkv_bias"] if cfg.qkv_bias else None,
                   split=(1, (G, 1, 1))).reshape(T, K, G + 2, D)
    q, k, v = qkv[:, :, :G].reshape(T, K * G, D), qkv[:, :, G], qkv[:, :, G + 1]
    if cfg.qk_norm:
        q, k = rms_norm(q, w["q_norm"], cfg), rms_norm(k, w["k_norm"], cfg)
    if cfg.qk_norm_whole:
        q = rms_norm(q.reshape(T, -1), w["q_norm"].reshape(-1), cfg).reshape(T, K * G, D)
        k = rms_norm(k.reshape(T, -1), w["k_norm"].reshape(-1), cfg).reshape(T, K, D)
    if local is None:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    else:  # Llama 4: NoPE or RoPE per layer (traced), its norm and temperature
        q, k = llama4.qk(cfg, q, k, cos, sin, local)
    sinks = w["sinks"].reshape(K * G).astype(jnp.float32) if cfg.attention_sinks else None
    o, cache = backend.attention(q, k, v, cache, layer, md, sm_scale=cfg.sm_scale,
                                 sliding_window=window, soft_cap=cfg.attn_logit_softcap,
                                 sinks=sinks,
                                 attention_chunk=None if local is None else local["chunk"],
                                 kv_scales=w["kv_scales"] if cfg.kv_scales else None)
    a = project_("o", o.reshape(T, K * G * D), bias=w["o_bias"] if cfg.o_bias else None)
    if cfg.sandwich_norms:
        a = rms_norm(a, w["post_attn_norm"], cfg)
    if cfg.residual_multiplier != 1.0:
        a = a * jnp.asarray(cfg.residual_multiplier, a.dtype)
    h = h + a

    m, routes = group.mlp(backend, w, rms_norm(h, w["mlp_norm"], cfg), layer, lora)
    if cfg.sandwich_norms:
        m = rms_norm(m, w["post_mlp_norm"], cfg)
    if cfg.residual_multiplier != 1.0:
        m = m * jnp.asarray(cfg.residual_multiplier, m.dtype)
    return h + m, cache, routes
