"""Start-up: resolve the model, build the mesh, load weights, size the KV cache, compile.

Kept apart from the engine loop so the loop file reads as the data path only.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxllm.config import ConfigError, EngineArgs, cpu_kv_cache_bytes
from jaxllm.layers.attention import native_cpu_attention
from jaxllm.loader.default_model import resolve_model
from jaxllm.loader.loader import load_model
from jaxllm.parallel import distributed
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.pipeline import is_local, stage_meshes
from jaxllm.parallel.step_channel import StepFollower, StepLeader
from jaxllm.tokenizer import get_tokenizer, load_generation_config
from jaxllm.worker.host_memory import keep_freed_memory
from jaxllm.worker.model_runner import ModelRunner
from jaxllm.worker.pooler import PoolerConfig, read_pooler_config

logger = logging.getLogger("jaxllm")

_KV_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32,
              "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn,
              "fp8_e5m2": jnp.float8_e5m2}
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class EngineParts:
    model_config: Any
    tokenizer: Any
    eos_token_ids: frozenset
    generation_defaults: dict
    runner: ModelRunner
    num_blocks: int
    startup_times: dict
    runner_type: str = "generate"  # or "pooling" (--runner resolved)
    pooler_config: Optional[PoolerConfig] = None
    step_follower: Any = None  # a multi-host follower's end of the step channel


def process_age() -> float:
    """Wall time since this process started (Linux /proc): what start-up figures measured
    from the command line include (the interpreter, imports) and the engine's own clocks
    miss."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def executable_cache_dir() -> str | None:
    """Where compiled step programs are kept ($JAXLLM_CACHE_DIR, '' to disable); see
    jaxllm/worker/executable_cache.py."""
    path = os.environ.get("JAXLLM_CACHE_DIR",
                          os.path.join(os.path.expanduser("~"), ".cache", "jaxllm", "xla"))
    return path or None


def kv_cache_dtype(args: EngineArgs, model_dtype, attention_backend: str) -> Any:
    """'auto' = the model's dtype, except on CPU without the native attention kernel: XLA:CPU
    upcasts a 16-bit cache update to float32 over the whole cache (measured: +7 GB and ~100x
    slower steps for SmolLM2 at 8k context), so that cache is float32. The native kernel
    writes a float32 or bfloat16 cache in place."""
    on_cpu = jax.default_backend() == "cpu"
    dtype = model_dtype if args.kv_cache_dtype == "auto" else _KV_DTYPES[args.kv_cache_dtype]
    if not on_cpu or native_cpu_attention(attention_backend, dtype):
        return dtype
    if args.kv_cache_dtype == "auto":
        return jnp.float32
    if jnp.dtype(dtype).itemsize < 4:
        logger.warning("--kv-cache-dtype %s on CPU without the native attention kernel: XLA:CPU "
                       "converts the whole cache to float32 on every step (slow, and "
                       "memory-hungry); 'auto' uses float32 here", args.kv_cache_dtype)
    return dtype


