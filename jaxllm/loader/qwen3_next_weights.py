"""Qwen3-Next checkpoint tensors -> jaxllm/models/qwen3_next.py's layouts (each entry: HF name
in the layer, parameter, start in it, HF shape, HF tensor -> block)."""

from __future__ import annotations

from jaxllm.models.model_config import ModelConfig
from jaxllm.models.qwen3_next import gdn_dims


def gdn_layer(cfg: ModelConfig) -> list:
    """A gated DeltaNet layer's tensors and norms."""
    E = cfg.hidden_size
    Hk, Hv, Dk, Dv, C, W = gdn_dims(cfg)
    same = lambda x: x  # noqa: E731
    a = "linear_attn."
    return [("input_layernorm.weight", "attn_norm", (0,), (E,), same),
            ("post_attention_layernorm.weight", "mlp_norm", (0,), (E,), same),
            # rows per key head: q, k, its v heads, their z gates ([out, in] -> [E, Hk, n])
            (a + "in_proj_qkvz.weight", "qkvz", (0, 0, 0), (2 * Hk * Dk + 2 * Hv * Dv, E),
             lambda x: x.T.reshape(E, Hk, -1)),
            (a + "in_proj_ba.weight", "ba", (0, 0, 0), (2 * Hv, E),
             lambda x: x.T.reshape(E, Hk, -1)),
            (a + "conv1d.weight", "conv", (0, 0), (C, 1, W), lambda x: x[:, 0]),
            (a + "dt_bias", "dt_bias", (0,), (Hv,), same),
            (a + "A_log", "A_log", (0,), (Hv,), same),
            (a + "norm.weight", "gdn_norm", (0,), (Dv,), same),
            (a + "out_proj.weight", "gdn_out", (0, 0), (E, Hv * Dv), lambda x: x.T)]


def gated_q_proj(cfg: ModelConfig) -> list:
    """A gated full-attention layer's q_proj: per head its query then its output gate, into
    the fused qkv's query part and `attn_gate` (both [E, K, G, D])."""
    E, K, G, D = cfg.hidden_size, cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim

    def part(i):
        return lambda x: x.reshape(K, G, 2, D, E)[:, :, i].transpose(3, 0, 1, 2)

    name = "self_attn.q_proj.weight"
    return [(name, "qkv", (0, 0, 0, 0), (K * G * 2 * D, E), part(0)),
            (name, "attn_gate", (0, 0, 0, 0), (K * G * 2 * D, E), part(1))]
