"""GPT-OSS's MXFP4 experts kept 4-bit (jaxllm/loader/mxfp4.py, the `mxfp4` QuantSpec,
pallas_kernels/grouped_matmul/{mxfp4,kernel_mxfp4}.py).

The oracle is transformers: its `convert_moe_packed_tensors` for the decoding (to the bit), and
its GPT-OSS model running the float checkpoint of that decoding (tests/gptoss_checkpoints.py)
for the logits (f32, test_models' ATOL = 1e-4) and the greedy tokens. Slow-marked: the
reference and Pallas backends end to end, the kernel's other variant and dtype, the step
exported for TPU and CUDA, the engine, and TP 2 / EP 2 on virtual devices.
"""

import dataclasses
import json
import os
import re
import sys

import numpy as np
import pytest

from conftest import run_with_host_devices
from gptoss_checkpoints import MXFP4_CONFIG, gptoss_config, make_gptoss, make_gptoss_mxfp4
from test_models import _prompts, assert_greedy_matches_transformers


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    """(an MXFP4 GPT-OSS checkpoint, the float checkpoint of transformers' decoding of it)."""
    f = make_gptoss(str(tmp_path_factory.mktemp("gptoss_float")))
    q, d = (str(tmp_path_factory.mktemp(n)) for n in ("gptoss_mxfp4", "gptoss_dequantized"))
    make_gptoss_mxfp4(f, q, d)
    return q, d


@pytest.fixture(scope="module")
def kept(pair, load):
    """The MXFP4 checkpoint loaded kept 4-bit (CPU backend, float32 activations; on CPU the
    default dequantizes it, so --quantization mxfp4 asks for the kept form)."""
    return load(pair[0], quantization="mxfp4")


def _random_experts(rng, X, N, G):
    """Checkpoint-layout blocks [X, N, G, 16] covering every byte, scales 127 +- 40."""
    blocks = np.concatenate([np.arange(256, dtype=np.uint8),
                             rng.integers(0, 256, X * N * G * 16 - 256, dtype=np.uint8)])
    return blocks.reshape(X, N, G, 16), rng.integers(87, 167, (X, N, G), dtype=np.uint8)


def test_decoding_is_transformers_to_the_bit():
    """The on-device decoding (kernel layout: the checkpoint's bytes transposed) against
    transformers.integrations.mxfp4.convert_moe_packed_tensors, float32 and bfloat16."""
    import jax
    import jax.numpy as jnp
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pallas_kernels.grouped_matmul import mxfp4

    blocks, scales = _random_experts(np.random.default_rng(0), 3, 10, 2)
    q = jnp.asarray(blocks.reshape(3, 10, 32).transpose(0, 2, 1))  # [X, K / 2, N]
    s = jnp.asarray(scales.transpose(0, 2, 1))  # [X, K / 32, N]
    for dtype, torch_dtype in ((jnp.float32, torch.float32), (jnp.bfloat16, torch.bfloat16)):
        ours = np.asarray(jax.vmap(lambda q, s: mxfp4.dequantize(q, s, dtype))(q, s)
                          .astype(jnp.float32))
        theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                            dtype=torch_dtype).float().numpy()  # [X, K, N]
        assert ours.shape == theirs.shape == (3, 64, 10)
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), dtype
    assert len(np.unique(ours)) > 100  # not a degenerate decoding


