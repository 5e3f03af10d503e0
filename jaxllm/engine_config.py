"""The engine's configuration, resolved and typed: what `EngineArgs.create_engine_config()`
builds from the user's flags (jaxllm/config.py), as vLLM's builds its `VllmConfig`.

`EngineArgs` is the user's surface: every flag as given, None where a default depends on
other flags. Nothing below the engine reads it. The loader, the model config, start-up and the
draft model each take the frozen part they need, whose flag-level defaults are resolved here,
once (prefix caching and chunked prefill on unless turned off, the replicas on this node).
What needs the model too (its path, the runner type, the KV cache's dtype and blocks, a step's
token budget) is resolved at start-up: jaxllm/engine/startup.py and
jaxllm/engine/runner_settings.py.

The checks that the parallel flags combine into a layout the engine implements live here as
well; `EngineArgs.validate()` runs them, so a bad combination fails when the flags are given.

Host types only (no JAX), importable from every layer. This module sits below `EngineArgs` and
never imports it: `engine_config_from` and the checks read the arguments by field name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from jaxllm.json_object import json_object
from jaxllm.logits_processor import load_logits_processors
from jaxllm.spec_decode.config import SpeculativeConfig


class ConfigError(ValueError):
    """A bad engine argument; the message names the flag."""


def flag_name(name: str) -> str:
    """The command-line flag of an engine argument, without its dashes."""
    return name.replace("_", "-")


@dataclass(frozen=True)
class LoadConfig:
    """Where the weights, tokenizer and generation config come from. `model` is the user's
    --model until start-up resolves it (the default model's name becomes its file)."""
    model: str
    tokenizer: Optional[str]
    tokenizer_mode: str
    skip_tokenizer_init: bool
    revision: Optional[str]
    tokenizer_revision: Optional[str]
    download_dir: Optional[str]
    load_format: str
    use_tqdm_on_load: bool
    generation_config: str


# --quantization's methods: a checkpoint's (detected from its config.json) and the online ones
# (jaxllm/models/quant_config.py).
QUANTIZATION_METHODS = ("compressed-tensors", "gptq", "awq", "gguf", "fp8", "mxfp4")


@dataclass(frozen=True)
class ModelOptions:
    """How the model is built and run: what `ModelConfig.from_hf` applies to a checkpoint's
    config, and the model-wide choices of start-up. The defaults are the neutral options
    (nothing overridden), EngineArgs' own defaults."""
    dtype: str = "auto"
    max_model_len: Optional[int] = None  # the user's; the model's own when None
    hf_overrides: Optional[dict] = None
    rope_scaling: Optional[dict] = None
    rope_theta: Optional[float] = None
    disable_sliding_window: bool = False
    enable_expert_parallel: bool = False
    enable_expert_load_metrics: bool = False
    seed: int = 0
    attention_backend: str = "auto"
    batch_invariant: bool = False
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: Optional[dict] = None
    quantization: Optional[str] = None  # --quantization (the checkpoint's own when None)
    lora: Optional["LoRAConfig"] = None  # --enable-lora: the layers hold adapter slots
    limit_mm_per_prompt: Optional[dict] = None  # --limit-mm-per-prompt: {"image": most images}
    # --kv-cache-dtype (a float8 cache gives the attention layers per-layer k/v scales) and
    # --calculate-kv-scales (computed at start-up; jaxllm/engine/kv_calibration.py).
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    enable_prompt_embeds: bool = False  # steps take given embeddings at a prompt's tokens


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: its block size, dtype (the user's --kv-cache-dtype; the array dtype
    is resolved at start-up for the model and backend) and memory budget, and prefix caching."""
    block_size: int
    cache_dtype: str
    gpu_memory_utilization: float
    kv_cache_memory_bytes: Optional[int]
    num_gpu_blocks_override: Optional[int]
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    kv_offloading_size: Optional[float]  # GiB of host memory for evicted blocks (None: off)


@dataclass(frozen=True)
class SchedulerConfig:
    """A step's limits and the scheduling choices. max_num_batched_tokens is the user's; the
    budget a step holds is resolved at start-up (runner_settings.max_num_batched_tokens)."""
    max_num_seqs: int
    max_num_batched_tokens: Optional[int]
    enable_chunked_prefill: bool
    policy: str
    async_scheduling: bool
    num_scheduler_steps: int
    enforce_eager: bool  # --enforce-eager, or -O0
    max_logprobs: int


@dataclass(frozen=True)
class ParallelConfig:
    """The device layout: tensor, pipeline and data parallelism, and the hosts it spans."""
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    data_parallel_size_local: int  # replicas on this node (default: all of them)
    data_parallel_start_rank: int
    data_parallel_address: str
    data_parallel_rpc_port: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    headless: bool
    distributed_timeout_seconds: int


@dataclass(frozen=True)
class LoRAConfig:
    """--enable-lora: adapter slots on the device and adapters read on the host."""
    max_loras: int       # device slots: adapters one step can run
    max_lora_rank: int
    max_cpu_loras: int   # adapters kept read on the host (>= max_loras)
    lora_dtype: str      # 'auto' = the model's


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is started with, by consumer (vLLM's VllmConfig)."""
    load: LoadConfig
    model: ModelOptions
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    speculative: Optional[SpeculativeConfig]
    structured_outputs: Optional[dict]  # --structured-outputs-config
    disable_log_stats: bool
    lora: Optional[LoRAConfig] = None  # --enable-lora
    enable_sleep_mode: bool = False
    logits_processors: tuple = ()  # --logits-processors: the classes (jaxllm/logits_processor.py)


def engine_config_from(args: Any) -> EngineConfig:
    """The EngineConfig of the engine arguments `args` (an EngineArgs). A part's field takes
    the argument of the same name, except the few named here: renamed, or resolved."""
    def part(cls, **resolved):
        return cls(**{f.name: resolved[f.name] if f.name in resolved else getattr(args, f.name)
                      for f in dataclasses.fields(cls)})

    def default_on(flag: Optional[bool]) -> bool:
        return True if flag is None else flag

    lora = (LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras or args.max_loras,
                       args.lora_dtype) if args.enable_lora else None)
    return EngineConfig(
        load=part(LoadConfig),
        model=part(ModelOptions, lora=lora),
        cache=part(CacheConfig, cache_dtype=args.kv_cache_dtype,
                   enable_prefix_caching=default_on(args.enable_prefix_caching)),
        scheduler=part(SchedulerConfig, policy=args.scheduling_policy,
                       enable_chunked_prefill=default_on(args.enable_chunked_prefill)),
        parallel=part(ParallelConfig, data_parallel_size_local=args.data_parallel_local),
        speculative=args.speculative_config,
        structured_outputs=args.structured_outputs_config,
        disable_log_stats=args.disable_log_stats,
        lora=lora,
        enable_sleep_mode=args.enable_sleep_mode,
        logits_processors=logits_processor_classes(args))


