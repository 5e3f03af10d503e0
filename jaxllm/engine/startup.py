"""Start-up: resolve the model, build the mesh, load weights, size the KV cache, compile.

Kept apart from the engine loop so the loop file reads as the data path only. It builds the
runner of either kind here, one device mesh's `ModelRunner` or a pipeline's `PipelineRunner`
(the engine drives a pipeline with its step policy: jaxllm/engine/engine.py), and takes
its sizing rules from jaxllm/engine/runner_settings.py, shared with the draft model's start-up.
Nothing here imports the engine: the engine imports this.
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

from jaxllm.config import ConfigError
from jaxllm.engine.kv_calibration import calculate_kv_scales
from jaxllm.models.kv_scales import CALCULATED
from jaxllm.engine.runner_settings import (encoder_only, executable_cache_dir, kv_cache_dtype,
                                           max_num_batched_tokens, num_kv_blocks,
                                           pooling_convert, runner_type)
from jaxllm.engine_config import EngineConfig, ParallelConfig
from jaxllm.spec_decode.config import MTP_METHODS
from jaxllm.loader.classifier_head import ClassifierHead, read_classifier_head
from jaxllm.loader.default_model import resolve_model
from jaxllm.loader.loader import describe_weights, load_model, model_path, weight_bytes
from jaxllm.loader.mtp_weights import mtp_source
from jaxllm.engine.hybrid import hybrid_engine_config, state_cache_bytes
from jaxllm.models.pipeline_stage import split_stage, stage_cuts
from jaxllm.parallel import distributed
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.pipeline import is_local, stage_layer_ranges, stage_meshes
from jaxllm.parallel.step_channel import StepFollower, StepLeader
from jaxllm.tokenizer import get_tokenizer, load_generation_config
from jaxllm.worker.host_memory import keep_freed_memory
from jaxllm.worker.model_runner import ModelRunner
from jaxllm.worker.pipeline_runner import PipelineRunner
from jaxllm.worker.pooler import PoolerConfig, read_pooler_config

logger = logging.getLogger("jaxllm")


@dataclass
class EngineParts:
    model_config: Any
    tokenizer: Any
    eos_token_ids: frozenset
    generation_defaults: dict
    runner: ModelRunner
    num_blocks: int
    startup_times: dict
    pooler_config: Optional[PoolerConfig] = None  # the pooling runner's (--runner resolved)
    step_follower: Any = None  # a multi-host follower's end of the step channel
    step_leader: Any = None  # multi-host rank 0's end (its runner sends every call down it)
    config: Optional[EngineConfig] = None  # the config as started: --model resolved to a path
    weight_bytes: Optional[dict] = None  # resident on the first device, by dtype (start-up's)
    classifier: Optional[ClassifierHead] = None  # --convert classify's head (host float32)


def process_age() -> float:
    """Wall time since this process started (Linux /proc): what start-up figures measured
    from the command line include (the interpreter, imports) and the engine's own clocks
    miss."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def join_hosts(parallel: ParallelConfig) -> distributed.Topology:
    """Join the other hosts (with --nnodes, or as detected), before any device is touched;
    one mesh spans every host's devices."""
    topo = distributed.initialize(parallel.nnodes, parallel.node_rank, parallel.master_addr,
                                  parallel.master_port,
                                  cross_host_transfers=parallel.pipeline_parallel_size > 1)
    if topo.multi_host and parallel.data_parallel_size > 1:
        raise ConfigError("--data-parallel-size: this process joined several hosts with "
                          "jax.distributed (--nnodes, or a launcher jax detects: SLURM, Open "
                          "MPI, a multi-host TPU slice), and a replica spanning hosts is not "
                          "implemented; across hosts give each node its own replicas with "
                          "--data-parallel-size-local (docs/multi-host.md)")
    if topo.multi_host and parallel.pipeline_parallel_size == 1 \
            and parallel.tensor_parallel_size != jax.device_count():
        raise ConfigError(f"--tensor-parallel-size={parallel.tensor_parallel_size}: on "
                          f"{topo.num_processes} hosts the mesh must span all "
                          f"{jax.device_count()} devices (every host runs every step)")
    return topo


