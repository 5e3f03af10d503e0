"""A float8 KV cache's per-layer scales in a checkpoint -> the attention groups' `kv_scales`
parameter ([layers, 2]: k_scale, v_scale; jaxllm/models/kv_scales.py).

The names vLLM reads (its `maybe_remap_kv_scale_name`), per layer N under model.layers.N.:
  self_attn.k_scale / self_attn.v_scale      compressed-tensors' kv_cache_scheme (llm-compressor)
  self_attn.k_proj.output_scale / v_proj.    older compressed-tensors checkpoints
  self_attn.k_proj.k_scale / v_proj.v_scale  ModelOpt / Quark
  self_attn.kv_scale                         one scale for both
A layer without them keeps 1.0 (with one warning for the load, as vLLM). A scale that is not
positive and finite is refused, naming the tensor. Without a float8 cache the model holds no
scales and these tensors are skipped (vLLM ignores them for an 'auto' cache too).
"""

from __future__ import annotations

import logging
import re

import numpy as np

from jaxllm.loader.quantized import Target

logger = logging.getLogger("jaxllm")

# Tensor name suffix (after model.layers.N.) -> the columns of kv_scales it sets.
SCALE_NAMES = {"self_attn.k_scale": (0,), "self_attn.v_scale": (1,),
               "self_attn.k_proj.output_scale": (0,), "self_attn.v_proj.output_scale": (1,),
               "self_attn.k_proj.k_scale": (0,), "self_attn.v_proj.v_scale": (1,),
               "self_attn.kv_scale": (0, 1)}
_PATTERN = re.compile(r"model\.layers\.(\d+)\.(" + "|".join(map(re.escape, SCALE_NAMES)) + ")$")


def is_kv_scale(name: str) -> bool:
    """Whether a checkpoint tensor is a layer's KV-cache scale (one of SCALE_NAMES)."""
    return _PATTERN.match(name) is not None


def _check(x: np.ndarray, cols: tuple) -> np.ndarray:
    """One positive finite scale -> the [1, len(cols)] block of kv_scales it fills."""
    x = np.asarray(x, np.float32)
    if x.size != 1:
        raise ValueError(f"a KV-cache scale must hold one value (per tensor), not shape "
                         f"{x.shape}")
    value = float(x.reshape(()))
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"KV-cache scale {value!r} is not a positive finite number")
    return np.full((1, len(cols)), value, np.float32)


def kv_scale_targets(groups) -> dict[str, list[Target]]:
    """The scale tensors of the layers of `groups` (decoder LayerGroups whose layers hold
    kv_scales: dense and MoE ones), by name: optional (`missing_layers`)."""
    out = {}
    for g, group in enumerate(groups):
        for i in range(group.first, group.first + group.count):
            for suffix, cols in SCALE_NAMES.items():
                out[f"model.layers.{i}.{suffix}"] = [Target(
                    ("layers", g, "kv_scales"), (i - group.first, cols[0]), None,
                    lambda x, cols=cols: _check(x, cols), np.float32)]
    return out


def missing_layers(num_layers: int, seen) -> list[int]:
    """The layers none of whose scale tensors were read (they keep 1.0)."""
    found = set()
    for name in seen:
        m = _PATTERN.match(name)
        if m:
            found.add(int(m.group(1)))
    return [i for i in range(num_layers) if i not in found]


def warn_missing(missing: list[int], num_layers: int) -> None:
    """vLLM's one warning for a float8 cache whose scales the checkpoint does not give."""
    if not missing:
        return
    which = ("the checkpoint has no k_scale/v_scale" if len(missing) == num_layers else
             f"the checkpoint has no k_scale/v_scale for layers {missing}")
    logger.warning("fp8 KV cache: %s; using KV cache scaling factor 1.0 there (k/v beyond the "
                   "format's range saturate). If this is unintended, give a checkpoint with "
                   "k/v scales (compressed-tensors' kv_cache_scheme) or --calculate-kv-scales",
                   which)
