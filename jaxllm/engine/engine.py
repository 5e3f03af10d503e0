"""The engine loop: add and abort requests, and `step()` = plan -> execute -> update.

Each stage has its own object: the input processor checks a request once, the output
processor fans it out into its n sequences and turns their tokens into outputs, the
scheduler plans each step and owns every sequence's status, the runner executes a plan on
the devices (`dispatch`, then `collect` its tokens), and the step policy (scheduler.py)
decides how many steps are in flight. Everything here is host-side Python.
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Union

from jaxllm.config import EngineArgs
from jaxllm.engine.input_processor import InputProcessor, PromptType
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.lora_slots import LoRASlots
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.scheduler import Scheduler, StepPolicy
from jaxllm.engine.sleep_mode import SleepMode
from jaxllm.engine.startup import build_engine_parts
from jaxllm.engine.stats import EngineStats, StatsLogger
from jaxllm.loader.loader import read_weights
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.draft_model import build_speculator
from jaxllm.worker.pooler import WRONG_RUNNER, Pooler

logger = logging.getLogger("jaxllm")

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    alive = True  # an engine in this process is never lost (EngineCore)

    def __init__(self, args: EngineArgs, devices: Optional[list] = None):
        """devices: the ones this engine's mesh uses (a data-parallel replica's share)."""
        t0 = time.perf_counter()
        self.args = args
        parts = build_engine_parts(args.create_engine_config(), devices=devices)
        self.config = config = parts.config  # as started: the model path resolved
        self.model_config = parts.model_config
        self.weight_bytes = parts.weight_bytes or {}  # by dtype, on the first device
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.generation_defaults = parts.generation_defaults
        self.runner = parts.runner
        self.step_leader = parts.step_leader  # multi-host rank 0's step channel (else None)
        self.pooler = (None if parts.pooler_config is None else Pooler(
            parts.pooler_config, self.runner, config.cache.block_size, parts.classifier))
        self.lora_slots = (None if config.lora is None else
                           LoRASlots(config.lora, self.model_config, self.runner.write_lora_slot))
        self.kv_cache_manager = KVCacheManager.for_engine(config, parts.num_blocks, self.runner,
                                                          self.model_config)
        self.scheduler = Scheduler.from_config(config, self.kv_cache_manager, self.model_config,
                                               self.runner.max_num_batched_tokens, self.lora_slots)
        self.input_processor = InputProcessor.from_config(config, self.model_config, self.tokenizer,
                                                          self.eos_token_ids, self.runner)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.sleep_mode = SleepMode(
            config.enable_sleep_mode, self.runner, self.kv_cache_manager,
            lambda tensors: read_weights(config.load, self.model_config, self.runner.mesh,
                                         config.model.seed, tensors),
            self.lora_slots.forget_slots if self.lora_slots is not None else lambda: None)
        self.speculator = build_speculator(config, self.model_config, self.runner,
                                           parts.num_blocks)
        self.step_policy = StepPolicy.from_config(config, self.scheduler, self.runner,
                                                  self.speculator)
        self._stats_log = StatsLogger(not config.disable_log_stats, time.monotonic())
        self.total_prompt_tokens = 0  # of finished requests (and pooled prompts)
        self._held: list[RequestOutput] = []  # read while going to sleep, for the next step
        self.startup_times = dict(parts.startup_times, total=time.perf_counter() - t0)
        logger.info("Engine ready in %.1f s (%s)", self.startup_times["total"],
                    ", ".join(f"{k} {v:.1f} s" for k, v in parts.startup_times.items()))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def get_tokenizer(self):
        return self.tokenizer

    # --- requests ----------------------------------------------------------------------------
    def process_prompt(self, prompt: PromptType, truncate_prompt_tokens: Optional[int] = None
                       ) -> tuple[Optional[str], list[int]]:
        return self.input_processor.process_prompt(prompt, truncate_prompt_tokens)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: Optional[SamplingParams] = None, priority: int = 0,
                    arrival_time: Optional[float] = None,
                    lora_request: Optional[LoRARequest] = None) -> None:
        """lora_request: the adapter to run it with (registered here on first use)."""
        self._accepts(pooling=False)
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already running")
        if lora_request is not None:
            self.add_lora(lora_request)
        req = self.input_processor.process(request_id, prompt, params, priority, arrival_time,
                                           lora_request)
        for seq in self.output_processor.add_request(req):
            self.scheduler.add_seq(seq)

    # --- LoRA adapters -----------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register and read a peft adapter (False: it is already); errors name the adapter."""
        if self.lora_slots is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: LoRA is off; start the "
                             f"engine with --enable-lora (enable_lora=True) to serve adapters")
        return self.lora_slots.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (False if unknown); requests running with it finish with it."""
        return self.lora_slots is not None and self.lora_slots.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return set() if self.lora_slots is None else self.lora_slots.list()

    def encode(self, request_id: str, prompt: PromptType,
               params: Optional[PoolingParams] = None) -> PoolingRequestOutput:
        """Pool one prompt now (it takes no step and no place in the KV cache)."""
        self._accepts(pooling=True)
        text, ids = self.process_prompt(prompt)
        data = self.pooler.run(ids, params or PoolingParams())
        self.total_prompt_tokens += len(ids)
        return PoolingRequestOutput(request_id, PoolingOutput(data), ids, True, text)

    def _accepts(self, pooling: bool) -> None:
        """Refuse work of the kind this engine's runner does not do, and any while it sleeps
        (refused, not queued)."""
        if (self.pooler is not None) != pooling:
            raise ValueError(WRONG_RUNNER[pooling])
        if self.sleep_mode.level:
            raise self.sleep_mode.sleeping_error()

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """vLLM's get_supported_tasks: generate, or the pooler's tasks."""
        return ("generate",) if self.pooler is None else self.pooler.tasks

    @property
    def classifier(self):
        """The classification head (--convert classify), else None: its labels' names."""
        return None if self.pooler is None else self.pooler.classifier

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            seq_ids = self.output_processor.abort_request(rid)
            self.scheduler.abort_seqs(seq_ids)
            self._free_drafts(seq_ids)

    def _free_drafts(self, seq_ids: list[str]) -> None:
        for sid in seq_ids if self.speculator is not None else ():
            self.speculator.free(sid)

    # --- sleep mode (jaxllm/engine/sleep_mode.py) and new weights -----------------------------
    def sleep(self, level: int = 1, mode: str = "abort") -> dict:
        """Free device memory (level 1: weights kept in host memory; 2: weights freed); mode:
        abort the requests held, 'wait' (refused while there are any here), or 'keep' them
        (preempted: recomputed after wake_up, their outputs so far kept)."""
        self._make_idle("sleep", mode)
        return self.sleep_mode.sleep(level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        self.sleep_mode.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.sleep_mode.is_sleeping

    def update_weights(self, named_tensors) -> None:
        """New weights for the model: a whole checkpoint's (HF name, array) pairs."""
        self._make_idle("update_weights", "wait")
        self.sleep_mode.update_weights(named_tensors)

    def _make_idle(self, what: str, mode: str) -> None:
        """No step in flight and no KV block held: the requests aborted (their steps' outputs
        dropped), or kept (their steps' outputs returned by the next `step`)."""
        self.sleep_mode.check_idle(what, mode, len(self.output_processor))
        if mode != "keep":
            self.abort_request(self.output_processor.request_ids())
        drained = self.step_policy.drain(self._update)
        self._held += drained if mode == "keep" else []
        self.scheduler.preempt_all()

    def wait_for_background_compiles(self, load_cached: bool = False) -> None:
        """Block until the programs warm-up left to the background are compiled (the server
        waits for them before it listens); the wait is in startup_times. load_cached: also
        load the programs the executable cache holds (benchmarks)."""
        waited = self.runner.wait_for_background_compiles(load_cached)
        if waited is not None:
            self.startup_times["background_compile"] = waited

    def has_unfinished_requests(self) -> bool:
        return len(self.output_processor) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor)

    # --- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan and dispatch one step (or a burst) and read what the step policy says is due;
        returns the outputs of the requests that progressed."""
        held, self._held = self._held, []
        if self.sleep_mode.level:  # requests kept asleep wait for wake_up
            return held
        outputs = held + self.step_policy.step(self._update)
        now = time.monotonic()
        if now >= self._stats_log.next_at:
            self._stats_log.log(now, self.stats(), self.output_processor.num_prompt_positions,
                                self.output_processor.num_generation_tokens)
        return outputs

    def _update(self, step) -> list[RequestOutput]:
        """Read a dispatched step's (or a burst's steps') tokens: the scheduler places them,
        the output processor turns them into text, logprobs, stops and then outputs."""
        if isinstance(step, list):
            return [out for s in step for out in self._update(s)]
        sched, op = step.sched, self.output_processor
        sampled, prompt_logprobs = self.runner.collect(step)
        op.record_prompt_logprobs(prompt_logprobs)
        if self.speculator is not None:
            self.speculator.record(sched, sampled, step.hidden)
        kept = self.scheduler.resolve(sched, {rid: [s.token for s in results]
                                              for rid, results in sampled.items()})
        now = time.monotonic()
        self.scheduler.apply_stops(op.record_tokens(sched, sampled, kept, now))
        outputs, finished, prompt_tokens = op.outputs(now)
        self._free_drafts(finished)
        self.total_prompt_tokens += prompt_tokens
        return outputs

    def stats(self) -> EngineStats:
        load = self.runner.expert_load
        return EngineStats(
            **self.kv_cache_manager.counters(),
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.total_prompt_tokens,
            generation_tokens_total=self.output_processor.num_generation_tokens,
            spec_decode=self.speculator.stats() if self.speculator is not None else None,
            expert_load=(None if load is None  # --enable-expert-load-metrics
                         else dict(zip(self.runner.moe_layer_ids, load.copy()))),
            lora=None if self.lora_slots is None else self.lora_slots.stats(
                self.scheduler.waiting_seqs()))