def build_engine_parts(config: EngineConfig, headless: bool = False,
                       devices: Optional[list] = None) -> EngineParts:
    """headless: a follower host's parts (its runner replays rank 0's steps: jaxllm/deploy/
    follower.py). devices: the mesh's (a data-parallel replica's share; default all)."""
    times = {}
    logger.debug("Engine start-up begins %.2f s after the process (interpreter, imports)",
                 process_age())
    topo = join_hosts(config.parallel)
    if topo.rank > 0 and not headless:
        raise ConfigError(f"--node-rank: this process is rank {topo.rank} of "
                          f"{topo.num_processes}; only rank 0 runs the engine, the others run "
                          f"`jaxllm serve --headless` with the same flags")
    # Executables serialized by one process of a group are not loaded by another here.
    executable_dir = None if topo.multi_host else executable_cache_dir()
    path = resolve_model(config.load.model)  # once: everything below reads this path
    config = dataclasses.replace(config, load=dataclasses.replace(config.load, model=path))
    load, options, sched = config.load, config.model, config.scheduler
    # A local folder's runner is settled before loading (a refusal costs no load); a hub
    # name's once the download brought its config.json.
    local = os.path.isdir(path)
    if local:
        kind, pooler_config, classifier = pooling_setup(options, load, path)
    t = time.perf_counter()
    pp, tp = config.parallel.pipeline_parallel_size, config.parallel.tensor_parallel_size
    # A pipeline loads onto the sub-mesh of this host's first stage, then hands each stage its
    # layers (build_pipeline_runner; a host keeps only its own stages' weights).
    meshes = stage_meshes(pp, tp, devices) if pp > 1 else None
    mesh = next(m for m in meshes if is_local(m)) if meshes else make_mesh(tp, devices=devices)
    model, mc = load_model(load, options, mesh)
    config = hybrid_engine_config(config, mc)
    times["load"] = time.perf_counter() - t
    if not local:
        kind, pooler_config, classifier = pooling_setup(options, load, model_path(load))
    sizes = weight_bytes(model)
    logger.info("Weights: %s%s", describe_weights(sizes),
                "" if mc.quant is None else f" ({mc.quant.describe()})")
    if jax.default_backend() == "cpu":  # after loading: its staging buffers are unmapped
        keep_freed_memory()
    t = time.perf_counter()
    tokenizer = None if load.skip_tokenizer_init else get_tokenizer(load)
    gen = load_generation_config(path, load.generation_config, revision=load.revision,
                                 download_dir=load.download_dir)
    eos = set(gen.get("eos_token_id") or mc.eos_token_ids)
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = {tokenizer.eos_token_id}
    times["tokenizer"] = time.perf_counter() - t
    dtype = kv_cache_dtype(config.cache, mc.jnp_dtype, model.attention_backend)
    if mc.kv_scales == CALCULATED:  # before the runner lays the weights out for its backend
        calculate_kv_scales(model, dtype, tokenizer)
    why = model.backend.batch_variance(mc, dtype)
    if why is not None and options.batch_invariant:
        raise ConfigError(f"--batch-invariant: outputs would depend on the batch here: {why}")
    logger.info("Batch invariant: %s", "yes" if why is None else f"no ({why})")
    if kind == "pooling" and mc.linear_layers:
        raise ConfigError(f"--runner pooling: {mc.architecture} (linear-attention state) is "
                          "not implemented in the pooling runner")
    if kind == "pooling" and options.enable_expert_load_metrics:
        raise ConfigError("--enable-expert-load-metrics: the pooling runner does not count "
                          "expert loads (only the generate runner's steps do)")
    max_tokens = max_num_batched_tokens(sched, mc.max_model_len)
    block_size = config.cache.block_size
    t = time.perf_counter()
    runner_args = dict(kv_cache_dtype=dtype, block_size=block_size,
                       max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=max_tokens,
                       max_logprobs=sched.max_logprobs, enforce_eager=sched.enforce_eager,
                       num_scheduler_steps=sched.num_scheduler_steps,
                       num_speculative_tokens=_num_speculative_tokens(config, kind))
    for flag, on in (("--logits-processors", config.logits_processors),
                     ("--enable-prompt-embeds", mc.prompt_embeds)):
        if on and kind == "pooling":
            raise ConfigError(f"{flag}: this model runs with the pooling runner (it is not "
                              "implemented there)")
    if config.logits_processors:
        runner_args["logits_processors"] = tuple(
            cls(config, mesh.devices.flat[0], False) for cls in config.logits_processors)
    if _mtp(config, mc, topo.multi_host):  # the MTP drafter reads the target's hidden states
        runner_args["keep_hidden"] = True
    if meshes is not None and mc.encoder is not None:
        raise ConfigError(f"--pipeline-parallel-size={pp}: {mc.architecture} (encoder-only) "
                          f"is not split into stages; run it on one device (give "
                          f"--data-parallel-size for replicas)")
    if meshes is not None and pooler_config is not None:
        raise ConfigError(f"--pipeline-parallel-size={pp}: the pooling runner (--runner auto "
                          f"chose it for this sentence-transformers folder) is not implemented "
                          f"with a pipeline; give --runner generate or drop the flag")
    if meshes is not None:
        runner, num_blocks = build_pipeline_runner(config, model, mc, meshes, runner_args)
    else:
        # Pooling runs each prompt with a scratch cache of its own (jaxllm/worker/pooler.py):
        # the step's cache only needs the minimum, and its programs no warm-up.
        num_blocks = (math.ceil(mc.max_model_len / block_size) if pooler_config
                      else num_kv_blocks(config, mc, dtype))
        if runner_args.get("keep_hidden") and config.cache.num_gpu_blocks_override is None:
            # The MTP layer's cache has as many blocks, of one layer: the budget buys both.
            num_blocks = num_blocks * mc.num_kv_layers // (mc.num_kv_layers + 1)
        runner = ModelRunner(model, mc, mesh, num_blocks=num_blocks,
                             executable_dir=executable_dir, **runner_args)
    times["kv_cache"] = time.perf_counter() - t
    follower = leader = None
    if topo.multi_host:
        t = time.perf_counter()
        follower, leader = _connect_hosts(topo, runner,
                                          config.parallel.distributed_timeout_seconds)
        times["hosts"] = time.perf_counter() - t
    logger.info("KV cache: %d blocks x %d tokens (%s, %d bytes per token), max_model_len %d",
                num_blocks, block_size, jnp.dtype(dtype).name,
                mc.kv_values_all_layers * jnp.dtype(dtype).itemsize,
                mc.max_model_len)
    if mc.linear_layers:
        logger.info("Linear-attention state: %d slots, %.2f MiB", sched.max_num_seqs,
                    state_cache_bytes(mc, sched.max_num_seqs, dtype) / 2**20)
    t = time.perf_counter()
    if pooler_config is None:
        runner.warmup(background=not headless)
    times["compile"] = time.perf_counter() - t
    defaults = {k: v for k, v in gen.items() if k != "eos_token_id"}
    return EngineParts(mc, tokenizer, frozenset(eos), defaults, runner, num_blocks, times,
                       pooler_config, follower, leader, config, sizes, classifier)


