"""DeepSeek-V2/V3 (multi-head latent attention over a paged latent cache, their MoE routing)
against transformers.

Parity as tests/test_models.py: float32, prompts of different lengths prefilled in one ragged
batch through the paged latent cache (block size 4), then 32 greedy decode steps together;
every step's logits within ATOL = 1e-4 of transformers and the 32 tokens identical. Tiny
random configs: 4 heads, kv_lora_rank 16, qk_nope 8 + qk_rope 8, v_head_dim 12, 8 routed experts
of FFN 16 in groups, a shared expert, the first layer dense. V3's e_score_correction_bias (a
buffer transformers leaves at zero) is randomized so that it changes the choice of experts.
"""

import json

import pytest
import torch

from test_models import _prompts, assert_greedy_matches_transformers

_COMMON = dict(vocab_size=512, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
               n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
               first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=8,
               qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=256,
               rms_norm_eps=1e-6, tie_word_embeddings=False)
V3 = dict(_COMMON, q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5)
V2 = dict(_COMMON, q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
          routed_scaling_factor=1.5)
V2_LITE = dict(_COMMON, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
        "beta_slow": 1}


@pytest.fixture(scope="session")
def make_deepseek(make_tiny_checkpoint, tmp_path_factory):
    """make_deepseek(version, **config) -> a float32 checkpoint folder (weights as conftest's
    `_randomize`; V3's correction bias random too) with the tests' tokenizer."""
    import transformers as tr
    from conftest import _randomize
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_tiny_checkpoint("llama"))
    cache = {}

    def make(version: int, **kw) -> str:
        key = json.dumps([version, kw], sort_keys=True)
        if key in cache:
            return cache[key]
        cls = tr.DeepseekV3Config if version == 3 else tr.DeepseekV2Config
        cfg = cls(**kw, bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
        cfg.architectures = [f"DeepseekV{version}ForCausalLM"]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        _randomize(model, False, seed=len(cache))
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(0.3 * torch.randn(buf.shape, generator=g))
        path = str(tmp_path_factory.mktemp(f"tiny_deepseek_v{version}"))
        model.save_pretrained(path)
        tok.save_pretrained(path)
        cache[key] = path
        return path

    return make


CASES = [
    pytest.param(3, V3, id="v3-qlora-grouped-sigmoid-bias"),
    pytest.param(3, dict(V3, rope_interleave=False, norm_topk_prob=False, n_group=1,
                         topk_group=1, n_shared_experts=2), id="v3-nointerleave-unnormed"),
    pytest.param(3, dict(V3, rope_parameters=YARN), id="v3-yarn-mscale"),
    pytest.param(2, V2, id="v2-group-limited-greedy"),
    pytest.param(2, V2_LITE, id="v2lite-plain-q-greedy"),
]


@pytest.mark.parametrize("version,kw", CASES)
def test_deepseek_matches_transformers(version, kw, make_deepseek, load, greedy):
    from jaxllm.models.decoder import layer_groups

    path = make_deepseek(version, **kw)
    model, cfg, _ = load(path)
    assert [g.kind for g in layer_groups(cfg)] == ["mla", "mla_moe"]
    # The latent cache: one "head" of kv_lora_rank + qk_rope_head_dim, no V array.
    k_shape, v_shape = model.kv_cache_shapes(10, 4)[0]
    assert k_shape == (1, 10, 1, 4, 16 + 8) and v_shape[-1] == 0
    assert cfg.kv_values_per_token == 24
    assert_greedy_matches_transformers(path, model, _prompts((5, 17, 30, 2)), greedy)
