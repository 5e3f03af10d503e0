"""Per-layer KV-cache scales for a float8 KV cache (vLLM's `k_scale` / `v_scale`).

With `--kv-cache-dtype fp8*` every dense or MoE attention layer holds float32 (k_scale,
v_scale), the `kv_scales` parameter [layers, 2] of its group: the cache stores k / k_scale and
v / v_scale in float8 (saturated) and attention multiplies them back. They ride in the layer
scan as the layer's slice, so one compiled step serves every layer's scales, whatever they are.
Where they come from: the checkpoint (jaxllm/loader/kv_scales.py), a calibration prefill at
start-up with --calculate-kv-scales (jaxllm/engine/kv_calibration.py), else 1.0 with a warning.
"""

from __future__ import annotations

import logging
from typing import Optional

from jaxllm.config import ConfigError

logger = logging.getLogger("jaxllm")

# ModelConfig.kv_scales: read from the checkpoint (1.0 where it has none), or computed at
# start-up (the checkpoint's, if any, are then ignored, as vLLM does).
FROM_CHECKPOINT, CALCULATED = "checkpoint", "calculate"


def kv_scales_wanted(fields: dict, options) -> Optional[str]:
    """ModelConfig.kv_scales for a model of ModelConfig `fields` run with ModelOptions
    `options`: None unless the KV cache is float8. Multi-head latent attention, hybrid
    linear-attention and Gemma 4 layers attend through their own code and take no scales:
    their float8 cache stays unscaled (--calculate-kv-scales is refused for them)."""
    if not options.kv_cache_dtype.startswith("fp8"):
        return None
    if fields.get("kv_lora_rank") or fields.get("linear_layers") or fields.get("gemma4"):
        if options.calculate_kv_scales:
            raise ConfigError(f"--calculate-kv-scales: {fields['architecture']}'s attention "
                              "layers take no per-layer KV scales (supported: dense and MoE "
                              "attention layers)")
        logger.warning("--kv-cache-dtype %s: %s's attention layers take no per-layer KV "
                       "scales; its float8 cache is unscaled (scale 1.0) and any k/v scales in "
                       "the checkpoint are not used", options.kv_cache_dtype,
                       fields["architecture"])
        return None
    return CALCULATED if options.calculate_kv_scales else FROM_CHECKPOINT
