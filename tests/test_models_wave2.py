"""Issue 48's simpler architectures (Granite, GraniteMoE, OLMoE, Phi-3, Gemma 3 multimodal
checkpoints text-only) against transformers, with test_models.py's harness (ragged prefill of
three prompts through the paged cache, then 32 greedy steps; f32 logits within its
ATOL = 1e-4, tokens identical); tp=2 and the engine (slow-marked).

Granite: the tiny configs set every multiplier away from one (embedding 6, residual 0.3,
softmax scale 0.2, logits divided by 4), so dropping any of them changes the logits.
"""

import json
import os
import sys

import numpy as np
import pytest

from conftest import run_with_host_devices
from test_models import _prompts, assert_greedy_matches_transformers

CASES = [
    pytest.param("granite", {}, id="granite-multipliers"),
    pytest.param("granitemoe", {}, id="granitemoe-8experts-top2"),
    pytest.param("olmoe", {}, id="olmoe-wholewidth-qknorm-unnormalized-topk"),
    pytest.param("olmoe", {"norm_topk_prob": True}, id="olmoe-normalized-topk"),
]


@pytest.mark.parametrize("arch,overrides", CASES)
def test_matches_transformers(arch, overrides, make_tiny_checkpoint, load, greedy):
    path = make_tiny_checkpoint(arch, **overrides)
    model, cfg, _ = load(path)
    assert_greedy_matches_transformers(path, model, _prompts(), greedy)


def test_granite_reference_backend_matches_transformers(make_tiny_checkpoint, load, greedy):
    """The multipliers live outside the backends' kernels, but the reference path runs them
    too (the default above is the CPU backend)."""
    path = make_tiny_checkpoint("granite")
    model, cfg, _ = load(path, attention_backend="reference")
    assert model.attention_backend == "reference"
    assert (cfg.embed_scale, cfg.residual_multiplier, cfg.sm_scale, cfg.logits_scaling) == (
        6.0, 0.3, 0.2, 4.0)
    assert_greedy_matches_transformers(path, model, _prompts(), greedy)


def test_granite_nonpositive_logits_scaling_refused(make_tiny_checkpoint):
    from transformers import AutoConfig

    from jaxllm.config import ConfigError
    from jaxllm.models.model_config import ModelConfig

    c = AutoConfig.from_pretrained(make_tiny_checkpoint("granite"))
    c.logits_scaling = 0.0
    with pytest.raises(ConfigError, match="logits_scaling"):
        ModelConfig.from_hf(c)


def test_olmoe_clip_qkv_refused(make_tiny_checkpoint):
    from transformers import AutoConfig

    from jaxllm.config import ConfigError
    from jaxllm.models.model_config import ModelConfig

    c = AutoConfig.from_pretrained(make_tiny_checkpoint("olmoe"))
    assert ModelConfig.from_hf(c).qk_norm_whole
    c.clip_qkv = 8.0
    with pytest.raises(ConfigError, match="clip_qkv"):
        ModelConfig.from_hf(c)


@pytest.mark.parametrize("partial", [1.0, 0.5], ids=["full-rotary", "partial-rotary-half"])
@pytest.mark.parametrize("max_len,lens", [(64, (5, 17, 30)), (None, (65, 70, 80))],
                         ids=["short-factors", "long-factors"])
def test_phi3_longrope_matches_transformers(partial, max_len, lens, make_tiny_checkpoint, load,
                                            greedy):
    """Fused qkv_proj/gate_up_proj tensors and LongRoPE. jaxllm picks the factors once per
    model (long when max_model_len exceeds original_max_position_embeddings = 64, as vLLM);
    transformers picks by each call's length. They agree for a model capped at 64 positions
    (short factors throughout) and for prompts already past 64 (long factors throughout)."""
    path = make_tiny_checkpoint("phi3", partial_rotary_factor=partial)
    model, cfg, _ = load(path, **({} if max_len is None else {"max_model_len": max_len}))
    spec = cfg.rope[0]
    assert spec.rope_type == "longrope" and spec.partial_rotary_factor == partial
    assert spec.use_long == (max_len is None) and cfg.max_model_len == (max_len or 128)
    assert_greedy_matches_transformers(path, model, _prompts(lens), greedy)


