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
    a, r = "linear_attn.", Hv // Hk
    per_head = lambda x: x.T.reshape(E, Hk, -1)  # noqa: E731  [out, in] -> [E, Hk, n]
    if cfg.architecture.startswith("Qwen3_5"):
        # Qwen3.5: q, k, v (each all heads in order), z, b and a as tensors of their own,
        # placed where Qwen3-Next's fused per-key-head rows have them.
        qk, v = Hk * Dk, Hv * Dv
        proj = [(a + "in_proj_qkv.weight", "qkvz", (0, 0, 0), (2 * qk + v, E),
                 lambda x: per_head(x[:qk])),
                (a + "in_proj_qkv.weight", "qkvz", (0, 0, Dk), (2 * qk + v, E),
                 lambda x: per_head(x[qk:2 * qk])),
                (a + "in_proj_qkv.weight", "qkvz", (0, 0, 2 * Dk), (2 * qk + v, E),
                 lambda x: per_head(x[2 * qk:])),
                (a + "in_proj_z.weight", "qkvz", (0, 0, 2 * Dk + r * Dv), (v, E), per_head),
                (a + "in_proj_b.weight", "ba", (0, 0, 0), (Hv, E), per_head),
                (a + "in_proj_a.weight", "ba", (0, 0, r), (Hv, E), per_head)]
    else:  # rows per key head: q, k, its v heads, their z gates; then its b and a
        proj = [(a + "in_proj_qkvz.weight", "qkvz", (0, 0, 0), (2 * Hk * Dk + 2 * Hv * Dv, E),
                 per_head),
                (a + "in_proj_ba.weight", "ba", (0, 0, 0), (2 * Hv, E), per_head)]
    return [("input_layernorm.weight", "attn_norm", (0,), (E,), same),
            ("post_attention_layernorm.weight", "mlp_norm", (0,), (E,), same), *proj,
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