def test_state_holds_the_checkpoint_bytes(pair, kept, load):
    """The experts stay uint8 blocks and e8m0 scales in the state (no float copy), at
    17/32 of a byte a value, and decode to exactly the float model of transformers'
    dequantization (loaded from its float checkpoint)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxllm.layers.quantization import QuantizedWeight, dequantize
    from jaxllm.loader.loader import weight_bytes

    model, cfg, _ = kept
    assert cfg.quant.method == "mxfp4" and cfg.quant.experts_only
    f_model, f_cfg, _ = load(pair[1])
    assert f_cfg.quant is None
    state = dict(nnx.to_flat_state(nnx.state(model)))
    f_state = dict(nnx.to_flat_state(nnx.state(f_model)))
    L, X, E, F = cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {"experts_gate_up": ((X, E // 2, 2, F), (X, E // 32, 2, F), (X, E, 2 * F)),
              "experts_down": ((X, F // 2, E), (X, F // 32, E), (X, F, E))}
    layers = 0
    for path, var in state.items():
        name = path[-1]
        if name not in shapes:
            # everything but the experts is the float model's, bit for bit
            if not name.endswith("_scale"):
                assert np.array_equal(np.asarray(var.get_value()),
                                      np.asarray(f_state[path].get_value())), path
            continue
        q, s = var.get_value(), state[path[:-1] + (name + "_scale",)].get_value()
        assert q.dtype == s.dtype == jnp.uint8
        assert q.shape[1:] == shapes[name][0] and s.shape[1:] == shapes[name][1]
        want = np.asarray(f_state[path].get_value())  # [layers, X, in..., out...]
        ins, n = shapes[name][2][1:]
        got = jax.jit(jax.vmap(jax.vmap(lambda q, s: dequantize(
            QuantizedWeight(q, s), ins, n, jnp.float32))))(q, s)
        assert np.array_equal(np.asarray(got), want.reshape(got.shape)), path
        layers += q.shape[0]
    assert layers == 2 * L  # every layer's gate/up and down checked
    per_layer = X * (2 * F * E + F * E) * 17 // 32  # values 1/2 byte, a scale byte per 32
    assert weight_bytes(model)["mxfp4"] == L * per_layer
    assert "mxfp4" not in weight_bytes(f_model)


def test_greedy_matches_transformers_on_the_decoded_weights(pair, kept, greedy):
    """Three ragged prompts, then 32 greedy steps: logits within ATOL of transformers running
    the dequantized checkpoint, the same tokens (test_models' harness)."""
    assert_greedy_matches_transformers(pair[1], kept[0], _prompts(), greedy)


def test_cpu_default_dequantizes_at_load(pair, load, greedy):
    """On CPU without --quantization the experts are dequantized as they arrive (the native
    grouped matmul takes float experts): no uint8 in the state, and the same tokens."""
    from jaxllm.loader.loader import weight_bytes

    model, cfg, _ = load(pair[0])
    assert cfg.quant is None and cfg.mxfp4_experts
    assert "mxfp4" not in weight_bytes(model)
    assert_greedy_matches_transformers(pair[1], model, _prompts(), greedy)


@pytest.mark.parametrize("variant,dtype", [
    ("gpu", "bfloat16"), pytest.param("gpu", "float32", marks=pytest.mark.slow),
    pytest.param("tpu", "bfloat16", marks=pytest.mark.slow),
    pytest.param("tpu", "float32", marks=pytest.mark.slow)])
def test_pallas_kernel_matches_the_reference(variant, dtype):
    """The Pallas grouped matmul (interpret mode) against the reference (every expert decoded,
    then ragged_dot): empty groups, rows past the groups, a group over two tiles, three column
    blocks, K in two chunks."""
    import jax.numpy as jnp

    from pallas_kernels.grouped_matmul import kernel_mxfp4, mxfp4

    rng = np.random.default_rng(1)
    G, K, N = 4, 1024, 48
    q = jnp.asarray(rng.integers(0, 256, (G, K // 2, N), dtype=np.uint8))
    s = jnp.asarray(rng.integers(120, 132, (G, K // 32, N), dtype=np.uint8))
    sizes = (2, 0, 19, 0)
    M = sum(sizes) + 2  # two rows past the groups
    assert kernel_mxfp4.block_sizes(M, K, N, variant) == (16, 512, 16 if variant == "gpu" else N)
    x = jnp.asarray(rng.normal(size=(M, K)), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    want = np.asarray(mxfp4.grouped_matmul(x, q, s, gs))
    got = np.asarray(kernel_mxfp4.grouped_matmul(x, q, s, gs, variant=variant, interpret=True))
    assert np.all(got[-2:] == 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())


def test_refusals(pair):
    """mxfp4 on another architecture, or with the experts left unconverted, is refused by
    name; --quantization names the checkpoint's method."""
    from transformers import AutoConfig, LlamaConfig

    from jaxllm.config import ConfigError
    from jaxllm.engine_config import ModelOptions
    from jaxllm.models.model_config import ModelConfig

    hf = AutoConfig.from_pretrained(pair[0])
    assert ModelConfig.from_hf(hf, ModelOptions(quantization="mxfp4")).quant.method == "mxfp4"
    with pytest.raises(ConfigError, match="checkpoint is quantized with 'mxfp4'"):
        ModelConfig.from_hf(hf, ModelOptions(quantization="fp8"))
    hf.quantization_config = {**MXFP4_CONFIG, "modules_to_not_convert": [
        "model.layers.*.mlp.experts"]}
    with pytest.raises(ConfigError, match="modules_to_not_convert naming the experts"):
        ModelConfig.from_hf(hf, ModelOptions(quantization="mxfp4"))
    llama = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    llama.architectures = ["LlamaForCausalLM"]
    llama.quantization_config = MXFP4_CONFIG
    with pytest.raises(ConfigError, match="mxfp4 quantization of LlamaForCausalLM"):
        ModelConfig.from_hf(llama)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_other_backends_match_transformers(backend, pair, load, greedy):
    """reference: the XLA grouped matmul decoding a tile's expert at a time; pallas: the same
    on CPU (the kernels are for TPU and GPU), with the Pallas attention interpreted."""
    model, _, _ = load(pair[0], attention_backend=backend, quantization="mxfp4")
    assert model.attention_backend == backend
    assert_greedy_matches_transformers(pair[1], model, _prompts(), greedy)


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_mxfp4_step_exports_for_the_accelerators(platform):
    """The GPT-OSS step (bf16, MXFP4 experts) exported for TPU and CUDA: the experts enter as
    uint8 and the MXFP4 kernel runs them (gate/up and down), where the float model's step has
    no such kernel."""
    from test_export import KERNEL, exported_step

    from jaxllm.config import EngineArgs
    from jaxllm.models.model_config import ModelConfig

    hf = gptoss_config(hidden_size=128, intermediate_size=128, num_local_experts=4)
    options = EngineArgs(model="tiny", dtype="bfloat16").create_engine_config().model
    float_cfg = ModelConfig.from_hf(hf, options)
    options = dataclasses.replace(options, quantization="mxfp4")  # kept (a TPU/GPU's default)
    hf.quantization_config = MXFP4_CONFIG
    cfg = ModelConfig.from_hf(hf, options)
    assert cfg.quant.method == "mxfp4" and dataclasses.replace(
        cfg, quant=None, mxfp4_experts=False) == float_cfg
    texts = [exported_step(platform, 1, c).mlir_module() for c in (cfg, float_cfg)]
    kernel = rf"custom_call @{re.escape(KERNEL[platform])}.*_mxfp4_\w+_kernel"
    assert [len(re.findall(kernel, t)) for t in texts] == [2, 0]
    assert re.search(r"tensor<[0-9x]+x4x64x2x128xui8>", texts[0])  # gate/up values [L, X, ...]


@pytest.mark.slow
def test_engine_serves_the_kept_checkpoint_as_transformers(pair):
    """Through the engine (chunked prefill over a 64-token budget, prefix caching on shared
    prefixes, a batch and one request alone): transformers' greedy tokens on the dequantized
    checkpoint, the experts resident as mxfp4 bytes."""
    from test_engine import GREEDY, NEW, hf_greedy, mixed_prompts, small_llm, token_ids

    prompts = mixed_prompts(6, seed=5)
    prompts += [prompts[0] + p for p in mixed_prompts(2, seed=6)]
    want = hf_greedy(pair[1], prompts, NEW)
    llm = small_llm(pair[0], quantization="mxfp4")
    assert llm.llm_engine.weight_bytes["mxfp4"] > llm.llm_engine.weight_bytes["float32"] / 8
    assert token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                  use_tqdm=False)) == want
    assert token_ids(llm.generate({"prompt_token_ids": prompts[1]}, GREEDY,
                                  use_tqdm=False)) == want[1:2]
    assert llm.llm_engine.kv_cache_manager.prefix_cache_hits > 0


@pytest.mark.slow
def test_tensor_and_expert_parallel_2_match_one_device(pair, tmp_path):
    """tp=2 (each expert's FFN sharded, values and scales alike) and tp=2 with expert
    parallelism, on virtual CPU devices, equal tp=1: with F = 64 (two scale groups of the down
    projection's inputs, one a device: the experts run per shard under shard_map) and with
    the module's F = 32 (one group: the down projection cannot split its groups, and runs
    unsharded by shard_map)."""
    f = make_gptoss(str(tmp_path / "float64"), intermediate_size=64)
    q64 = str(tmp_path / "mxfp4_64")
    make_gptoss_mxfp4(f, q64, str(tmp_path / "dequantized_64"))
    proc = run_with_host_devices(2, [__file__, q64, pair[0]])
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    for path in (q64, pair[0]):
        base = runs[path]["tp1"]
        for name in ("tp2", "ep2"):
            two = runs[path][name]
            assert two["devices"] == 2
            assert "layers/0/experts_gate_up" in two["sharded"], (path, name)
            assert "layers/0/experts_gate_up_scale" in two["sharded"], (path, name)
            for key in ("prefill", "steps"):
                np.testing.assert_allclose(np.array(two[key]), np.array(base[key]), atol=1e-4,
                                           rtol=0, err_msg=f"{path} {name} {key}")
            assert two["tokens"] == base["tokens"], (path, name)


def _child(paths: list[str]) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import greedy_record, load_tiny, sharded_params

    prompts = _prompts((7, 19))
    report = {}
    for path in paths:
        report[path] = {}
        for name, kw in (("tp1", dict(tp=1)), ("tp2", dict(tp=2)),
                         ("ep2", dict(tp=2, enable_expert_parallel=True))):
            model, cfg, _ = load_tiny(path, quantization="mxfp4", **kw)
            assert cfg.quant.method == "mxfp4"
            report[path][name] = {"sharded": sharded_params(model),
                                  **greedy_record(model, prompts, 8)}
    return report


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1:])))
