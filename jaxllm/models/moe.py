"""A group of mixture-of-experts decoder layers (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5,
GPT-OSS): the dense layers' attention, with the MLP replaced by a router over stacked experts.

Routing is transformers' for each (`route`): for the first three a softmax over every expert's
router logit (in float32), the top k, renormalized to sum to one when `norm_topk_prob` (always
for Mixtral); GLM-4.5's and DeepSeek-V2/V3's group-limited top-k and scaling are `route`'s
other branches (DeepSeek's layers: jaxllm/models/mla.py). The routed experts run in the
backend's `moe` op (no token dropped); Qwen2-MoE adds a shared expert, a dense gated MLP scaled
by sigmoid(shared_gate . x), GLM-4.5 and DeepSeek an ungated one. GPT-OSS (`expert_bias`)
adds biases to the router's logits and to each expert's gate/up (inside the backend's op,
before its clamped SwiGLU) and down projections (the routed sum of the chosen experts' down
biases, added here). The routing weights and the
sum stay in float32 until the layer's output (transformers rounds Qwen's weights to the model
dtype first; vLLM, like this, does not).

Expert weights are laid out [layers, experts, ...]. Without expert parallelism each expert's
FFN axis is tensor-parallel (`mlp`, as the dense MLP's); with it the experts axis is sharded
(`expert`) and every expert is whole on its device.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.layers.backends.base import Backend
from jaxllm.layers.experts import ClampedSwiGLU
from jaxllm.models.dense import DenseLayers, gated_mlp
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.params import constant, dummy_weight


class MoeLayers(DenseLayers):
    """`count` consecutive layers whose MLP is a sparse mixture of experts."""

    def _init_mlp(self, cfg: ModelConfig, seed: int, L: int, prefix: str) -> None:
        E, X, F, dt = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.jnp_dtype
        weight = lambda name, *a: dummy_weight(seed, prefix + name, *a)  # noqa: E731
        expert, mlp = ("expert", None) if cfg.expert_parallel else (None, "mlp")
        self.router = weight("router", (L, E, X), ("layers", "embed", None),
                             jnp.float32 if cfg.router_f32 else dt)
        if cfg.router_bias:  # DeepSeek-V3's e_score_correction_bias (selection only)
            self.router_bias = constant(0.0, (L, X), ("layers", None), jnp.float32)
        self._projection(seed, prefix, "experts_gate_up", (L, X, E, 2, F),
                         ("layers", expert, "embed", None, mlp), 1, first=2)
        self._projection(seed, prefix, "experts_down", (L, X, F, E),
                         ("layers", expert, mlp, "embed"), 1, first=2)
        if cfg.expert_bias:  # GPT-OSS: the router's logits and every expert's projections
            self.router_logit_bias = constant(0.0, (L, X), ("layers", None), dt)
            self.experts_gate_up_bias = constant(0.0, (L, X, 2, F),
                                                 ("layers", expert, None, mlp), dt)
            self.experts_down_bias = constant(0.0, (L, X, E), ("layers", expert, "embed"), dt)
        shared = cfg.shared_expert_intermediate_size
        if shared:  # named as the dense MLP's: the backends treat them alike
            self._gated_mlp(seed, L, prefix, shared)
            if cfg.shared_expert_gated:
                self.shared_gate = weight("shared_gate", (L, E, 1), ("layers", "embed", None),
                                          dt)

    def widths(self) -> dict[str, int]:
        cfg = self.cfg
        return {**super().widths(), "gate_up": 2 * cfg.shared_expert_intermediate_size,
                "router": cfg.num_experts, "shared_gate": 1}

    def mlp(self, backend: Backend, w: dict, x: jax.Array, layer, lora=None
            ) -> tuple[jax.Array, Optional[jax.Array]]:
        """As DenseLayers.mlp; the MoE MLP holds no LoRA slots (adapters for its experts or
        shared expert are refused when read: jaxllm/loader/lora.py), so `lora` has none to
        apply."""
        cfg, f32 = self.cfg, jnp.float32
        # Through the backend's projections, as the experts are: on the CPU backend the native
        # matmul, whose rows do not depend on the batch (XLA's dot may sum them by shape).
        project = lambda name, bias=None: backend.project(  # noqa: E731
            x, w[name], layer, n=self.widths()[name], out_dtype=f32, bias=bias)
        if cfg.router_f32:  # DeepSeek: the router's input and weights in float32
            logits = backend.project(x.astype(f32), w["router"], layer, n=cfg.num_experts,
                                     out_dtype=f32)
        else:
            logits = project("router", w.get("router_logit_bias"))
        weights, ids = route(cfg, logits, w.get("router_bias"))
        activation = (cfg.activation if cfg.swiglu_clamp is None
                      else ClampedSwiGLU(*cfg.swiglu_clamp))
        bias = {"gate_up_bias": w["experts_gate_up_bias"]} if cfg.expert_bias else {}
        xe = x
        if cfg.router_scales_input:  # Llama 4 (top-1): the weight scales the expert's input
            xe, weights = x * weights.astype(x.dtype), jnp.ones_like(weights)
        out = backend.moe(xe, ids.astype(jnp.int32), weights, w["experts_gate_up"],
                          w["experts_down"], layer, experts=cfg.num_experts,
                          ffn=cfg.moe_intermediate_size, activation=activation,
                          dtype=x.dtype, expert_parallel=cfg.expert_parallel, **bias)
        if cfg.expert_bias:  # sum_k weight_k * down_bias[expert_k], outside the experts
            # (elementwise in k's order, as the experts' sum: a row's result never depends on
            # the batch's shape, as a dot's order might)
            b = w["experts_down_bias"]
            out = out + sum(weights[:, j, None] * b[ids[:, j]].astype(f32)
                            for j in range(ids.shape[1]))
        if cfg.shared_expert_intermediate_size:
            shared = gated_mlp(backend, self.widths(), w, x, layer, cfg.activation).astype(f32)
            if cfg.shared_expert_gated:
                shared = jax.nn.sigmoid(project("shared_gate")) * shared
            out = out + shared
        return out.astype(x.dtype), ids if cfg.count_expert_load else None

    def record_routes(self, routes: jax.Array, valid: jax.Array, start: int) -> None:
        """Sow the tokens routed to each expert of each layer of the group [count, experts]
        (int32) as `expert_load`, from the layers [start, start + len(routes)) routes
        [layers, T, k] and the real (not padding) tokens `valid` [T]; the step reads it with
        `nnx.capture` (`Decoder.forward_counting_experts`). One scatter-add of T·k ones per
        layer: padding tokens land in a spare column that is dropped."""
        L, X = routes.shape[0], self.cfg.num_experts
        ids = jnp.where(valid[None, :, None], routes, X) + (X + 1) * jnp.arange(L)[:, None, None]
        counts = jnp.bincount(ids.reshape(-1), length=L * (X + 1)).reshape(L, X + 1)[:, :X]
        load = jnp.zeros((self.count, X), jnp.int32).at[start:start + L].set(counts)
        self.sow(nnx.Intermediate, "expert_load", load,
                 init_fn=lambda: jnp.zeros_like(load), reduce_fn=jnp.add)


def route(cfg: ModelConfig, logits: jax.Array, bias: Optional[jax.Array] = None
          ) -> tuple[jax.Array, jax.Array]:
    """float32 router logits [T, X] -> each token's routing weights [T, k] (float32) and
    experts [T, k], in transformers' order of operations for each family:

      Mixtral/Qwen  softmax over all experts, top k (renormalized with `norm_topk_prob`)
      DeepSeek-V2   softmax; 'greedy' top k, or 'group_limited_greedy': the topk_group groups
                    with the highest single score kept, the others' scores zeroed, top k
      GPT-OSS       ('topk_softmax') the top k logits, a softmax over them
      DeepSeek-V3   sigmoid; the bias added for the choice only: the topk_group groups with
                    the highest sum of their two best biased scores kept (others -inf), top k
                    of the biased scores, weighted by the unbiased ones, renormalized (+1e-20)
    then times routed_scaling_factor. bias: [X] (V3's e_score_correction_bias)."""
    k = cfg.num_experts_per_tok
    if cfg.scoring_func == "topk_softmax":
        top, ids = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), ids
    if cfg.scoring_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    if cfg.topk_method == "greedy":
        weights, ids = jax.lax.top_k(scores, k)
    else:
        T, X = scores.shape
        G = cfg.n_group
        choice = scores if bias is None else scores + bias.astype(jnp.float32)
        grouped = choice.reshape(T, G, X // G)
        if cfg.topk_method == "noaux_tc":
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        else:  # group_limited_greedy
            group_scores = grouped.max(-1)
        kept = jax.lax.top_k(group_scores, cfg.topk_group)[1]
        keep = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], kept].set(True)
        keep = jnp.repeat(keep, X // G, axis=1)
        if cfg.topk_method == "noaux_tc":
            ids = jax.lax.top_k(jnp.where(keep, choice, -jnp.inf), k)[1]
            weights = jnp.take_along_axis(scores, ids, axis=1)
        else:
            weights, ids = jax.lax.top_k(jnp.where(keep, choice, 0.0), k)
    if cfg.norm_topk_prob:
        total = weights.sum(-1, keepdims=True)
        weights = weights / (total + 1e-20 if cfg.scoring_func == "sigmoid" else total)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids
