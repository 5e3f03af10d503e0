"""Start-up rules for hybrid models (Qwen3-Next: linear-attention layers with per-sequence
state beside full-attention layers with paged KV; jaxllm/models/qwen3_next.py).

What is not built for them is refused by name here, before the runner is made; prefix caching
is turned off with a message, as vLLM does for models whose state it cannot snapshot: a cached
KV prefix would skip tokens whose linear-attention state was never kept.
"""

from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp

from jaxllm.config import ConfigError
from jaxllm.engine_config import EngineConfig
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.qwen3_next import state_shapes

logger = logging.getLogger("jaxllm")


def hybrid_engine_config(config: EngineConfig, mc: ModelConfig) -> EngineConfig:
    """`config` for this model: unchanged for a model without linear-attention layers."""
    if not mc.linear_layers:
        return config
    name = f"{mc.architecture} (linear-attention state beside the KV cache)"
    pp = config.parallel.pipeline_parallel_size
    if pp > 1:
        raise ConfigError(f"--pipeline-parallel-size={pp}: {name} is not implemented with "
                          "pipeline stages")
    if config.speculative is not None:
        raise ConfigError(f"--speculative-config: speculative decoding on {name} is not "
                          "implemented (the state would have to roll back to the accepted "
                          "drafts)")
    if config.cache.kv_offloading_size is not None:
        raise ConfigError(f"--kv-offloading-size: {name} runs without prefix caching, whose "
                          "evicted blocks the host tier keeps")
    if config.cache.enable_prefix_caching:
        logger.warning("Prefix caching is disabled for %s: a cached prefix restores KV blocks "
                       "but not the linear-attention layers' state, which is not snapshotted "
                       "at block boundaries", name)
        config = dataclasses.replace(config, cache=dataclasses.replace(
            config.cache, enable_prefix_caching=False))
    return config


def state_cache_bytes(mc: ModelConfig, slots: int, dtype) -> int:
    """Bytes of the linear-attention state cache (every such layer's conv and recurrent state
    for `slots` sequences) in `dtype`; 0 for a model without those layers."""
    layers = sum(mc.linear_layers)
    if not layers:
        return 0
    conv, rec = state_shapes(mc, layers, slots)
    n = sum(int(jnp.prod(jnp.asarray(s))) for s in (conv, rec))
    return n * jnp.dtype(dtype).itemsize
