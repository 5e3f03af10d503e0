"""What a `ModelRunner` is built with, resolved from the engine config and the loaded model:
the runner type, the KV cache's dtype and number of blocks, a step's token budget, and where
compiled programs are kept.

Two start-ups build runners by these rules: the target model's (jaxllm/engine/startup.py) and
the draft model's (jaxllm/spec_decode/draft_model.py). The rules live here, below both, so
that each imports them and neither imports the other (tests/test_layering.py forbids import
circles), and so each rule is written once.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxllm.config import ConfigError
from jaxllm.engine.hybrid import state_cache_bytes
from jaxllm.engine_config import CacheConfig, EngineConfig, ModelOptions, SchedulerConfig
from jaxllm.layers.attention import native_cpu_attention
from jaxllm.models.bert_spec import ENCODER_ARCHITECTURES
from jaxllm.models.registry import ENCODER_CLASSIFIERS, SEQUENCE_CLASSIFIERS

logger = logging.getLogger("jaxllm")

_KV_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32,
              "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn,
              "fp8_e5m2": jnp.float8_e5m2}
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def model_architectures(model_path: str, hf_overrides: Optional[dict] = None) -> list[str]:
    """The `architectures` of a model folder's config.json, or --hf-overrides' ([] for
    anything else)."""
    if (hf_overrides or {}).get("architectures"):
        return list(hf_overrides["architectures"])
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return list(json.load(f).get("architectures") or [])
    except (OSError, ValueError):
        return []


def is_sequence_classifier(model_path: str, hf_overrides: Optional[dict] = None) -> bool:
    return any(a in SEQUENCE_CLASSIFIERS or a in ENCODER_CLASSIFIERS
               for a in model_architectures(model_path, hf_overrides))


def encoder_only(model_path: str, hf_overrides: Optional[dict] = None) -> str | None:
    """The architecture of an encoder-only model folder (BERT, RoBERTa), else None."""
    return next((a for a in model_architectures(model_path, hf_overrides)
                 if a in ENCODER_ARCHITECTURES), None)


def runner_type(options: ModelOptions, model_path: str) -> str:
    """'generate' or 'pooling': --runner, with auto resolved for the model at `model_path`
    (pooling with --convert embed/classify, for a sentence-transformers folder or a
    *ForSequenceClassification checkpoint, as vLLM)."""
    overrides = options.hf_overrides
    classifier = is_sequence_classifier(model_path, overrides)
    if options.runner == "generate" and classifier:
        arch = model_architectures(model_path, overrides)[0]
        raise ConfigError(f"--runner generate: {arch} is a "
                          f"classification model (a score head, no LM head); it runs on "
                          f"--runner pooling (classify, score, rerank)")
    encoder = encoder_only(model_path, overrides)
    if options.runner == "generate" and encoder:
        raise ConfigError(f"--runner generate: {encoder} is an encoder-only model (no LM "
                          f"head, bidirectional attention); it runs on --runner pooling "
                          f"(embed, classify, score, rerank)")
    if options.runner != "auto":
        return options.runner
    if encoder:
        return "pooling"
    st = os.path.isdir(model_path) and os.path.exists(os.path.join(model_path,
                                                                   "modules.json"))
    auto = options.convert == "auto" and (st or classifier)
    return "pooling" if options.convert in ("embed", "classify") or auto else "generate"


def pooling_convert(options: ModelOptions, model_path: str) -> str:
    """What the pooling runner does with the model: 'embed' or 'classify' (--convert, with
    auto = classify for a *ForSequenceClassification checkpoint, else embed)."""
    if options.convert in ("embed", "classify"):
        return options.convert
    return "classify" if is_sequence_classifier(model_path, options.hf_overrides) else "embed"


def max_num_batched_tokens(scheduler: SchedulerConfig, max_model_len: Optional[int] = None,
                           per_seq: int = 1) -> int:
    """Tokens one step may hold: --max-num-batched-tokens (default 2048), raised to per_seq
    tokens for each of max_num_seqs rows, and, given max_model_len without chunked prefill,
    to a whole prompt (it must fit one step). The draft model gives no max_model_len (it
    chunks a long catch-up itself) and per_seq=2 (a catch-up feeds 1-2 tokens a row)."""
    tokens = scheduler.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    if max_model_len is not None and not scheduler.enable_chunked_prefill:
        tokens = max(tokens, max_model_len)
    return max(tokens, per_seq * scheduler.max_num_seqs)


def executable_cache_dir() -> str | None:
    """Where compiled step programs are kept ($JAXLLM_CACHE_DIR, '' to disable); see
    jaxllm/worker/executable_cache.py."""
    path = os.environ.get("JAXLLM_CACHE_DIR",
                          os.path.join(os.path.expanduser("~"), ".cache", "jaxllm", "xla"))
    return path or None


def kv_cache_dtype(cache: CacheConfig, model_dtype, attention_backend: str) -> Any:
    """'auto' = the model's dtype, except on CPU without the native attention kernel: XLA:CPU
    upcasts a 16-bit cache update to float32 over the whole cache, every step (gigabytes of
    memory and steps orders of magnitude slower at long contexts; docs/performance.md has the
    figures), so that cache is float32. The native kernel writes a float32 or bfloat16 cache in
    place."""
    on_cpu = jax.default_backend() == "cpu"
    dtype = model_dtype if cache.cache_dtype == "auto" else _KV_DTYPES[cache.cache_dtype]
    if not on_cpu or native_cpu_attention(attention_backend, dtype):
        return dtype
    if cache.cache_dtype == "auto":
        return jnp.float32
    if jnp.dtype(dtype).itemsize < 4:
        logger.warning("--kv-cache-dtype %s on CPU without the native attention kernel: XLA:CPU "
                       "converts the whole cache to float32 on every step (slow, and "
                       "memory-hungry); 'auto' uses float32 here", cache.cache_dtype)
    return dtype


def num_kv_blocks(config: EngineConfig, mc, dtype, layers: Optional[int] = None,
                  device=None) -> int:
    """Blocks that fit the KV budget (config.cache's, for the scheduler's max_num_seqs on
    tensor-parallel devices); fails early when one max_model_len sequence cannot fit.
    A pipeline stage sizes its `layers` on its own devices (`device`, the first of them): a
    budget given as a total (CPU, --kv-cache-memory-bytes) is shared in proportion to layers,
    an accelerator's free memory is the stage's own."""
    cache, block_size = config.cache, config.cache.block_size
    per_block = block_size * jnp.dtype(dtype).itemsize * (
        mc.kv_values_all_layers if layers is None else layers * mc.kv_values_per_token)
    layers = mc.num_kv_layers if layers is None else layers
    if cache.num_gpu_blocks_override is not None:
        num, source = cache.num_gpu_blocks_override, "--num-gpu-blocks-override"
    else:
        if cache.kv_cache_memory_bytes is not None:
            budget, source = cache.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
        elif jax.default_backend() == "cpu":
            budget, source = cpu_kv_cache_bytes(), "JAXLLM_CPU_KVCACHE_SPACE"
        else:
            budget = _device_kv_budget(cache.gpu_memory_utilization,
                                       config.parallel.tensor_parallel_size, device)
            source = "--gpu-memory-utilization"
        if source != "--gpu-memory-utilization":  # a total: each stage's share
            budget = budget * layers // mc.num_kv_layers
        # A hybrid model's linear-attention state (fixed: one slot per sequence) comes first.
        budget -= state_cache_bytes(mc, config.scheduler.max_num_seqs, dtype)
        # More blocks than max_num_seqs full-length sequences can hold would only feed the
        # prefix cache; cap there so small models do not allocate the whole budget.
        cap = config.scheduler.max_num_seqs * math.ceil(mc.max_model_len / block_size)
        num = min(int(budget // per_block), cap)
    need = math.ceil(mc.max_model_len / block_size)
    if num < need:
        raise ConfigError(
            f"The KV cache holds {num} blocks of {block_size} tokens ({num * per_block / 2**30:.2f}"
            f" GiB, set by {source}) = {num * block_size} tokens, but one sequence of "
            f"max_model_len={mc.max_model_len} needs {need} blocks ({need * per_block / 2**30:.2f} "
            f"GiB). Lower --max-model-len (at most {num * block_size} fits), or give the cache "
            f"more memory (--gpu-memory-utilization, --kv-cache-memory-bytes, "
            f"JAXLLM_CPU_KVCACHE_SPACE on CPU, --num-gpu-blocks-override), or use "
            f"--kv-cache-dtype fp8.")
    return num


def cpu_kv_cache_bytes() -> int:
    """The CPU KV-cache budget: $JAXLLM_CPU_KVCACHE_SPACE GiB, default 4 (as vLLM's CPU
    backend)."""
    return int(float(os.environ.get("JAXLLM_CPU_KVCACHE_SPACE", "4")) * 1024**3)


def _device_kv_budget(gpu_memory_utilization: float, tensor_parallel_size: int,
                      device=None) -> int:
    """Accelerator memory left for the KV cache after weights, per device, times devices used."""
    stats = (device or jax.devices()[0]).memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise ConfigError("cannot read device memory; pass --num-gpu-blocks-override or "
                          "--kv-cache-memory-bytes")
    free = limit * gpu_memory_utilization - stats.get("bytes_in_use", 0)
    return int(max(free, 0) * 0.9) * tensor_parallel_size  # 10% for activations