def pooling_setup(options, load, path: str) -> tuple[str, Optional[PoolerConfig],
                                                     Optional[ClassifierHead]]:
    """(runner type, the pooling runner's config, --convert classify's head) for the model
    folder at `path`."""
    kind = runner_type(options, path)
    if kind != "pooling":
        return kind, None, None
    # vLLM pools an encoder's first token ([CLS], <s>) unless the folder says otherwise.
    pooler_config = read_pooler_config(path, options.pooler_config,
                                       "CLS" if encoder_only(path, options.hf_overrides)
                                       else "LAST")
    classifier = (read_classifier_head(path, load.load_format, options.hf_overrides,
                                       load.tokenizer)
                  if pooling_convert(options, path) == "classify" else None)
    if classifier is not None and pooler_config.pooling_type == "ALL":
        raise ConfigError("--pooler-config: pooling_type ALL gives no single state for the "
                          "classification head (--convert classify); use LAST, MEAN or CLS")
    return kind, pooler_config, classifier


def build_pipeline_runner(config: EngineConfig, model, mc, meshes: list,
                          runner_args: dict) -> tuple[PipelineRunner, int]:
    """The stages of the loaded `model` on `meshes`, their runner, and the KV blocks: each
    stage sizes its own layers' cache on its devices, and the least of them is every stage's
    (a block holds a token's keys and values in every layer)."""
    ranges = stage_layer_ranges(mc.num_layers, len(meshes))
    stages = [split_stage(model, a, b, mesh) for (a, b), mesh in zip(ranges, meshes)]
    dtype = runner_args["kv_cache_dtype"]
    num_blocks = min(num_kv_blocks(config, mc, dtype, layers=b - a,
                                   device=mesh.devices.flat[0])
                     for (a, b), mesh in zip(ranges, meshes))
    runner = PipelineRunner(stages, meshes, mc, num_blocks=num_blocks,
                            stage_cuts=[stage_cuts(model, a, b) for a, b in ranges],
                            **runner_args)
    for (a, b), r in zip(ranges, runner.memory_report()):
        logger.info("Pipeline stage %d: layers [%d, %d) on host %d, devices %s; per device "
                    "%.1f MiB of weights, %.1f MiB of KV cache", r["stage"], a, b, r["host"],
                    r["devices"],
                    r["weight_bytes_per_device"] / 2**20, r["kv_bytes_per_device"] / 2**20)
    return runner, num_blocks