def test_gemma3_multimodal_checkpoint_runs_its_language_model(make_tiny_checkpoint, load,
                                                              greedy):
    """A Gemma3ForConditionalGeneration checkpoint: its language model's tensors load under
    their multimodal names (the vision tower's and projector's into the SigLIP tower:
    tests/test_gemma3_vision.py), and text prompts
    match transformers' multimodal model given the same token ids."""
    import glob

    from safetensors import safe_open

    path = make_tiny_checkpoint("gemma3_mm")
    with safe_open(glob.glob(f"{path}/*.safetensors")[0], "np") as f:
        names = list(f.keys())
    assert any(n.startswith("vision_tower.") for n in names)
    assert not any(n.startswith("model.layers.") for n in names)
    model, cfg, _ = load(path)
    assert cfg.architecture == "Gemma3ForConditionalGeneration"
    assert cfg.qk_norm and cfg.sandwich_norms and max(cfg.sliding_window) == 8
    assert_greedy_matches_transformers(path, model, _prompts(), greedy)


@pytest.mark.slow
def test_tensor_parallel_2_matches_one_device(make_tiny_checkpoint):
    """tp=2 on virtual CPU devices (a subprocess, as tests/test_tensor_parallel.py) equals
    tp=1: OLMoE (its whole-width q/k norms reduce across the sharded heads; experts' FFNs
    sharded) and Phi-3 with half rotary (fused tensors loaded into sharded projections)."""
    paths = {"olmoe": make_tiny_checkpoint("olmoe"),
             "phi3": make_tiny_checkpoint("phi3", partial_rotary_factor=0.5)}
    proc = run_with_host_devices(2, [__file__, json.dumps(paths)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, runs in report.items():
        base, two = runs["1"], runs["2"]
        assert two["devices"] == 2 and "layers/0/qkv" in two["sharded"]
        for key in ("prefill", "steps"):
            np.testing.assert_allclose(np.array(two[key]), np.array(base[key]), atol=1e-4,
                                       rtol=0, err_msg=f"{name} tp=2 {key}")
        assert two["tokens"] == base["tokens"], name


def _child(paths: dict) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import greedy_record, load_tiny, sharded_params

    prompts = _prompts((7, 19))
    report = {}
    for name, path in paths.items():
        report[name] = {}
        for tp in (1, 2):
            model, _, _ = load_tiny(path, tp=tp)
            report[name][str(tp)] = {"sharded": sharded_params(model),
                                     **greedy_record(model, prompts, 8)}
    return report


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))


@pytest.mark.parametrize("arch", ["phi3", "granitemoe"])
def test_quantized_fused_or_stacked_checkpoints_refused(arch, make_tiny_checkpoint):
    """Their fused (Phi-3) or stacked (GraniteMoE) tensors have no quantized layout here."""
    import dataclasses

    from transformers import AutoConfig

    from jaxllm.layers.quantization import QuantSpec
    from jaxllm.loader.weights import CheckpointError, hf_targets
    from jaxllm.models.model_config import ModelConfig

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(make_tiny_checkpoint(arch)))
    assert hf_targets(cfg)  # the float checkpoint's targets exist
    with pytest.raises(CheckpointError, match=f"quantized {cfg.architecture}"):
        hf_targets(dataclasses.replace(cfg, quant=QuantSpec("compressed-tensors", "int8")))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["granitemoe", "olmoe"])
def test_engine_equals_transformers_and_one_by_one(arch, make_tiny_checkpoint):
    """Through the engine: continuous batching with chunked prefill (64-token budget) and
    prefix caching give transformers' greedy tokens, and one request at a time the same."""
    from test_engine import GREEDY, NEW, hf_greedy, mixed_prompts, small_llm, token_ids

    path = make_tiny_checkpoint(arch)
    prompts = mixed_prompts(10, seed=3)
    prompts += [prompts[0] + p for p in mixed_prompts(3, seed=4)]  # shared prefixes
    llm = small_llm(path)
    batch = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                   use_tqdm=False))
    assert batch == hf_greedy(path, prompts, NEW)
    singles = [token_ids(llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False))[0]
               for p in prompts[:2]]
    assert singles == batch[:2]
    assert llm.llm_engine.kv_cache_manager.prefix_cache_hits > 0
