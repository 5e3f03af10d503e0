"""Tiny random DeepSeek-V2/V3 and GLM-4.5 checkpoints (float32, conftest's `_randomize`
weights, V3's routing correction bias random too) for test_deepseek and test_spec_mtp."""

from __future__ import annotations

import torch

ARCHS = {3: "DeepseekV3ForCausalLM", 2: "DeepseekV2ForCausalLM",
         "glm4_moe": "Glm4MoeForCausalLM"}


def build(version, tok, path: str, seed: int, **kw) -> str:
    """Save a random model of `version` (2, 3 or 'glm4_moe') with config `kw` and tokenizer
    `tok` into `path`."""
    import transformers as tr
    from conftest import _randomize
    from transformers import AutoModelForCausalLM

    cls = {3: tr.DeepseekV3Config, 2: tr.DeepseekV2Config, "glm4_moe": tr.Glm4MoeConfig}[version]
    cfg = cls(**kw, bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    cfg.architectures = [ARCHS[version]]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, False, seed=seed)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