def num_kv_blocks(args: EngineArgs, mc, dtype, layers: Optional[int] = None,
                  device=None) -> int:
    """Blocks that fit the KV budget; fails early when one max_model_len sequence cannot fit.
    A pipeline stage sizes its `layers` on its own devices (`device`, the first of them): a
    budget given as a total (CPU, --kv-cache-memory-bytes) is shared in proportion to layers,
    an accelerator's free memory is the stage's own."""
    layers = mc.num_layers if layers is None else layers
    per_block = (2 * layers * mc.num_kv_heads * args.block_size * mc.head_dim
                 * jnp.dtype(dtype).itemsize)
    if args.num_gpu_blocks_override is not None:
        num, source = args.num_gpu_blocks_override, "--num-gpu-blocks-override"
    else:
        if args.kv_cache_memory_bytes is not None:
            budget, source = args.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
        elif jax.default_backend() == "cpu":
            budget, source = cpu_kv_cache_bytes(), "JAXLLM_CPU_KVCACHE_SPACE"
        else:
            budget, source = _device_kv_budget(args, device), "--gpu-memory-utilization"
        if source != "--gpu-memory-utilization":  # a total: each stage's share
            budget = budget * layers // mc.num_layers
        # More blocks than max_num_seqs full-length sequences can hold would only feed the
        # prefix cache; cap there so small models do not allocate the whole budget.
        cap = args.max_num_seqs * math.ceil(mc.max_model_len / args.block_size)
        num = min(int(budget // per_block), cap)
    need = math.ceil(mc.max_model_len / args.block_size)
    if num < need:
        raise ConfigError(
            f"The KV cache holds {num} blocks of {args.block_size} tokens ({num * per_block / 2**30:.2f}"
            f" GiB, set by {source}) = {num * args.block_size} tokens, but one sequence of "
            f"max_model_len={mc.max_model_len} needs {need} blocks ({need * per_block / 2**30:.2f} "
            f"GiB). Lower --max-model-len (at most {num * args.block_size} fits), or give the cache "
            f"more memory (--gpu-memory-utilization, --kv-cache-memory-bytes, "
            f"JAXLLM_CPU_KVCACHE_SPACE on CPU, --num-gpu-blocks-override), or use "
            f"--kv-cache-dtype fp8.")
    return num


def _device_kv_budget(args: EngineArgs, device=None) -> int:
    """Accelerator memory left for the KV cache after weights, per device, times devices used."""
    stats = (device or jax.devices()[0]).memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise ConfigError("cannot read device memory; pass --num-gpu-blocks-override or "
                          "--kv-cache-memory-bytes")
    free = limit * args.gpu_memory_utilization - stats.get("bytes_in_use", 0)
    return int(max(free, 0) * 0.9) * args.tensor_parallel_size  # 10% for activations


def join_hosts(args: EngineArgs) -> distributed.Topology:
    """Join the other hosts (with --nnodes, or as detected), before any device is touched;
    one mesh spans every host's devices."""
    topo = distributed.initialize(args.nnodes, args.node_rank, args.master_addr,
                                  args.master_port,
                                  cross_host_transfers=args.pipeline_parallel_size > 1)
    if topo.multi_host and args.data_parallel_size > 1:
        raise ConfigError("--data-parallel-size: this process joined several hosts with "
                          "jax.distributed (--nnodes, or a launcher jax detects: SLURM, Open "
                          "MPI, a multi-host TPU slice), and a replica spanning hosts is not "
                          "implemented; across hosts give each node its own replicas with "
                          "--data-parallel-size-local (docs/multi-host.md)")
    if topo.multi_host and args.pipeline_parallel_size == 1 \
            and args.tensor_parallel_size != jax.device_count():
        raise ConfigError(f"--tensor-parallel-size={args.tensor_parallel_size}: on "
                          f"{topo.num_processes} hosts the mesh must span all "
                          f"{jax.device_count()} devices (every host runs every step)")
    return topo


def build_engine_parts(args: EngineArgs, headless: bool = False,
                       devices: Optional[list] = None) -> EngineParts:
    """headless: a follower host's parts (its runner replays rank 0's steps: jaxllm/engine/
    headless.py). devices: the mesh's (a data-parallel replica's share; default all)."""
    times = {}
    logger.debug("Engine start-up begins %.2f s after the process (interpreter, imports)",
                 process_age())
    topo = join_hosts(args)
    if topo.rank > 0 and not headless:
        raise ConfigError(f"--node-rank: this process is rank {topo.rank} of "
                          f"{topo.num_processes}; only rank 0 runs the engine, the others run "
                          f"`jaxllm serve --headless` with the same flags")
    # Executables serialized by one process of a group are not loaded by another here.
    executable_dir = None if topo.multi_host else executable_cache_dir()
    path = resolve_model(args.model)
    args = dataclasses.replace(args, model=path)
    t = time.perf_counter()
    pp = args.pipeline_parallel_size
    # A pipeline loads onto the sub-mesh of this host's first stage, then hands each stage its
    # layers (pp_engine; a host keeps only its own stages' weights).
    meshes = stage_meshes(pp, args.tensor_parallel_size, devices) if pp > 1 else None
    mesh = next(m for m in meshes if is_local(m)) if meshes else \
        make_mesh(args.tensor_parallel_size, devices=devices)
    model, mc = load_model(args, mesh)
    times["load"] = time.perf_counter() - t
    if jax.default_backend() == "cpu":  # after loading: its staging buffers are unmapped
        keep_freed_memory()
    t = time.perf_counter()
    tokenizer = None if args.skip_tokenizer_init else get_tokenizer(args)
    gen = load_generation_config(path, args.generation_config, revision=args.revision,
                                 download_dir=args.download_dir)
    eos = set(gen.get("eos_token_id") or mc.eos_token_ids)
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = {tokenizer.eos_token_id}
    times["tokenizer"] = time.perf_counter() - t
    dtype = kv_cache_dtype(args, mc.jnp_dtype, model.attention_backend)
    why = model.backend.batch_variance(mc, dtype)
    if why is not None and args.batch_invariant:
        raise ConfigError(f"--batch-invariant: outputs would depend on the batch here: {why}")
    logger.info("Batch invariant: %s", "yes" if why is None else f"no ({why})")
    runner_type = args.runner_type(path)
    if runner_type == "pooling" and args.enable_expert_load_metrics:
        raise ConfigError("--enable-expert-load-metrics: the pooling runner does not count "
                          "expert loads (only the generate runner's steps do)")
    pooler_config = (read_pooler_config(path, args.pooler_config) if runner_type == "pooling"
                     else None)
    max_tokens = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    if not args.chunked_prefill:
        max_tokens = max(max_tokens, mc.max_model_len)  # a whole prompt must fit one step
    if max_tokens < args.max_num_seqs:
        max_tokens = args.max_num_seqs
    t = time.perf_counter()
    runner_args = dict(kv_cache_dtype=dtype, block_size=args.block_size,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max_tokens,
                       max_logprobs=args.max_logprobs, enforce_eager=args.enforce_eager,
                       num_scheduler_steps=args.num_scheduler_steps,
                       num_speculative_tokens=_num_speculative_tokens(args, runner_type))
    if meshes is not None and pooler_config is not None:
        raise ConfigError(f"--pipeline-parallel-size={pp}: the pooling runner (--runner auto "
                          f"chose it for this sentence-transformers folder) is not implemented "
                          f"with a pipeline; give --runner generate or drop the flag")
    if meshes is not None:
        from jaxllm.engine.pp_engine import build_pipeline_runner
        runner, num_blocks = build_pipeline_runner(args, model, mc, meshes, runner_args)
    else:
        # Pooling runs each prompt with a scratch cache of its own (jaxllm/worker/pooler.py):
        # the step's cache only needs the minimum, and its programs no warm-up.
        num_blocks = (math.ceil(mc.max_model_len / args.block_size) if pooler_config
                      else num_kv_blocks(args, mc, dtype))
        runner = ModelRunner(model, mc, mesh, num_blocks=num_blocks,
                             executable_dir=executable_dir, **runner_args)
    times["kv_cache"] = time.perf_counter() - t
    follower = None
    if topo.multi_host:
        t = time.perf_counter()
        follower = _connect_hosts(topo, runner, args)
        times["hosts"] = time.perf_counter() - t
    logger.info("KV cache: %d blocks x %d tokens (%s), max_model_len %d", num_blocks,
                args.block_size, jnp.dtype(dtype).name, mc.max_model_len)
    t = time.perf_counter()
    if pooler_config is None:
        runner.warmup(background=not headless)
    times["compile"] = time.perf_counter() - t
    defaults = {k: v for k, v in gen.items() if k != "eos_token_id"}
    return EngineParts(mc, tokenizer, frozenset(eos), defaults, runner, num_blocks, times,
                       runner_type, pooler_config, follower)


def _num_speculative_tokens(args: EngineArgs, runner_type: str) -> int:
    spec = args.speculative_config
    if spec is None:
        return 0
    if runner_type == "pooling":
        raise ConfigError("--speculative-config: the pooling runner generates no tokens to "
                          "speculate on; drop the flag or use --runner generate")
    return spec.num_speculative_tokens


def _connect_hosts(topo: distributed.Topology, runner: ModelRunner, args: EngineArgs):
    """Open the step channel before warm-up (whose length differs between hosts): rank 0's
    runner sends every call from now on; a follower gets its end back."""
    if not topo.is_leader:
        return StepFollower(runner.weights(), runner.startup_arrays())
    leader = StepLeader(topo.num_processes - 1, topo.leader_host, runner.weights(),
                        runner.startup_arrays(), args.distributed_timeout_seconds)
    runner.compile_manager.step_leader = leader
    atexit.register(leader.close)
    return None
