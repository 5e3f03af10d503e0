"""MoE GGUF files: llama.cpp's stacked experts (`ffn_{gate,up,down}_exps`), router
(`ffn_gate_inp`) and Qwen2-MoE's shared expert (`ffn_*_shexp`, `ffn_gate_inp_shexp`) load into
the same model as the HF checkpoint they were written from.

The GGUF files are written here with the `gguf` package's GGUFWriter from tiny transformers
checkpoints, the way llama.cpp's converter lays them out (experts stacked [X, out, in], Q/K
rows permuted for the llama architecture, i.e. Mixtral); float32 tensors, so the logits must
equal the safetensors model's to 1e-5.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files")

_PARTS = {  # HF name under model.layers.N. -> GGUF part (experts: {} = index)
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)")
_EXPERT_PARTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                 "down_proj": "ffn_down_exps", "w1": "ffn_gate_exps", "w3": "ffn_up_exps",
                 "w2": "ffn_down_exps"}
_ARCH = {"MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
         "Qwen3MoeForCausalLM": "qwen3moe"}


def _permute(w, n_head):  # llama.cpp's row order of Q/K for the llama architecture
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _to_gguf(folder: str, out: str) -> str:
    from safetensors.numpy import load_file

    c = json.load(open(os.path.join(folder, "config.json")))
    arch = _ARCH[c["architectures"][0]]
    hf = load_file(os.path.join(folder, "model.safetensors"))
    w = gguf.GGUFWriter(out, arch)
    experts = c.get("num_local_experts") or c["num_experts"]
    w.add_block_count(c["num_hidden_layers"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_vocab_size(c["vocab_size"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c.get("rope_theta") or c["rope_parameters"]["rope_theta"])
    w.add_expert_count(experts)
    w.add_expert_used_count(c["num_experts_per_tok"])
    if arch != "llama":
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if c.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name, t in sorted(hf.items()):
        glob = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
        if name in glob:
            w.add_tensor(glob[name], t)
            continue
        layer, rest, kind = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)",
                                         name).groups()
        m = _EXPERT.fullmatch(rest)
        if m:
            stacked.setdefault(f"blk.{layer}.{_EXPERT_PARTS[m[2]]}.weight", {})[int(m[1])] = t
            continue
        part = _PARTS[rest]
        if arch == "llama" and part in ("attn_q", "attn_k"):
            t = _permute(t, c["num_attention_heads" if part == "attn_q" else "num_key_value_heads"])
        if part == "ffn_gate_inp_shexp":
            t = t.reshape(-1)  # llama.cpp stores the shared expert's gate as [E]
        w.add_tensor(f"blk.{layer}.{part}.{kind}", np.ascontiguousarray(t))
    for name, per_expert in stacked.items():
        w.add_tensor(name, np.stack([per_expert[j] for j in range(experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("arch,overrides", [
    ("mixtral", {}),
    ("qwen2_moe", {"mlp_only_layers": [], "num_hidden_layers": 2}),  # GGUF: every layer sparse
    ("qwen3_moe", {}),
])
def test_moe_gguf_equals_safetensors(arch, overrides, make_tiny_checkpoint, load, greedy,
                                     tmp_path):
    folder = make_tiny_checkpoint(arch, **overrides)
    path = _to_gguf(folder, str(tmp_path / f"{arch}.gguf"))
    from_gguf, cfg_gguf, _ = load(path)
    from_hf, cfg_hf, _ = load(folder)
    for field in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "norm_topk_prob", "moe_layers"):
        assert getattr(cfg_gguf, field) == getattr(cfg_hf, field), field
    prompts = [[5, 9, 200, 31, 7, 77, 300], [11, 12]]
    a, _, ta = greedy(from_gguf, prompts, 4)
    b, _, tb = greedy(from_hf, prompts, 4)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)
    assert ta == tb
