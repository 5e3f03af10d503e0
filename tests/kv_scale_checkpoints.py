"""Tiny Llama checkpoints whose k and v need float8 KV scales, for tests/test_kv_scales.py.

From the session's tiny random Llama (float32), each layer l's k_proj rows are multiplied by
C[l] and its q_proj rows divided by C[l], likewise v_proj times C[l] and o_proj's columns
divided by it: q . k and the layer's output are unchanged (so the model computes what the
original does), but k and v reach hundreds to thousands, beyond float8 e4m3's largest value
(448), and differ per layer by 10x. Stored unscaled they saturate; with per-layer scales
(amax / 448, measured on the model's own k/v as llm-compressor would) they fit.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

C = (60.0, 600.0)  # per layer: how far k and v are stretched


def stretched_checkpoint(src: str, dst: str) -> str:
    """The checkpoint `src` with k/v stretched per layer (C), no scales written."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    t = load_file(path)
    for layer, c in enumerate(C):
        p = f"model.layers.{layer}.self_attn."
        t[p + "q_proj.weight"] = t[p + "q_proj.weight"] / c
        t[p + "k_proj.weight"] = t[p + "k_proj.weight"] * c
        t[p + "v_proj.weight"] = t[p + "v_proj.weight"] * c
        t[p + "o_proj.weight"] = t[p + "o_proj.weight"] / c
    save_file(t, path, metadata={"format": "pt"})
    return dst


def add_scales(dst: str, scales: np.ndarray, names: str = "kv_cache_scheme") -> str:
    """Write per-layer scales [layers, 2] (k, v) into `dst`'s safetensors, under the names of
    `names`: 'kv_cache_scheme' (self_attn.k_scale / v_scale, with the config's
    quantization_config saying so), 'output_scale' (k_proj/v_proj.output_scale) or
    'kv_scale' (one self_attn.kv_scale: the larger of the two)."""
    from safetensors.numpy import load_file, save_file

    path = os.path.join(dst, "model.safetensors")
    t = load_file(path)
    for layer, (k, v) in enumerate(np.asarray(scales, np.float32)):
        p = f"model.layers.{layer}.self_attn."
        if names == "kv_cache_scheme":
            t[p + "k_scale"], t[p + "v_scale"] = np.array(k), np.array(v)
        elif names == "output_scale":
            t[p + "k_proj.output_scale"], t[p + "v_proj.output_scale"] = (np.array([k]),
                                                                           np.array([v]))
        else:
            t[p + "kv_scale"] = np.array(max(k, v), np.float32)
    save_file(t, path, metadata={"format": "pt"})
    if names == "kv_cache_scheme":
        cfg_path = os.path.join(dst, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                "dynamic": False, "symmetric": True}}
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
    return dst