def check_pipeline(args: Any) -> None:
    """What --pipeline-parallel-size does not combine with yet, refused by name."""
    for name, on, why in (
            ("data_parallel_size", args.data_parallel_size > 1, "replicas of a pipeline"),
            ("enable_expert_parallel", args.enable_expert_parallel,
             "experts sharded inside a stage"),
            ("num_scheduler_steps", args.num_scheduler_steps > 1,
             "multi-step programs (the pipeline already keeps the stages busy)"),
            ("speculative_config", args.speculative_config is not None,
             "speculative decoding"),
            ("enable_expert_load_metrics", args.enable_expert_load_metrics,
             "counting expert loads across stages"),
            ("runner", args.runner == "pooling" or args.convert == "embed",
             "the pooling runner")):
        if on:
            raise ConfigError(f"--pipeline-parallel-size={args.pipeline_parallel_size} with "
                              f"--{flag_name(name)}={getattr(args, name)!r}: {why} is not "
                              f"implemented; drop one of the two")


def check_lora(args: Any, bad: Callable[[str, str], None]) -> None:
    """--enable-lora's sizes, and the pooling runner it does not combine with yet. Every layout
    takes it: data-parallel replicas each hold their own slots (jaxllm/deploy/
    data_parallel.py), pipeline stages their own layers' share of them (jaxllm/worker/
    pipeline_runner.py), and with several hosts rank 0's slot writes are replayed on every
    host (ModelRunner.write_lora_slot)."""
    if not args.enable_lora:
        for name, default in (("max_loras", 1), ("max_lora_rank", 16), ("max_cpu_loras", None),
                              ("lora_dtype", "auto")):
            if getattr(args, name) != default:
                bad(name, "needs --enable-lora")
        return
    if args.max_loras < 1:
        bad("max_loras", "must be positive")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        bad("max_cpu_loras", f"must be at least --max-loras ({args.max_loras})")
    if args.runner == "pooling" or args.convert == "embed":
        bad("runner", "with --enable-lora is not implemented yet; drop one of the two")


