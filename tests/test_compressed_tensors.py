"""compressed-tensors checkpoints (llm-compressor's output, written by compressed-tensors' own
code in tests/quant_checkpoints.py) served quantized: logits and greedy tokens equal to
transformers loading the same checkpoint.

The oracle decompresses the weights (`CompressedTensorsConfig(dequantize=True)`) and runs the
activations unquantized, as jaxllm does (docs/quantization.md: weight-only compute, whatever
the checkpoint says of activations)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from flax import nnx

from jaxllm.loader.loader import describe_weights, weight_bytes
from quant_checkpoints import assert_equals_oracle, write_quantized

STORAGE = {"w8a16": "int8", "w8a8": "int8", "fp8": "float8_e4m3fn", "fp8-tensor": "float8_e4m3fn",
           "w4a16": "int4"}


def _transformers(path: str):
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You passed `quantization_config`")
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32,
            quantization_config=CompressedTensorsConfig(dequantize=True)).eval()


@pytest.mark.parametrize("scheme, group, symmetric, backend", [
    ("w8a16", None, True, "auto"),
    ("w8a16", 32, False, "reference"),
    ("w8a8", None, True, "auto"),
    ("fp8", None, True, "auto"),
    ("fp8-tensor", None, True, "reference"),
    ("w4a16", 32, True, "auto"),
    ("w4a16", 16, False, "auto"),
])
def test_checkpoint_equals_transformers(tiny_llama, load, greedy, tmp_path, scheme, group,
                                        symmetric, backend):
    path = write_quantized(tiny_llama, str(tmp_path / scheme), scheme, group_size=group,
                           symmetric=symmetric)
    model, cfg, _ = load(path, attention_backend=backend)
    assert cfg.quant.method == "compressed-tensors"
    assert (cfg.quant.weight_dtype, cfg.quant.group_size, cfg.quant.symmetric) == (
        STORAGE[scheme], group, symmetric)
    state = {"/".join(map(str, k)): v.get_value()
             for k, v in nnx.to_flat_state(nnx.state(model))}
    # int4 two to a byte (pack_int4): half the bytes of int8
    assert state["layers/0/qkv"].dtype.name == ("uint8" if scheme == "w4a16" else STORAGE[scheme])
    assert state["layers/0/qkv"].nbytes * (2 if scheme == "w4a16" else 1) == (
        np.prod(state["layers/0/qkv_scale"].shape[2:]) * cfg.hidden_size * 2)
    assert ("layers/0/down_zero" in state) == (not symmetric)
    # int8/int4 run in the native CPU matmul (read in place); fp8 and the reference in XLA
    native = backend == "auto" and STORAGE[scheme] in ("int8", "int4")
    assert bool(model.backend.resident_quantized) == native
    # Reported at start-up: the projections' bytes under their quantized dtype.
    sizes = weight_bytes(model)
    assert sizes[STORAGE[scheme]] == sum(state[f"layers/0/{p}"].nbytes
                                         for p in ("qkv", "o", "gate_up", "down"))
    assert STORAGE[scheme] in describe_weights(sizes)

    assert_equals_oracle(model, _transformers(path), greedy)


def test_quantized_checkpoint_serves_through_llm(tiny_llama, tmp_path):
    """The offline API on a W4A16 checkpoint: the same greedy text as transformers."""
    import torch
    from jaxllm import LLM, SamplingParams

    path = write_quantized(tiny_llama, str(tmp_path / "w4a16"), "w4a16", group_size=32)
    # 16-token steps (the prompt has 6): one token bucket to compile, not eight up to 2048
    llm = LLM(model=path, dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=16, num_gpu_blocks_override=64)
    prompt = [1, 5, 9, 33, 70, 2]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    oracle = _transformers(path)
    with torch.no_grad():
        want = oracle.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                               eos_token_id=None)
    assert list(out[0].outputs[0].token_ids) == want[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch, scheme, group, symmetric", [
    # (asymmetric experts: transformers 5.24 cannot load them into its fused experts, so
    # there is no oracle; dense asymmetric checkpoints are tested above)
    ("mixtral", "w4a16", 16, True),
    pytest.param("qwen2_moe", "w8a16", None, True, marks=pytest.mark.slow),  # ~10 s each
    pytest.param("qwen2_moe", "fp8", None, True, marks=pytest.mark.slow),
])
def test_moe_checkpoint_equals_transformers(make_tiny_checkpoint, load, greedy, tmp_path, arch,
                                            scheme, group, symmetric):
    """Experts (and Qwen2-MoE's shared expert) quantized, routers not, as llm-compressor
    leaves them."""
    src = make_tiny_checkpoint(arch)
    path = write_quantized(src, str(tmp_path / scheme), scheme, group_size=group,
                           symmetric=symmetric)
    model, cfg, _ = load(path)
    state = {"/".join(map(str, k)): v.get_value()
             for k, v in nnx.to_flat_state(nnx.state(model))}
    moe = next(i for i, g in enumerate(model.groups) if g.kind == "moe")
    assert state[f"layers/{moe}/experts_down"].dtype.name == (
        "uint8" if scheme == "w4a16" else STORAGE[scheme])
    assert state[f"layers/{moe}/router"].dtype == np.float32
    assert (f"layers/{moe}/experts_down_zero" in state) == (not symmetric)
    assert_equals_oracle(model, _transformers(path), greedy)
