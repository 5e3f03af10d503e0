"""GPT-OSS (GptOssForCausalLM) against transformers 5 (float32, eager attention), with
test_models.py's harness: three ragged prompts (5, 17 and 30 tokens) prefilled through the
paged cache, then 32 greedy steps together; logits within its ATOL = 1e-4, tokens identical.

The tiny model (tests/gptoss_checkpoints.py) alternates sliding-window (8) and full layers, so
prompts and decode cross the window; it has attention biases and wide sinks, YaRN RoPE
(truncate=False), a biased router (top-k logits, softmax over them) and biased experts with
the clamped SwiGLU at limit 1.0. MXFP4: the host dequantization against transformers' own, to
the bit, and its refusals (the checkpoint kept 4-bit: tests/test_mxfp4.py).
Slow-marked: the reference backend, the engine (chunked prefill, prefix caching, preemption),
and TP 2 / EP 2 on virtual devices.
"""

import json
import os
import sys

import numpy as np
import pytest

from conftest import run_with_host_devices
from gptoss_checkpoints import make_gptoss, make_gptoss_mxfp4
from test_models import (_hf_model, _prompts, assert_greedy_matches_transformers,
                         bf16_and_transformers_errors)


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory) -> str:
    return make_gptoss(str(tmp_path_factory.mktemp("gptoss")))


@pytest.fixture(scope="module")
def mxfp4_pair(gptoss, tmp_path_factory) -> tuple[str, str]:
    """(an MXFP4 checkpoint, the float checkpoint of transformers' dequantization of it)."""
    q, f = (str(tmp_path_factory.mktemp(n)) for n in ("gptoss_mxfp4", "gptoss_dequantized"))
    make_gptoss_mxfp4(gptoss, q, f)
    return q, f


def test_matches_transformers(gptoss, load, greedy):
    import torch

    model, cfg, _ = load(gptoss)
    assert cfg.sliding_window == (8, 0, 8) and cfg.attention_sinks and cfg.expert_bias
    assert cfg.rope[0].rope_type == "yarn" and not cfg.rope[0].truncate
    assert cfg.swiglu_clamp == (1.702, 1.0) and cfg.scoring_func == "topk_softmax"
    assert_greedy_matches_transformers(gptoss, model, _prompts(), greedy)

    # The features matched above are live in this model: without its sinks, or with the
    # clamp lifted, transformers' own logits move by far more than the tolerance.
    prompt = torch.tensor([_prompts((30,))[0]])
    hf = _hf_model(gptoss)
    with torch.no_grad():
        want = hf(prompt).logits
        for layer in hf.model.layers:
            layer.mlp.experts.limit = 1e9
        assert (hf(prompt).logits - want).abs().max() > 1e-2
        hf = _hf_model(gptoss)
        for layer in hf.model.layers:
            layer.self_attn.sinks.zero_()
        assert (hf(prompt).logits - want).abs().max() > 1e-2


def test_experts_with_biases_and_clamped_swiglu_every_implementation():
    """Each of jaxllm.layers.experts' implementations (the reference backend picks among them
    by batch size on CPU) with GPT-OSS's gate/up bias and activation, against a plain loop."""
    import jax
    import jax.numpy as jnp

    from jaxllm.layers.experts import EXPERT_IMPLS, ClampedSwiGLU

    rng = np.random.default_rng(0)
    T, E, X, F, k = 11, 16, 6, 8, 2
    x = rng.normal(size=(T, E)).astype(np.float32)
    gu = rng.normal(size=(X, E, 2, F)).astype(np.float32)
    down = rng.normal(size=(X, F, E)).astype(np.float32)
    bias = rng.normal(size=(X, 2, F)).astype(np.float32)
    ids = np.stack([rng.permutation(X)[:k] for _ in range(T)]).astype(np.int32)
    weights = rng.random((T, k)).astype(np.float32)
    act = ClampedSwiGLU(1.702, 1.5)

    want = np.zeros((T, E), np.float32)
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            g, u = np.einsum("e,egf->gf", x[t], gu[e]) + bias[e]
            g, u = np.minimum(g, 1.5), np.clip(u, -1.5, 1.5)
            want[t] += weights[t, j] * (((u + 1) * g / (1 + np.exp(-1.702 * g))) @ down[e])
    for name, impl in EXPERT_IMPLS.items():
        got = jax.jit(lambda *a, impl=impl: impl(*a, lambda h: act(h, jnp.float32),
                                                 gate_up_bias=bias))(x, ids, weights, gu, down)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4, err_msg=name)