def logits_processor_classes(args: Any) -> tuple[type, ...]:
    """--logits-processors' classes (ConfigError naming the flag for one that does not load)."""
    try:
        return load_logits_processors(args.logits_processors or ())
    except ValueError as e:
        raise ConfigError(f"--logits-processors: {e}") from None


def check_logits_processors(args: Any, bad: Callable[[str, str], None]) -> None:
    """--logits-processors: the classes load, and the flags they do not combine with. Their
    steps read the logits on the host of one engine (jaxllm/worker/logits_processing.py)."""
    if not args.logits_processors:
        return
    logits_processor_classes(args)
    spec = args.speculative_config is not None
    for name, on, why in (
            ("speculative_config", spec, "speculative decoding (vLLM refuses it too)"),
            ("runner", args.runner == "pooling" or args.convert in ("embed", "classify"),
             "a pooling model (it samples nothing)"),
            ("async_scheduling", args.async_scheduling, "asynchronous scheduling (the "
             "processors see each step's output tokens before the next step's logits)"),
            ("num_scheduler_steps", args.num_scheduler_steps > 1,
             "multi-step programs (they sample on the device)"),
            ("pipeline_parallel_size", args.pipeline_parallel_size > 1, "a pipeline"),
            ("data_parallel_size", args.data_parallel_size > 1, "data-parallel replicas"),
            ("nnodes", args.nnodes > 1, "several hosts")):
        if on:
            bad(name, f"custom logits processors with {why} are not supported; drop one of "
                "the two")


def check_prompt_embeds(args: Any, bad: Callable[[str, str], None]) -> None:
    """--enable-prompt-embeds: the layouts it does not combine with yet (the rows ride the
    step's image-embedding input, which a pipeline and the pooling runner do not take)."""
    if not args.enable_prompt_embeds:
        return
    for name, on in (("pipeline_parallel_size", args.pipeline_parallel_size > 1),
                     ("runner", args.runner == "pooling" or args.convert in ("embed",
                                                                             "classify"))):
        if on:
            bad(name, "with --enable-prompt-embeds is not supported; drop one of the two")


def check_sleep_mode(args: Any, bad: Callable[[str, str], None]) -> None:
    """--enable-sleep-mode on one engine of one host: what it does not combine with yet (each
    would need the weights released and restored on other hosts, replicas or stages, or a
    draft model's too)."""
    if not args.enable_sleep_mode:
        return
    spec = args.speculative_config
    for name, on in (("pipeline_parallel_size", args.pipeline_parallel_size > 1),
                     ("data_parallel_size", args.data_parallel_size > 1),
                     ("nnodes", args.nnodes > 1),
                     ("speculative_config", spec is not None and spec.method != "ngram")):
        if on:
            bad(name, "with --enable-sleep-mode is not implemented yet; drop one of the two")


def check_kv_offloading(args: Any, bad: Callable[[str, str], None]) -> None:
    """--kv-offloading-size: a positive size, with prefix caching (it offloads the prefix
    cache's evicted blocks) on one host without pipeline stages (each would need its own
    share of the tier) yet."""
    if args.kv_offloading_size is None:
        return
    if args.kv_offloading_size <= 0:
        bad("kv_offloading_size", "must be positive (GiB)")
    if args.kv_offloading_backend != "native":  # vLLM's lmcache has no JAX counterpart
        bad("kv_offloading_backend", "only 'native' (this process's host memory) is implemented")
    for name, on, why in (
            ("enable_prefix_caching", args.enable_prefix_caching is False,
             "offloads the prefix cache's evicted blocks: there are none without it"),
            ("pipeline_parallel_size", args.pipeline_parallel_size > 1, "is not implemented "
             "with pipeline stages yet"),
            ("nnodes", args.nnodes > 1, "is not implemented across hosts yet")):
        if on:
            bad(name, f"with --kv-offloading-size: the host tier {why}; drop one of the two")


