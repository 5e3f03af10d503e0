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
import math

import pytest
import torch

from jaxllm.config import ConfigError
from deepseek_checkpoints import ARCHS, build
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
    """make_deepseek(version: 2, 3 or 'glm4_moe', **config) -> a float32 checkpoint folder
    (weights as conftest's `_randomize`; V3's correction bias random too) with the tests'
    tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_tiny_checkpoint("llama"))
    cache = {}

    def make(version, **kw) -> str:
        key = json.dumps([version, kw], sort_keys=True)
        if key in cache:
            return cache[key]
        path = build(version, tok, str(tmp_path_factory.mktemp(f"tiny_{ARCHS[version]}")),
                     seed=len(cache), **kw)
        cache[key] = path
        return path

    return make


CASES = [
    pytest.param(3, V3, id="v3-qlora-grouped-sigmoid-bias"),
    pytest.param(3, dict(V3, rope_interleave=False, norm_topk_prob=False, n_group=1,
                         topk_group=1, n_shared_experts=2), id="v3-nointerleave-unnormed",
                 marks=pytest.mark.slow),
    pytest.param(3, dict(V3, rope_parameters=YARN), id="v3-yarn-mscale", marks=pytest.mark.slow),
    pytest.param(2, V2, id="v2-group-limited-greedy", marks=pytest.mark.slow),
    pytest.param(2, V2_LITE, id="v2lite-plain-q-greedy"),
]


@pytest.mark.parametrize("version,kw", CASES)
def test_deepseek_matches_transformers(version, kw, make_deepseek, load, greedy):
    from jaxllm.models.decoder import layer_groups

    path = make_deepseek(version, **kw)
    model, cfg, _ = load(path)
    assert [g.kind for g in layer_groups(cfg)] == ["mla", "mla_moe"]
    assert model.moe_layer_ids == (1, 2)  # the rows of --enable-expert-load-metrics
    # The latent cache: one "head" of kv_lora_rank + qk_rope_head_dim, no V array.
    k_shape, v_shape = model.kv_cache_shapes(10, 4)[0]
    assert k_shape == (1, 10, 1, 4, 16 + 8) and v_shape[-1] == 0
    assert cfg.kv_values_per_token == 24
    assert_greedy_matches_transformers(path, model, _prompts((5, 17, 30, 2)), greedy)


# Kimi-K2-Instruct's config.json (its fp8 quantization_config left out): DeepSeek-V3's
# architecture under model_type kimi_k2, with DeepSeek's own configuration code in auto_map.
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 131072, "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 64, "num_nextn_predict_layers": 0,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 50000.0, "routed_scaling_factor": 2.827,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "scoring_func": "sigmoid", "topk_group": 1, "topk_method": "noaux_tc",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "v_head_dim": 128,
    "vocab_size": 163840}


def _config(tmp_path, raw: dict):
    from jaxllm.loader.loader import hf_config
    from jaxllm.models.model_config import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_hf(hf_config(str(tmp_path)))


def test_kimi_k2_config_loads(tmp_path):
    """Read with transformers' DeepseekV3Config (no remote code), as a V3."""
    from jaxllm.models.decoder import layer_groups
    from jaxllm.models.mla import mla_sm_scale

    cfg = _config(tmp_path, KIMI_K2)
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.dtype == "bfloat16"
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (384, 8, 1, 1)
    assert (cfg.scoring_func, cfg.topk_method, cfg.router_bias) == ("sigmoid", "noaux_tc", True)
    assert cfg.routed_scaling_factor == 2.827 and cfg.norm_topk_prob
    assert cfg.shared_expert_intermediate_size == 2048 and not cfg.shared_expert_gated
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.head_dim) == (512, 1536, 64)
    assert cfg.kv_values_per_token == 576  # against 2 * 64 heads * 192 for plain MHA
    assert [(g.kind, g.count) for g in layer_groups(cfg)] == [("mla", 1), ("mla_moe", 60)]
    assert cfg.rope[0].rope_type == "yarn" and cfg.max_model_len == 4096 * 32
    m = 0.1 * math.log(32.0) + 1.0  # mscale_all_dim 1: transformers' yarn_get_mscale
    assert mla_sm_scale(cfg) == pytest.approx(192 ** -0.5 * m * m)


