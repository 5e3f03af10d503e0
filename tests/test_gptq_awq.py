"""GPTQ (AutoGPTQ / GPTQModel) and AWQ (AutoAWQ GEMM) checkpoints served quantized.

transformers loads these only through gptqmodel / autoawq, which need their own kernels, so the
test writes each format's tensors itself, from the formats' definitions (packers checked below
on known words), and the oracle is transformers' float model with every projection set to the
dequantized weight (q - z) * s."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from flax import nnx

from jaxllm.config import ConfigError
from quant_checkpoints import assert_equals_oracle

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the column each nibble of a word holds, low first


def _pack_along_rows(v: np.ndarray, bits: int) -> np.ndarray:
    """[r, c] unsigned -> int32 [r * bits / 32, c]: GPTQ's qweight (row 8i + j of 4-bit values
    in bits 4j of word i)."""
    per = 32 // bits
    v = v.astype(np.uint32).reshape(-1, per, v.shape[1])
    return sum(v[:, j] << (bits * j) for j in range(per)).astype(np.uint32).view(np.int32)


def _pack_along_columns(v: np.ndarray, bits: int, order=None) -> np.ndarray:
    """[r, c] unsigned -> int32 [r, c * bits / 32]; `order` = which column of each word every
    nibble holds (AWQ), else in order (GPTQ's qzeros)."""
    per = 32 // bits
    order = list(range(per)) if order is None else order
    v = v.astype(np.uint32).reshape(v.shape[0], -1, per)
    return sum(v[:, :, order[j]] << (bits * j) for j in range(per)).astype(
        np.uint32).view(np.int32)


def test_packers_make_the_formats_words():
    cols = np.arange(8)[None, :]
    assert _pack_along_columns(cols, 4).view(np.uint32)[0, 0] == 0x76543210
    assert _pack_along_columns(cols, 4, AWQ_ORDER).view(np.uint32)[0, 0] == 0x75316420
    assert _pack_along_rows(cols.T, 4).view(np.uint32)[0, 0] == 0x76543210
    assert _pack_along_rows(np.arange(4)[:, None] * 60, 8).view(np.uint32)[0, 0] == 0xB4783C00


def _quantize(w: np.ndarray, bits: int, group: int, sym: bool):
    """Min-max quantization of [out, in] per group of `group` inputs: unsigned q [out, in],
    unsigned zero points and scales [out, groups] (scales rounded to float16, as stored)."""
    out, inputs = w.shape
    x = w.reshape(out, inputs // group, group)
    maxq = 2 ** bits - 1
    if sym:
        s = np.abs(x).max(-1) * 2 / maxq
        z = np.full(s.shape, (maxq + 1) // 2)
    else:
        lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
        s = (hi - lo) / maxq
    s = np.maximum(s, 1e-6).astype(np.float16).astype(np.float32)
    if not sym:
        z = np.clip(np.round(-lo / s), 0, maxq)
    q = np.clip(np.round(x / s[..., None]) + z[..., None], 0, maxq)
    return q.reshape(out, inputs).astype(np.int64), z.astype(np.int64), s


def _write(src: str, dst: str, method: str, bits: int, group: int, sym: bool, v2=False):
    """The checkpoint at src with its projections in `method`'s layout; returns the
    dequantized weights by tensor name (the oracle's)."""
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    dequantized = {}
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in PROJECTIONS]:
        w = tensors.pop(name)
        q, z, s = _quantize(w, bits, group, sym)
        dequantized[name] = (q - np.repeat(z, group, axis=1)) * np.repeat(s, group, axis=1)
        base = name[:-len(".weight")]
        if method == "gptq":
            tensors[f"{base}.qweight"] = _pack_along_rows(q.T, bits)
            tensors[f"{base}.qzeros"] = _pack_along_columns((z - (0 if v2 else 1)).T, bits)
            tensors[f"{base}.g_idx"] = (np.arange(w.shape[1]) // group).astype(np.int32)
        else:
            tensors[f"{base}.qweight"] = _pack_along_columns(q.T, bits, AWQ_ORDER)
            tensors[f"{base}.qzeros"] = _pack_along_columns(z.T, bits, AWQ_ORDER)
        tensors[f"{base}.scales"] = s.T.astype(np.float16)
    # C order (safetensors writes the buffer as it lies), and not over the file just read: its
    # arrays may still map it.
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              os.path.join(dst, "quantized.safetensors"))
    os.replace(os.path.join(dst, "quantized.safetensors"), os.path.join(dst, "model.safetensors"))
    qc = ({"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False,
           "sym": sym, "checkpoint_format": "gptq_v2" if v2 else "gptq"} if method == "gptq"
          else {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True,
                "version": "gemm"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": qc}, f)
    return dequantized


def _oracle(src: str, dequantized: dict):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name, w in dequantized.items():
            state[name].copy_(torch.from_numpy(w.astype(np.float32)))
    return model


@pytest.mark.parametrize("method, bits, group, sym, v2", [
    ("gptq", 4, 32, True, False),
    ("gptq", 4, 16, False, False),
    ("gptq", 8, 32, False, True),
    ("awq", 4, 32, False, False),
])
def test_checkpoint_equals_transformers_on_its_dequantized_weights(
        tiny_llama, load, greedy, tmp_path, method, bits, group, sym, v2):
    path = str(tmp_path / method)
    dequantized = _write(tiny_llama, path, method, bits, group, sym, v2)
    model, cfg, _ = load(path)
    assert (cfg.quant.method, cfg.quant.group_size, cfg.quant.symmetric) == (method, group, sym)
    state = {"/".join(map(str, k)): v.get_value()
             for k, v in nnx.to_flat_state(nnx.state(model))}
    assert state["layers/0/qkv"].dtype.name == ("uint8" if bits == 4 else "int8")
    assert_equals_oracle(model, _oracle(tiny_llama, dequantized), greedy)


@pytest.mark.parametrize("update, message", [
    ({"desc_act": True}, "desc_act true"),
    ({"bits": 3}, "bits 3"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
])
def test_unsupported_gptq_is_refused_by_name(tiny_llama, load, tmp_path, update, message):
    path = str(tmp_path / "gptq")
    _write(tiny_llama, path, "gptq", 4, 32, True)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"].update(update)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ConfigError, match=message):
        load(path)


def test_symmetric_gptq_with_other_zero_points_is_refused(tiny_llama, load, tmp_path):
    """A checkpoint saying sym true whose zero points are not the midpoint would dequantize
    wrong if they were dropped: the loader checks them."""
    from jaxllm.loader.weights import CheckpointError
    path = str(tmp_path / "gptq")
    _write(tiny_llama, path, "gptq", 4, 32, False)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["sym"] = True
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match="qzeros"):
        load(path)
