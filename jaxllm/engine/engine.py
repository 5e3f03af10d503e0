"""The engine loop: add and abort requests, and `step()` = plan -> execute -> update.

Each stage has its own object: the input processor checks a request once, the output
processor fans it out into its n sequences and turns their tokens into outputs, the
scheduler plans each step and owns every sequence's status, and the runner executes a plan
on the devices (`dispatch`, then `collect` its tokens). Everything here is host-side Python.

How many steps are in flight is the step policy, set once from the config: one (each step
read before the next is planned); two with --async-scheduling (step N+1 is planned and
dispatched, taking its input tokens from the device, before step N is read); N with
--pipeline-parallel-size N (the stages work on N steps holding disjoint sequences). With
--num-scheduler-steps K, K decode steps may run as one program (a burst).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Optional, Union

from jaxllm.config import EngineArgs
from jaxllm.engine.input_processor import InputProcessor, PromptType
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.lora_slots import LoRASlots
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sleep_mode import SleepMode
from jaxllm.engine.startup import build_engine_parts
from jaxllm.engine.stats import EngineStats, LoraStats, StatsLogger
from jaxllm.loader.loader import read_weights
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.draft_model import build_speculator
from jaxllm.worker.pooler import Pooler

logger = logging.getLogger("jaxllm")

__all__ = ["LLMEngine", "PromptType"]


def _last(inflight):
    """The last step of what is in flight (a step, a burst's list of steps, or None)."""
    return inflight[-1] if isinstance(inflight, list) else inflight


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
        block_size = config.cache.block_size
        self.pooler = (None if parts.pooler_config is None
                       else Pooler(parts.pooler_config, self.runner, block_size))
        sc, pp = config.scheduler, config.parallel.pipeline_parallel_size
        self.lora_config = config.lora
        self.lora_slots = (None if config.lora is None else
                           LoRASlots(config.lora, self.model_config, self.runner.write_lora_slot))
        self.kv_cache_manager = KVCacheManager(
            parts.num_blocks, block_size, enable_prefix_caching=config.cache.enable_prefix_caching,
            hash_algo=config.cache.prefix_caching_hash_algo)
        self.scheduler = Scheduler(
            self.kv_cache_manager, max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=self.runner.max_num_batched_tokens,
            max_model_len=self.model_config.max_model_len,
            enable_chunked_prefill=sc.enable_chunked_prefill, policy=sc.policy,
            block_size=block_size, pipeline_depth=pp, lora_slots=self.lora_slots)
        self.input_processor = InputProcessor(
            self.tokenizer, self.model_config, max_logprobs=sc.max_logprobs,
            eos_token_ids=self.eos_token_ids, structured_outputs=config.structured_outputs,
            priority_scheduling=sc.policy == "priority", seed=config.model.seed)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.sleep_mode = SleepMode(
            config.enable_sleep_mode, self.runner, self.kv_cache_manager,
            lambda tensors: read_weights(config.load, self.model_config, self.runner.mesh,
                                         config.model.seed, tensors),
            self.lora_slots.forget_slots if self.lora_slots is not None else lambda: None)
        self.speculator = build_speculator(config, self.model_config, self.runner,
                                           parts.num_blocks)
        # The step policy: steps in flight at most, and whether a step takes its input
        # tokens from the one before it on the device (async scheduling) or waits for them.
        self._depth = pp if pp > 1 else 2 if sc.async_scheduling else 1
        self._chain = pp == 1 and sc.async_scheduling
        self._burst_steps = sc.num_scheduler_steps
        self._inflight: collections.deque = collections.deque()  # oldest first
        self._stats_log = StatsLogger(not config.disable_log_stats, time.monotonic())
        self.total_prompt_tokens = 0  # of finished requests (and pooled prompts)
        self._prompt_positions = 0  # prompt positions computed (for the stats line)
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
        if self.pooler is not None:
            raise ValueError("Text generation is only supported for generative models; this "
                             "one runs with --runner pooling (embeddings). Start it with "
                             "--runner generate to generate text.")
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already running")
        self.sleep_mode.check_awake()
        if lora_request is not None:
            self.add_lora(lora_request)
        req = self.input_processor.process(request_id, prompt, params, priority, arrival_time,
                                           lora_request)
        for seq in self.output_processor.add_request(req):
            self.scheduler.add_seq(seq)

    # --- LoRA adapters -----------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register and read a peft adapter (False: it is registered already). Errors name
        the adapter; --enable-lora must be on."""
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
        if self.pooler is None:
            raise ValueError("Embeddings are only supported for pooling models; this one runs "
                             "with --runner generate. Start it with --runner pooling (or "
                             "--convert embed) to embed.")
        self.sleep_mode.check_awake()
        text, ids = self.process_prompt(prompt)
        data = self.pooler.embed(ids, params or PoolingParams())
        self.total_prompt_tokens += len(ids)
        return PoolingRequestOutput(request_id, PoolingOutput(data), ids, True, text)

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self._forget(self.output_processor.abort_request(rid))

    def _forget(self, seq_ids: list[str]) -> None:
        self.scheduler.abort_seqs(seq_ids)
        if self.speculator is not None:
            for sid in seq_ids:
                self.speculator.free(sid)

    # --- sleep mode (jaxllm/engine/sleep_mode.py) and new weights -----------------------------
    def sleep(self, level: int = 1, mode: str = "abort") -> dict:
        """Free device memory (level 1: weights kept in host memory; 2: weights freed) once
        the engine holds no request: mode 'abort' aborts those it holds, 'wait' refuses
        while there are any (the async front waits for them instead)."""
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
        if mode not in ("abort", "wait"):
            raise ValueError(f"{what} mode {mode!r}: must be 'abort' or 'wait'")
        if self.has_unfinished_requests() and mode == "wait":
            raise ValueError(f"{what}: {len(self.output_processor)} request(s) unfinished; "
                             "abort them or wait for them first")
        self.abort_request(self.output_processor.request_ids())
        while self._inflight:  # steps of aborted requests: read and dropped
            self._update(self._inflight.popleft())

    def wait_for_background_compiles(self, load_cached: bool = False) -> None:
        """Block until the programs warm-up left to the background are compiled (the server
        waits for them before it listens: see async_engine); the wait is in startup_times.
        load_cached: also load the programs the executable cache holds (benchmarks)."""
        t, pending = time.perf_counter(), self.runner.num_pending_compiles()
        if pending:
            logger.info("Waiting for the %d programs compiling in the background before "
                        "serving", pending)
        self.runner.wait_for_background_compiles(load_cached)
        if pending:
            self.startup_times["background_compile"] = time.perf_counter() - t
            logger.info("Compiled them in %.1f s", self.startup_times["background_compile"])

    def has_unfinished_requests(self) -> bool:
        return len(self.output_processor) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor)

    # --- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan and dispatch one step (or a burst), then read the oldest step in flight once
        the policy's depth is reached or nothing new was dispatched; returns the outputs of
        the requests that progressed."""
        outputs: list[RequestOutput] = []
        if self._inflight and self._chain and not self._can_overlap():
            outputs += self._update(self._inflight.popleft())  # sampling needs its tokens
        prev = _last(self._inflight[-1]) if self._chain and self._inflight else None
        if self.scheduler.can_burst(self._burst_steps) and self.runner.burst_ready(
                self.scheduler.running, self._burst_steps):
            cur = self._dispatch_burst(prev)
        else:
            drafts = (self.speculator.propose(self.scheduler.running)
                      if self.speculator is not None else None)
            sched = self.scheduler.schedule(drafts)
            cur = self.runner.dispatch(sched, prev) if sched.scheduled else None
            if cur is not None:
                self.scheduler.advance(sched)
        if cur is not None:
            self._inflight.append(cur)
        if self._inflight and (len(self._inflight) >= self._depth or cur is None):
            outputs += self._update(self._inflight.popleft())
        now = time.monotonic()
        if now >= self._stats_log.next_at:
            self._stats_log.log(now, self.stats(), self._prompt_positions,
                                self.output_processor.num_generation_tokens)
        return outputs

    def _dispatch_burst(self, prev) -> list:
        """num_scheduler_steps decode steps in one program: each is planned and advanced on
        the host as usual (its input token is the step before's, still on the device; step
        0's is prev's), then all are dispatched. Their tokens are resolved in order when read
        (tokens after a stop are dropped)."""
        steps = []
        for _ in range(self._burst_steps):
            sched = self.scheduler.schedule()
            steps.append(self.runner.prepare_burst_step(
                sched, steps[-1].inflight if steps else prev))
            self.scheduler.advance(sched)
        return self.runner.dispatch_burst(steps, prev)

    def _can_overlap(self) -> bool:
        """The next step's sampling may not read output tokens still in flight, nor may its
        drafts be proposed without them (a step that may speculate reads them first), nor
        may a step follow one with drafts before it is known how many were accepted."""
        running = self.scheduler.running
        if self.speculator is not None and (
                any(s.spec_token_ids for s in _last(self._inflight[-1]).sched.scheduled)
                or self.speculator.wants_tokens(running)):
            return False
        return not any(r.sampling_params.needs_output_history for r in running)

    def _update(self, step) -> list[RequestOutput]:
        """Read a dispatched step's (or a burst's steps') tokens: the scheduler places them
        and applies its stops, the output processor turns them into text, logprobs and
        further stops (which the scheduler applies), then into outputs."""
        if isinstance(step, list):
            return [out for s in step for out in self._update(s)]
        sched, op = step.sched, self.output_processor
        sampled, prompt_logprobs = self.runner.collect(step)
        op.record_prompt_logprobs(prompt_logprobs)
        if self.speculator is not None:
            self.speculator.record(sched, sampled)
        kept = self.scheduler.resolve(sched, {rid: [s.token for s in results]
                                              for rid, results in sampled.items()})
        now = time.monotonic()
        self.scheduler.apply_stops(op.record_tokens(sched, sampled, kept, now))
        outputs, finished, prompt_tokens = op.outputs(now)
        if self.speculator is not None:
            for sid in finished:
                self.speculator.free(sid)
        self.total_prompt_tokens += prompt_tokens
        self._prompt_positions += sum(
            max(0, min(s.start + s.num_tokens, s.seq.num_prompt_tokens) - s.start)
            for s in sched.scheduled)
        return outputs

    def stats(self) -> EngineStats:
        kv, load = self.kv_cache_manager, self.runner.expert_load
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions, num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks, prompt_tokens_total=self.total_prompt_tokens,
            generation_tokens_total=self.output_processor.num_generation_tokens,
            spec_decode=self.speculator.stats() if self.speculator is not None else None,
            expert_load=(None if load is None  # --enable-expert-load-metrics
                         else dict(zip(self.runner.moe_layer_ids, load.copy()))),
            lora=None if self.lora_slots is None else LoraStats(
                self.lora_slots.running(),
                tuple(sorted({s.lora_request.lora_name for s in self.scheduler.waiting_seqs()
                              if s.lora_request is not None})),
                self.lora_config.max_loras))