def test_mxfp4_dequantization_is_transformers_to_the_bit():
    """Every byte of blocks, scales across the e8m0 range, against
    transformers.integrations.mxfp4.convert_moe_packed_tensors in float32 and bfloat16."""
    import ml_dtypes
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from jaxllm.loader.mxfp4 import dequantize_mxfp4

    rng = np.random.default_rng(0)
    blocks = np.concatenate([np.arange(256, dtype=np.uint8),
                             rng.integers(0, 256, 3 * 2 * 5 * 2 * 16 - 256, dtype=np.uint8)])
    blocks = blocks.reshape(3, 2 * 5, 2, 16)  # [X, rows, G, 16]
    scales = rng.integers(127 - 40, 127 + 40, (3, 10, 2), dtype=np.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 64, 10) and ours.dtype == np.float32
    for dtype, np_dtype in ((torch.float32, np.float32), (torch.bfloat16, ml_dtypes.bfloat16)):
        theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                            dtype=dtype).float().numpy()
        mine = dequantize_mxfp4(blocks, scales, np_dtype)
        assert mine.dtype == np_dtype
        mine = mine.astype(np.float32)
        assert np.array_equal(mine.view(np.uint32), theirs.view(np.uint32)), dtype
    assert len(np.unique(ours)) > 100  # not a degenerate (all-zero) decoding


def test_mxfp4_refusals(mxfp4_pair, tmp_path):
    """A blocks tensor without its scales is a CheckpointError naming it; --quantization on an
    MXFP4 checkpoint and another quantization method on GPT-OSS are ConfigErrors."""
    import shutil

    from safetensors.numpy import load_file, save_file
    from transformers import AutoConfig

    from jaxllm.config import ConfigError
    from jaxllm.engine_config import ModelOptions
    from jaxllm.loader.weights import CheckpointError
    from jaxllm.models.model_config import ModelConfig
    from conftest import load_tiny

    q_path, _ = mxfp4_pair
    hf = AutoConfig.from_pretrained(q_path)
    with pytest.raises(ConfigError, match="'mxfp4'"):
        ModelConfig.from_hf(hf, ModelOptions(quantization="fp8"))
    hf.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(ConfigError, match="GPT-OSS quantization method 'gptq'"):
        ModelConfig.from_hf(hf)

    broken = str(tmp_path / "broken")
    shutil.copytree(q_path, broken)
    tensors = load_file(os.path.join(broken, "model.safetensors"))
    name = "model.layers.1.mlp.experts.down_proj_scales"
    del tensors[name]
    save_file(tensors, os.path.join(broken, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name):
        load_tiny(broken)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_other_backends_match_transformers(backend, gptoss, load, greedy):
    """reference: the XLA experts (gather/loop/tiled by batch size) and attention; pallas:
    the Pallas attention kernel with sinks and windows (its GPU variant, interpreted here)."""
    model, _, _ = load(gptoss, attention_backend=backend)
    assert model.attention_backend == backend
    assert_greedy_matches_transformers(gptoss, model, _prompts(), greedy)


@pytest.mark.slow
def test_bfloat16_error_is_transformers_bfloat16_error(gptoss, load, greedy):
    """In bfloat16 (norms scaling in float32, as transformers' GptOssRMSNorm) jaxllm strays
    from float32 transformers no more than transformers' own bfloat16 model does, on average:
    the largest errors sit where a near-tie in the router picks another expert, which each
    bfloat16 model does at its own positions."""
    model, cfg, _ = load(gptoss, dtype="bfloat16")
    assert cfg.dtype == "bfloat16" and cfg.norm_scale_f32
    prompts = _prompts()
    prefill, _, _ = greedy(model, prompts, 1)
    for err, their_err in bf16_and_transformers_errors(gptoss, prefill, prompts):
        assert err.mean() <= 1.5 * their_err.mean()


@pytest.mark.slow
def test_engine_equals_transformers_and_one_by_one(gptoss):
    """Through the engine with chunked prefill (64-token budget), prefix caching (shared
    prefixes) and then preemption (a cache too small for the batch): transformers' greedy
    tokens, and one request at a time the same."""
    from test_engine import GREEDY, NEW, hf_greedy, mixed_prompts, small_llm, token_ids

    prompts = mixed_prompts(10, seed=3)
    prompts += [prompts[0] + p for p in mixed_prompts(3, seed=4)]  # shared prefixes
    want = hf_greedy(gptoss, prompts, NEW)
    llm = small_llm(gptoss)
    batch = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                   use_tqdm=False))
    assert batch == want
    singles = [token_ids(llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False))[0]
               for p in prompts[:2]]
    assert singles == batch[:2]
    assert llm.llm_engine.kv_cache_manager.prefix_cache_hits > 0
    del llm
    small = small_llm(gptoss, num_gpu_blocks_override=40, max_model_len=128,
                      enable_prefix_caching=False)
    assert token_ids(small.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                    use_tqdm=False)) == want
    assert small.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_tensor_and_expert_parallel_2_match_one_device(gptoss):
    """tp=2 (heads, sinks and each expert's FFN with its gate/up bias sharded), tp=2 with
    expert parallelism (experts and their biases sharded), and tp=2 on the Pallas backend (the
    kernel per shard of heads under shard_map, each shard with its heads' sinks; interpreted)
    on virtual CPU devices equal tp=1."""
    proc = run_with_host_devices(2, [__file__, gptoss])
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    base = runs["tp1"]
    for name in ("tp2", "ep2", "pallas_tp2"):
        two = runs[name]
        assert two["devices"] == 2
        assert two["backend"] == ("pallas" if name == "pallas_tp2" else "reference"), name
        assert "layers/0/sinks" in two["sharded"], name
        assert "layers/0/experts_gate_up_bias" in two["sharded"], name
        for key in ("prefill", "steps"):
            np.testing.assert_allclose(np.array(two[key]), np.array(base[key]), atol=1e-4,
                                       rtol=0, err_msg=f"{name} {key}")
        assert two["tokens"] == base["tokens"], name


