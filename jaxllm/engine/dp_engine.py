"""Data parallelism (`--data-parallel-size N`): N engine replicas, each on its own sub-mesh of
--tensor-parallel-size devices, behind one engine interface (what `LLM` and the API server
use), with a router choosing each request's replica (jaxllm/engine/dp_router.py).

Each replica is a whole `LLMEngine` (scheduler, KV cache, weights, compiled programs) on its
devices, so replicas share nothing and a request runs exactly as on one engine: outputs equal
the single-engine ones token for token. `step()` steps every replica with work in its own
thread (a step's device work releases the GIL), so replicas' devices run at once.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

import jax

from jaxllm.config import ConfigError, EngineArgs
from jaxllm.engine.dp_router import PrefixAffinityRouter
from jaxllm.engine.engine import LLMEngine, PromptType
from jaxllm.outputs import PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

_SUMMED = ("num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits",
           "num_preemptions", "num_free_blocks", "num_total_blocks", "prompt_tokens_total",
           "generation_tokens_total")


def make_engine(args: EngineArgs):
    """The engine for these arguments: one LLMEngine, a pipeline of stages, or N replicas
    behind a router."""
    if args.pipeline_parallel_size > 1:
        from jaxllm.engine.pp_engine import PipelineEngine
        return PipelineEngine(args)
    return DataParallelEngine(args) if args.data_parallel_size > 1 else LLMEngine(args)


class DataParallelEngine:
    step_leader = None  # data parallelism runs on one host

    def __init__(self, args: EngineArgs):
        n, tp = args.data_parallel_size, args.tensor_parallel_size
        t0 = time.perf_counter()
        devices = jax.devices()
        if n * tp > len(devices):
            raise ConfigError(
                f"--data-parallel-size={n}: {n} replicas x --tensor-parallel-size {tp} need "
                f"{n * tp} devices, but {len(devices)} {devices[0].platform.upper()} device(s) "
                f"are visible (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N)")
        self.replicas = [LLMEngine(args, devices=devices[i * tp:(i + 1) * tp])
                         for i in range(n)]
        first = self.replicas[0]
        self.args = args
        self.model_config = first.model_config
        self.tokenizer = first.tokenizer
        self.eos_token_ids = first.eos_token_ids
        self.generation_defaults = first.generation_defaults
        self.startup_times = dict(first.startup_times, total=time.perf_counter() - t0)
        self.router = PrefixAffinityRouter(args.block_size)
        self._replica_of: dict[str, LLMEngine] = {}
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="jaxllm-dp")

    def get_tokenizer(self):
        return self.tokenizer

    def process_prompt(self, prompt: PromptType, truncate_prompt_tokens: Optional[int] = None
                       ) -> tuple[Optional[str], list[int]]:
        return self.replicas[0].process_prompt(prompt, truncate_prompt_tokens)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: Optional[SamplingParams] = None, priority: int = 0,
                    arrival_time: Optional[float] = None) -> None:
        if request_id in self._replica_of:
            raise ValueError(f"request id {request_id!r} is already running")
        # tokenized once, here: the router reads the ids the replica will run
        text, ids = self.process_prompt(prompt, params.truncate_prompt_tokens if params else None)
        i = self.router.choose(ids, [r.stats() for r in self.replicas])
        replica = self.replicas[i]
        replica.add_request(request_id, {"prompt": text, "prompt_token_ids": ids}, params,
                            priority, arrival_time)
        self._replica_of[request_id] = replica

    def encode(self, request_id: str, prompt: PromptType,
               params: Optional[PoolingParams] = None) -> PoolingRequestOutput:
        """Pooling (--runner pooling) takes no KV-cache place: the replica with the fewest
        unfinished requests runs it."""
        replica = min(self.replicas, key=LLMEngine.get_num_unfinished_requests)
        return replica.encode(request_id, prompt, params)

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            replica = self._replica_of.pop(rid, None)
            if replica is not None:
                replica.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def get_num_unfinished_requests(self) -> int:
        return sum(r.get_num_unfinished_requests() for r in self.replicas)

    def wait_for_background_compiles(self) -> None:
        for r in self.replicas:
            r.wait_for_background_compiles()

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work, each in its own thread."""
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        outputs = [o for outs in self._pool.map(LLMEngine.step, busy) for o in outs]
        for out in outputs:
            if out.finished:
                self._replica_of.pop(out.request_id, None)
        return outputs

    def stats(self) -> dict[str, Any]:
        """The totals (KV usage over all replicas' blocks), and each replica's own under
        'replicas'."""
        per = [r.stats() for r in self.replicas]
        total = {k: sum(s[k] for s in per) for k in _SUMMED}
        used = sum(s["kv_cache_usage"] * s["num_total_blocks"] for s in per)
        total["kv_cache_usage"] = used / max(total["num_total_blocks"], 1)
        total["prefix_affinity_hits"] = self.router.affinity_hits
        total["replicas"] = per
        return total
