"""Tiny GPT-OSS checkpoints for tests/test_gpt_oss.py: float ones as transformers saves them,
and the same model with its experts in MXFP4 blocks and scales as OpenAI publishes them.

The float config crosses every GPT-OSS feature: 3 layers alternating sliding (window 8) and
full attention, so prompts and decode steps cross the window; YaRN with truncate=False; sinks
drawn wide (std 2) so that dropping them moves the logits; experts with biases, and a
SwiGLU limit of 1.0 so the clamps bite on many gate/up sums.
"""

from __future__ import annotations

import json
import os

import numpy as np

from conftest import _randomize, _train_tokenizer

MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def gptoss_config(**overrides):
    import transformers as tr

    cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
               num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
               swiglu_limit=1.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                "original_max_position_embeddings": 64})
    c = tr.GptOssConfig(**{**cfg, **overrides})
    c.architectures = ["GptOssForCausalLM"]
    return c


def make_gptoss(path: str, seed: int = 0, **overrides) -> str:
    """A float32 GptOssForCausalLM with random weights (conftest's `_randomize`, sinks wider),
    saved with a tokenizer in `path`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(1)
    tok = _train_tokenizer()
    cfg = gptoss_config(**overrides)
    cfg.bos_token_id = cfg.pad_token_id = tok.pad_token_id
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, gemma=False, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(2.0 * torch.randn(layer.self_attn.sinks.shape,
                                                          generator=g))
    model.generation_config = GenerationConfig(bos_token_id=cfg.bos_token_id,
                                               eos_token_id=cfg.eos_token_id,
                                               pad_token_id=cfg.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float expert tensor in the float checkpoint's layout [..., cols, rows] -> (blocks uint8
    [..., rows, cols/32, 16], scales uint8 [..., rows, cols/32]): per 32 values the power of
    two that brings the largest to at most 6, each value rounded to the nearest e2m1 value."""
    from jaxllm.loader.mxfp4 import E2M1

    w = np.swapaxes(np.asarray(w, np.float32), -1, -2)
    groups = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(groups).max(-1, keepdims=True)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    scaled = groups / np.exp2(exp.astype(np.float32))
    nibbles = np.abs(np.abs(scaled)[..., None] - E2M1[:8]).argmin(-1).astype(np.uint8)
    nibbles |= np.where(scaled < 0, 8, 0).astype(np.uint8)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    # (contiguous: safetensors' NumPy writer would store a strided view's memory as it lies)
    return (np.ascontiguousarray(blocks),
            np.ascontiguousarray((exp[..., 0] + 127).astype(np.uint8)))


def make_gptoss_mxfp4(float_path: str, mxfp4_path: str, dequantized_path: str) -> None:
    """From a float checkpoint: `mxfp4_path` with every expert tensor as MXFP4 blocks and
    scales (and quantization_config mxfp4), and `dequantized_path`, a float checkpoint whose
    experts are transformers' own dequantization of those blocks (the model the MXFP4 one
    stands for)."""
    import shutil

    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(os.path.join(float_path, "model.safetensors"))
    packed, dequantized = {}, {}
    for name, array in tensors.items():
        if name.endswith(EXPERT_TENSORS):
            blocks, scales = quantize_mxfp4(array)
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            dequantized[name] = convert_moe_packed_tensors(
                torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
        else:
            packed[name] = dequantized[name] = array
    for path, weights in ((mxfp4_path, packed), (dequantized_path, dequantized)):
        shutil.copytree(float_path, path, dirs_exist_ok=True)
        save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(mxfp4_path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = MXFP4_CONFIG
    with open(os.path.join(mxfp4_path, "config.json"), "w") as f:
        json.dump(config, f)