def _child(path: str) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import greedy_record, load_tiny, sharded_params

    prompts = _prompts((7, 19))
    report = {}
    for name, kw in (("tp1", dict(tp=1)), ("tp2", dict(tp=2)),
                     ("ep2", dict(tp=2, enable_expert_parallel=True)),
                     ("pallas_tp2", dict(tp=2, attention_backend="pallas"))):
        model, _, _ = load_tiny(path, **kw)
        report[name] = {"sharded": sharded_params(model), "backend": model.attention_backend,
                        **greedy_record(model, prompts, 8)}
    return report


def test_step_exports_for_tpu_and_cuda_with_sinks_inside():
    """The GPT-OSS step (test_export.py's, pallas backend) exports for TPU and CUDA: the
    platform's attention kernel and nothing CPU-only; the kernel call takes one more operand
    (the sinks) than the same model's without sinks."""
    import dataclasses
    import re
    from collections import Counter

    from test_export import CPU_ONLY, KERNEL, exported_step

    from jaxllm.config import EngineArgs
    from jaxllm.models.model_config import ModelConfig
    from gptoss_checkpoints import gptoss_config

    cfg = ModelConfig.from_hf(gptoss_config(), EngineArgs(model="tiny", dtype="bfloat16")
                              .create_engine_config().model)

    def kernel_operands(text, platform):  # operands of each of the platform's kernel calls
        calls = [line for line in text.splitlines() if f"custom_call @{KERNEL[platform]}" in line]
        assert calls
        return Counter(len(re.findall(r"%[\w#]+", line.split("(", 1)[1].split(")", 1)[0]))
                       for line in calls)

    for platform in ("tpu", "cuda"):
        exported = exported_step(platform, 1, cfg)
        text = exported.mlir_module()
        assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {KERNEL[platform]}
        assert not [name for name in CPU_ONLY if name in text]
        plain = exported_step(platform, 1, dataclasses.replace(cfg, attention_sinks=False))
        with_sinks, without = (kernel_operands(t.mlir_module(), platform)
                               for t in (exported, plain))
        # The attention calls take one more operand; the others (TPU: the experts' grouped
        # matmul) are unchanged.
        gone, new = without - with_sinks, with_sinks - without
        assert gone and new == Counter({n + 1: c for n, c in gone.items()}), (with_sinks, without)


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))