@pytest.mark.parametrize("change,named", [
    ({"model_type": "deepseek_v2", "norm_topk_prob": True}, "norm_topk_prob"),
    ({"attention_bias": True}, "attention_bias"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"n_group": 5}, "n_group"),
])
def test_unsupported_deepseek_settings_are_refused(tmp_path, change, named):
    raw = dict(KIMI_K2, **change)
    if raw["model_type"] == "deepseek_v2":
        raw["architectures"] = ["DeepseekV2ForCausalLM"]
        for key in ("scoring_func", "topk_method"):
            raw.pop(key)
    with pytest.raises(ConfigError, match=named):
        _config(tmp_path, raw)



def test_deepseek_refusals_at_start_up(make_deepseek, load, tmp_path):
    """What MLA layers do not support yet is refused by name; --batch-invariant is refused on
    the CPU backend (the MLA attention runs the XLA reference there)."""
    from jaxllm.layers.backends.cpu import CpuBackend

    path = make_deepseek(3, **V3)
    with pytest.raises(ConfigError, match="LoRA"):
        load(path, enable_lora=True)
    why = CpuBackend(native_matmul=True).batch_variance(_config(tmp_path, KIMI_K2), "float32")
    assert why is not None and "latent" in why


def test_mtp_layers_are_skipped_other_tensors_refused(make_deepseek, load, tmp_path):
    """A checkpoint's multi-token-prediction layer (model.layers.N, N = num_hidden_layers) is
    read past, as transformers does; an unknown tensor of a real layer is still an error."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxllm.loader.weights import CheckpointError

    src = make_deepseek(3, **V3)
    for extra, ok in (("model.layers.3.eh_proj.weight", True),
                      ("model.layers.2.eh_proj.weight", False)):
        dst = tmp_path / extra
        shutil.copytree(src, dst)
        tensors = load_file(str(dst / "model.safetensors"))
        tensors[extra] = tensors["model.layers.2.self_attn.o_proj.weight"]
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        if ok:
            load(str(dst))
        else:
            with pytest.raises(CheckpointError, match="eh_proj"):
                load(str(dst))

@pytest.mark.slow  # ~60 s: the engine's programs
def test_deepseek_engine_equals_transformers_and_one_by_one(make_deepseek, monkeypatch):
    """A V3 model through the engine: continuous batching with chunked prefill (64-token
    steps) and prefix caching give transformers' greedy tokens, and the same tokens as one
    request at a time; the KV cache is the latent layout, sized by it."""
    from test_engine import GREEDY, NEW, hf_greedy, mixed_prompts, small_llm, token_ids

    monkeypatch.setenv("JAXLLM_FAIL_ON_RECOMPILE", "1")
    path = make_deepseek(3, **V3)
    prompts = mixed_prompts(10, seed=5)
    prompts += [prompts[0] + p for p in mixed_prompts(3, seed=6)]  # shared prefixes
    expected = hf_greedy(path, prompts, NEW)
    # The budget buys blocks of the latent layout: 3 layers x 4 tokens x 24 float32 values.
    llm = small_llm(path, kv_cache_memory_bytes=200 * 3 * 4 * 24 * 4)
    batch = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                   use_tqdm=False))
    assert batch == expected
    singles = [token_ids(llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False))[0]
               for p in prompts[:2]]
    assert singles == expected[:2]
    eng = llm.llm_engine
    assert eng.kv_cache_manager.prefix_cache_hits > 0
    caches = eng.runner.kv_cache
    assert [c.k.shape[1:] for c in caches] == [(200, 1, 4, 24)] * 2 and caches[0].v.size == 0


@pytest.mark.parametrize("engine_args", [
    pytest.param(dict(attention_backend="reference"), id="reference-backend",
                 marks=pytest.mark.slow),
    # The Pallas backend's attention kernel (GPU variant, interpreted on CPU) over the latent.
    pytest.param(dict(attention_backend="pallas"), id="pallas-backend", marks=pytest.mark.slow),
    pytest.param(dict(dtype="bfloat16"), id="bfloat16"),
])
def test_deepseek_other_backend_and_dtype(engine_args, make_deepseek, load, greedy):
    """The XLA reference and Pallas backends match transformers as the CPU backend does; in
    bfloat16 (the router still float32) the logits stray from float32 transformers no more
    than transformers' own bfloat16 model does."""
    import numpy as np
    from test_models import ATOL, _hf_model

    path = make_deepseek(3, **V3)
    model, cfg, _ = load(path, **engine_args)
    prompts = _prompts((7, 19))
    prefill, _, _ = greedy(model, prompts, 1)
    if cfg.dtype == "float32":
        assert model.backend.name == engine_args["attention_backend"]
        assert_greedy_matches_transformers(path, model, prompts, greedy)
        return
    state = dict(nnx_state_leaves(model))
    assert state["router"] == np.float32 and state["q_b"] == np.dtype("bfloat16")
    hf = _hf_model(path)
    hf_bf16 = _hf_model(path).to(torch.bfloat16)
    for ours, prompt in zip(prefill, prompts):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].numpy()
            theirs = hf_bf16(torch.tensor([prompt])).logits[0].float().numpy()
        err, their_err = np.abs(ours - want).max(), np.abs(theirs - want).max()
        assert their_err > ATOL and err <= 1.5 * their_err + 0.02


