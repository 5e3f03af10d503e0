"""Quantized weights (issue 45): the online fp8 method against transformers running the same
quantized-then-dequantized weights, what is refused by name, what stays resident, and the
quantized step lowered for TPU and CUDA."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import numpy as np
import pytest
from flax import nnx

from jaxllm.config import ConfigError, EngineArgs
from jaxllm.layers.quantization import (QuantizedWeight, QuantSpec, dequantize, pack_int4,
                                       quantize_rows)
from jaxllm.models.quant_config import quant_spec

PROMPTS = [[1, 5, 9, 33, 70, 2, 8, 100], [4, 8, 15, 16, 23, 42]]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fake_quantized_transformers(path: str, quantize):
    """transformers' model of `path` with every layer projection's weight replaced by
    quantize(weight) (torch, float32), the oracle of an online method."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in PROJECTIONS:
                module.weight.copy_(quantize(module.weight))
    return model


def _torch_fp8_per_channel(w):
    """vLLM-style online fp8, per output channel: amax / 448 scales, e4m3 values."""
    import torch
    scale = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
    return (w / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale


def _hf_logits(model, prompt):
    import torch
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].numpy()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_online_fp8_equals_transformers_on_the_same_fp8_weights(tiny_llama, load, greedy,
                                                               backend):
    model, cfg, _ = load(tiny_llama, quantization="fp8", attention_backend=backend)
    assert cfg.quant == QuantSpec(method="fp8", weight_dtype="float8_e4m3fn")
    prefill, _, tokens = greedy(model, PROMPTS, 4)
    oracle = _fake_quantized_transformers(tiny_llama, _torch_fp8_per_channel)
    float_model = _fake_quantized_transformers(tiny_llama, lambda w: w)
    for p, got in zip(PROMPTS, prefill):
        want, unquantized = _hf_logits(oracle, p), _hf_logits(float_model, p)
        err = np.abs(got - want).max()
        # Equal up to float32 summation order; the quantization itself moves logits ~100x more.
        assert err < 2e-4 * np.abs(want).max(), err
        assert np.abs(unquantized - want).max() > 20 * err
    # Greedy continuation as transformers generates it on the fp8 weights.
    import torch
    for p, toks in zip(PROMPTS, tokens):
        out = oracle.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False)
        assert out[0, len(p):].tolist() == toks


def test_quantized_projections_stay_quantized_on_device(tiny_llama, load):
    model, cfg, _ = load(tiny_llama, quantization="fp8")
    flat = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(nnx.state(model))}
    for name in ("qkv", "o", "gate_up", "down"):
        w, scale = flat[f"layers/0/{name}"], flat[f"layers/0/{name}_scale"]
        assert w.dtype == np.dtype("float8_e4m3fn"), name
        assert scale.dtype == np.float32 and scale.shape[1] == 1, (name, scale.shape)
    assert flat["embed"].dtype == np.float32  # embeddings and the head are not quantized


@pytest.mark.parametrize("dtype", ["int8", "int4", "float8_e4m3fn"])
@pytest.mark.parametrize("group", [None, 16])
def test_quantize_then_dequantize_is_within_half_a_step(dtype, group):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 64)).astype(np.float32)
    spec = QuantSpec(method="test", weight_dtype=dtype, group_size=group)
    q, scale = quantize_rows(w, spec)
    assert scale.shape == (24, spec.groups(64))
    # QuantizedWeight's layout: values [in, out], scales [groups, out].
    stored = pack_int4(q.T) if dtype == "int4" else q.T  # as the model keeps them
    back = np.asarray(dequantize(QuantizedWeight(stored, scale.T), 64, 24, np.float32)).T
    step = np.repeat(scale, 64 // scale.shape[1], axis=1)
    rel = {"int8": 0.5, "int4": 0.5, "float8_e4m3fn": 0.5 * 448 / 8}[dtype]  # e4m3: 3 bits
    assert (np.abs(back - w) <= rel * step + 1e-7).all()
    assert np.abs(back - w).max() > 0  # it did quantize


def _with_quant_config(src: str, dst: str, qc: dict) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


CT = {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
          "symmetric": True, "dynamic": False}}}, "ignore": ["lm_head"]}


@pytest.mark.parametrize("qc, requested, message", [
    ({"quant_method": "bitsandbytes"}, None, "'bitsandbytes' .*not supported; supported: "
     "compressed-tensors, gptq, awq, gguf, fp8"),
    (None, "bitsandbytes", "--quantization 'bitsandbytes' is not supported"),
    (None, "awq", "no quantization_config of that method"),
    (None, "compressed-tensors", "no quantization_config of that method"),
    (CT, "fp8", "quantized with 'compressed-tensors'"),
    ({**CT, "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head"}},
     None, "kv_cache_scheme"),
    ({**CT, "format": "marlin-24"}, None, "format 'marlin-24'"),
    ({**CT, "ignore": ["lm_head", "re:.*down_proj"]}, None, "mlp.down_proj"),
    ({**CT, "config_groups": {"g": {"targets": ["Linear"], "weights": {
        **CT["config_groups"]["group_0"]["weights"], "strategy": "block"}}}}, None,
     "strategy 'block'"),
    ({**CT, "config_groups": {"g": {"targets": ["Linear"], "weights": {
        **CT["config_groups"]["group_0"]["weights"], "actorder": "group"}}}}, None,
     "actorder 'group'"),
])
def test_unsupported_quantization_is_refused_by_name(qc, requested, message):
    with pytest.raises(ConfigError, match=message):
        quant_spec(qc, requested)


def test_unknown_methods_are_refused(tiny_llama, load, tmp_path):
    with pytest.raises(ConfigError, match="--quantization.*'int3'.*supported: "
                                          "compressed-tensors, gptq, awq, gguf, fp8"):
        EngineArgs(model=tiny_llama, quantization="int3")
    bad = _with_quant_config(tiny_llama, str(tmp_path / "bnb"), {"quant_method": "bitsandbytes"})
    with pytest.raises(ConfigError, match="'bitsandbytes'"):
        load(bad)


def test_compressed_tensors_config_is_read_as_one_spec():
    spec = quant_spec(CT, None)
    assert spec == QuantSpec(method="compressed-tensors", weight_dtype="int4", group_size=32,
                             symmetric=True, activations="none",
                             checkpoint_format="pack-quantized")
    fp8 = {**CT, "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                           "strategy": "tensor", "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                              "dynamic": False}}}}
    assert quant_spec(fp8, "compressed-tensors") == QuantSpec(
        method="compressed-tensors", weight_dtype="float8_e4m3fn", activations="static",
        checkpoint_format="float-quantized")


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("spec", [QuantSpec("fp8", "float8_e4m3fn"),
                                  QuantSpec("compressed-tensors", "int4", group_size=32,
                                            symmetric=False)])
def test_quantized_step_exports_for_the_accelerators(platform, spec):
    from test_export import KERNEL, exported_step, export_config
    exported = exported_step(platform, 1, dataclasses.replace(export_config(), quant=spec))
    text = exported.mlir_module()
    assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {KERNEL[platform]}
    storage = {"float8_e4m3fn": "f8E4M3FN", "int4": "ui8"}[spec.weight_dtype]  # int4: 2 a byte
    # The weights enter the program in their storage type and are widened inside it.
    assert re.search(rf"tensor<[0-9x]+x{storage}>", text)