def _num_speculative_tokens(config: EngineConfig, kind: str) -> int:
    spec = config.speculative
    if spec is None:
        return 0
    if kind == "pooling":
        raise ConfigError("--speculative-config: the pooling runner generates no tokens to "
                          "speculate on; drop the flag or use --runner generate")
    return spec.num_speculative_tokens


def _mtp(config: EngineConfig, mc, multi_host: bool) -> bool:
    """Whether the target's MTP layer drafts (--speculative-config method deepseek_mtp or
    mtp); refused here, before any program compiles, where it cannot (pipeline stages are
    refused with any speculation: engine_config.check_pipeline)."""
    spec = config.speculative
    if spec is None or spec.method not in MTP_METHODS:
        return False
    if multi_host:  # its programs run on rank 0 only, not sent to the other hosts
        raise ConfigError(f"--speculative-config: method {spec.method!r} is not supported "
                          "with --nnodes > 1")
    mtp_source(config.load, mc, spec.method)
    return True


def _connect_hosts(topo: distributed.Topology, runner: ModelRunner, timeout_seconds: int
                   ) -> tuple[Optional[StepFollower], Optional[StepLeader]]:
    """Open the step channel before warm-up (whose length differs between hosts): rank 0's
    runner sends every call from now on. (follower's end, None) on a follower, (None,
    leader's end) on rank 0."""
    if not topo.is_leader:
        return StepFollower(runner.weights(), runner.startup_arrays()), None
    leader = StepLeader(topo.num_processes - 1, topo.leader_host, runner.weights(),
                        runner.startup_arrays(), timeout_seconds)
    runner.lead_hosts(leader)
    atexit.register(leader.close)
    return None, leader