def nnx_state_leaves(model):
    """(parameter name, dtype) of the MoE layer group's parameters."""
    from flax import nnx

    return [(name, v.get_value().dtype) for name, v in vars(model.layers[1]).items()
            if isinstance(v, nnx.Param)]


GLM4_MOE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
                topk_group=2, routed_scaling_factor=1.8, first_k_dense_replace=1,
                attention_bias=True, use_qk_norm=True, max_position_embeddings=256,
                rms_norm_eps=1e-6, tie_word_embeddings=False)


def test_glm4_moe_matches_transformers(make_deepseek, load, greedy):
    """GLM-4.5: partial rotary (half of head_dim 16), q/k norms, q/k/v biases, V3's routing."""
    path = make_deepseek("glm4_moe", **GLM4_MOE)
    model, cfg, _ = load(path)
    assert (cfg.rope[0].partial_rotary_factor, cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) == (
        0.5, True, False, True)
    assert (cfg.topk_method, cfg.router_bias, cfg.shared_expert_gated) == ("noaux_tc", True,
                                                                           False)
    assert_greedy_matches_transformers(path, model, _prompts((5, 17, 30, 2)), greedy)


@pytest.mark.slow  # a subprocess on 4 virtual devices, 4 loads
def test_deepseek_tensor_and_expert_parallel_match_one_device(make_deepseek):
    """tp=2 and tp=4 (heads split over `model`, the one-head latent cache replicated) and
    expert parallelism at tp=2 give one device's logits (atol 1e-4) and greedy tokens."""
    import numpy as np
    from conftest import run_with_host_devices

    proc = run_with_host_devices(4, [__file__, make_deepseek(3, **V3)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    base = runs.pop("tp1")
    assert not base["sharded"]
    for name, run in runs.items():
        assert any("kv_b" in p for p in run["sharded"]), name  # the heads are split
        for key in ("prefill", "steps"):
            np.testing.assert_allclose(np.array(run[key]), np.array(base[key]), atol=1e-4,
                                       rtol=0, err_msg=f"{name} {key}")
        assert run["tokens"] == base["tokens"], name


def _parallel_child(path: str) -> dict:
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import greedy_record, load_tiny, sharded_params

    prompts = _prompts((7, 19), seed=1)
    report = {}
    for name, tp, ep in (("tp1", 1, False), ("tp2", 2, False), ("tp4", 4, False),
                         ("tp2-ep", 2, True)):
        model, _, _ = load_tiny(path, tp=tp, enable_expert_parallel=ep)
        report[name] = {"sharded": sharded_params(model), **greedy_record(model, prompts, 8)}
    return report


if __name__ == "__main__":
    import sys

    print(json.dumps(_parallel_child(sys.argv[1])))