def check_data_parallel(args: Any, bad: Callable[[str, str], None]) -> None:
    """vLLM's multi-node DP flags: the API node (no --headless) holds ranks 0 .. local-1,
    each --headless node `local` ranks from its start rank. A replica spanning hosts
    (--nnodes with DP) is not implemented. `bad(name, why)` raises the flag's error."""
    n = args.data_parallel_size
    local = args.data_parallel_local
    start = args.data_parallel_start_rank
    if n > 1 and args.nnodes > 1:
        bad("data_parallel_size", "a data-parallel group whose replicas span hosts "
            "(--nnodes) is not implemented: across hosts use --data-parallel-size-local "
            "(a replica per node or more), or --nnodes with --tensor-parallel-size alone")
    if not 0 < args.data_parallel_rpc_port < 65536:
        bad("data_parallel_rpc_port", "must be a port number (1-65535)")
    if args.data_parallel_size_local is not None and not 0 <= local <= n:
        bad("data_parallel_size_local", f"must be in 0 .. --data-parallel-size = {n}")
    if not 0 <= start < n:
        bad("data_parallel_start_rank", f"must be in 0 .. --data-parallel-size - 1 = {n - 1}")
    if args.headless and args.nnodes == 1:
        if n == 1:
            bad("headless", "a headless node runs remote data-parallel replicas (give "
                "--data-parallel-size and --data-parallel-size-local) or follows rank 0 "
                "of --nnodes hosts")
        if local == 0:
            bad("data_parallel_size_local", "a --headless node runs at least one replica")
        if start == 0:
            bad("data_parallel_start_rank", "rank 0 is the API node's; a --headless node "
                "starts at the API node's --data-parallel-size-local or above")
    elif not args.headless:
        if start != 0:
            bad("data_parallel_start_rank", "the API node holds ranks 0 .. "
                "--data-parallel-size-local - 1; start ranks are for --headless nodes")
        if local == 0:
            bad("data_parallel_size_local", "0 (an API node without a replica) is not "
                "implemented: the API node tokenizes with its own first replica; keep one "
                "there")
    if start + local > n:
        bad("data_parallel_size_local", f"ranks {start} .. {start + local - 1} go past "
            f"--data-parallel-size {n}")


def mm_limits(value) -> dict:
    """--limit-mm-per-prompt: {modality: most items}, images only (others must be 0)."""
    limits = json_object(value)
    for key, n in limits.items():
        if key not in ("image", "video", "audio") or not isinstance(n, int) or n < 0:
            raise ValueError(f"{key!r}: {n!r} is not a modality (image) with a count >= 0")
        if key != "image" and n:
            raise ValueError(f"{key!r} input is not implemented (only images); give 0 or drop it")
    return limits


def check_kv_scales(args: Any, bad: Callable[[str, str], None]) -> None:
    """--calculate-kv-scales: only a float8 cache is stored scaled, and a wake-up that reads
    the weights again would drop the computed scales."""
    if not args.calculate_kv_scales:
        return
    if not args.kv_cache_dtype.startswith("fp8"):
        bad("calculate_kv_scales", "needs an fp8 --kv-cache-dtype (fp8, fp8_e4m3, "
            "fp8_e5m2): only a float8 cache is stored scaled")
    if args.enable_sleep_mode:
        bad("calculate_kv_scales", "with --enable-sleep-mode is not implemented (a wake-up "
            "that reads the weights again would drop the computed scales); drop one")


# --structured-outputs-config keys honoured (vLLM's StructuredOutputsConfig); others refused.
STRUCTURED_OUTPUTS_KEYS = ("backend", "disable_fallback", "disable_any_whitespace",
                           "disable_additional_properties")


def check_structured_outputs(args: Any) -> None:
    """--structured-outputs-config's keys and values, and its backend against
    --guided-decoding-backend's."""
    from jaxllm.structured_output.params import BACKENDS

    cfg = args.structured_outputs_config or {}
    unknown = sorted(set(cfg) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise ConfigError(f"--structured-outputs-config: {', '.join(unknown)} not supported "
                          f"(supported: {', '.join(STRUCTURED_OUTPUTS_KEYS)})")
    for key in STRUCTURED_OUTPUTS_KEYS[1:]:
        if not isinstance(cfg.get(key, False), bool):
            raise ConfigError(f"--structured-outputs-config: {key} must be true or false")
    for flag, backend in (("structured-outputs-config", cfg.get("backend")),
                          ("guided-decoding-backend", args.guided_decoding_backend)):
        if backend is not None and backend not in BACKENDS:
            raise ConfigError(f"--{flag}: backend {backend!r} is not available; choose one "
                              f"of {', '.join(BACKENDS)} (llguidance is the one installed)")
    if (cfg.get("backend") is not None and args.guided_decoding_backend is not None
            and cfg["backend"] != args.guided_decoding_backend):
        raise ConfigError("--guided-decoding-backend and --structured-outputs-config's "
                          "backend disagree; give one")
