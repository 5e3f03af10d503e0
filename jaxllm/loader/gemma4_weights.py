"""Gemma 4 checkpoint tensors -> jaxllm/models/gemma4.py's layouts: every tensor name a
Gemma4ForCausalLM checkpoint must provide, and where it goes.

Each layer's projections are fused as the dense layers' (q, k, v into `qkv` [E, K, G + 2, D],
gate and up into `gate_up`), with its type's head dim and KV heads. A full layer with
`attention_k_eq_v` has no v_proj: its k_proj fills both the K and the V slot (V is the K
projection before the K norm and RoPE). KV-shared layers have q_proj and q_norm only.
"""

from __future__ import annotations

from jaxllm.loader.quantized import Target
from jaxllm.models.decoder import layer_groups
from jaxllm.models.gemma4 import group_config
from jaxllm.models.model_config import ModelConfig


def text_name(name: str):
    """A Gemma4ForConditionalGeneration checkpoint's tensor name -> the text model's (None: its
    vision or audio tower or their embedders, skipped: text-only use)."""
    if name.startswith(("model.vision_tower.", "model.embed_vision.", "model.audio_tower.",
                        "model.embed_audio.")):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name  # lm_head and anything else: checked against the targets as it is


def _layer(c: ModelConfig, shared: bool, k_eq_v: bool) -> list:
    """One layer's tensors: (name in the layer, parameter, start, HF shape, HF -> block)."""
    E, F, D, K, G = c.hidden_size, c.intermediate_size, c.head_dim, c.num_kv_heads, c.q_per_kv
    P = c.gemma4.per_layer_size
    same = lambda x: x  # noqa: E731

    def heads_in(n):  # [n*D, E] -> [E, K, n, D]
        return lambda x: x.reshape(K, n, D, E).transpose(3, 0, 1, 2)

    out = [("input_layernorm.weight", "attn_norm", (0,), (E,), same),
           ("post_attention_layernorm.weight", "post_attn_norm", (0,), (E,), same),
           ("pre_feedforward_layernorm.weight", "mlp_norm", (0,), (E,), same),
           ("post_feedforward_layernorm.weight", "post_mlp_norm", (0,), (E,), same),
           ("layer_scalar", "layer_scalar", (), (1,), lambda x: x.reshape(())),
           ("self_attn.q_proj.weight", "qkv", (0, 0, 0, 0), (K * G * D, E), heads_in(G)),
           ("self_attn.q_norm.weight", "q_norm", (0,), (D,), same),
           ("self_attn.o_proj.weight", "o", (0, 0, 0, 0), (E, K * G * D),
            lambda x: x.reshape(E, K, G, D).transpose(1, 2, 3, 0)),
           ("mlp.gate_proj.weight", "gate_up", (0, 0, 0), (F, E), lambda x: x.T[:, None, :]),
           ("mlp.up_proj.weight", "gate_up", (0, 1, 0), (F, E), lambda x: x.T[:, None, :]),
           ("mlp.down_proj.weight", "down", (0, 0), (E, F), lambda x: x.T)]
    if not shared:
        out += [("self_attn.k_proj.weight", "qkv", (0, 0, G, 0), (K * D, E), heads_in(1)),
                ("self_attn.k_proj.weight" if k_eq_v else "self_attn.v_proj.weight", "qkv",
                 (0, 0, G + 1, 0), (K * D, E), heads_in(1)),
                ("self_attn.k_norm.weight", "k_norm", (0,), (D,), same)]
    if c.num_experts:
        X, Fe = c.num_experts, c.moe_intermediate_size
        out += [("router.proj.weight", "router", (0, 0), (X, E), lambda x: x.T),
                ("router.scale", "router_norm", (0,), (E,), same),
                ("router.per_expert_scale", "per_expert_scale", (0,), (X,), same),
                ("experts.gate_up_proj", "experts_gate_up", (0, 0, 0, 0), (X, 2 * Fe, E),
                 lambda x: x.reshape(X, 2, Fe, E).transpose(0, 3, 1, 2)),
                ("experts.down_proj", "experts_down", (0, 0, 0), (X, E, Fe),
                 lambda x: x.transpose(0, 2, 1)),
                ("pre_feedforward_layernorm_2.weight", "moe_pre_norm", (0,), (E,), same),
                ("post_feedforward_layernorm_1.weight", "mlp_post_norm", (0,), (E,), same),
                ("post_feedforward_layernorm_2.weight", "moe_post_norm", (0,), (E,), same)]
    if P:
        out += [("per_layer_input_gate.weight", "ple_gate", (0, 0), (P, E), lambda x: x.T),
                ("per_layer_projection.weight", "ple_proj", (0, 0), (E, P), lambda x: x.T),
                ("post_per_layer_input_norm.weight", "ple_norm", (0,), (E,), same)]
    return out


def targets(cfg: ModelConfig) -> dict[str, list[Target]]:
    g, E, V = cfg.gemma4, cfg.hidden_size, cfg.vocab_size
    same = lambda x: x  # noqa: E731
    out = {"model.embed_tokens.weight": [Target(("embed",), (0, 0), (V, E), same)],
           "model.norm.weight": [Target(("final_norm",), (0,), (E,), same)]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = [Target(("lm_head",), (0, 0), (V, E), same)]
    if g.per_layer_size:
        LP, P = cfg.num_layers * g.per_layer_size, g.per_layer_size
        out.update({
            "model.embed_tokens_per_layer.weight": [Target(
                ("per_layer_inputs", "embed"), (0, 0), (g.per_layer_vocab, LP), same)],
            "model.per_layer_model_projection.weight": [Target(
                ("per_layer_inputs", "proj"), (0, 0), (LP, E), lambda x: x.T)],
            "model.per_layer_projection_norm.weight": [Target(
                ("per_layer_inputs", "norm"), (0,), (P,), same)]})
    for gi, group in enumerate(layer_groups(cfg)):
        full, shared = group.kind.startswith("gemma4_full"), group.kind.endswith("_shared")
        layer = _layer(group_config(cfg, full, shared), shared, full and g.k_eq_v)
        for i in range(group.first, group.first + group.count):
            for name, param, start, shape, fn in layer:
                out.setdefault(f"model.layers.{i}.{name}", []).append(Target(
                    ("layers", gi, param), (i - group.first, *start), shape,
                    lambda x, fn=fn: fn(x)[None]))
    return out
