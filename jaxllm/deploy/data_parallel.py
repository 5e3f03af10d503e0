"""Data parallelism (`--data-parallel-size N`): N engine replicas, each on its own sub-mesh of
--tensor-parallel-size devices, behind one engine interface (what `LLM` and the API server
use), with a router choosing each request's replica (jaxllm/deploy/router.py). With
--data-parallel-size-local L < N, replicas L .. N-1 run on other nodes and are driven over a
socket (jaxllm/deploy/remote_replica.py); a lost one fails its requests and the rest serve on.

Each replica is a whole `LLMEngine` (scheduler, KV cache, weights, compiled programs) on its
devices, so replicas share nothing and a request runs exactly as on one engine: outputs equal
the single-engine ones token for token. `step()` steps every replica with work in its own
thread (a step's device work releases the GIL), so replicas' devices run at once.
"""

from __future__ import annotations

import atexit
import time
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Optional, Union

from jaxllm.config import EngineArgs
from jaxllm.deploy.replica_node import local_replicas
from jaxllm.deploy.remote_replica import RemoteReplica, accept_replicas, listen
from jaxllm.deploy.router import PrefixAffinityRouter
from jaxllm.engine.errors import ReplicaLostError
from jaxllm.engine.stats import EngineStats, sum_stats
from jaxllm.engine.engine import LLMEngine, PromptType
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams


def make_engine(args: EngineArgs):
    """The engine for these arguments: one LLMEngine (a pipeline of stages included), or N
    replicas behind a router."""
    return DataParallelEngine(args) if args.data_parallel_size > 1 else LLMEngine(args)


def _no_lora():
    raise ValueError("LoRA adapters are not supported with --data-parallel-size > 1 (each "
                     "replica would need them); serve them from one replica")


def _step(replica) -> list:
    """A replica's step; a remote one lost during it has no outputs (its requests fail)."""
    try:
        return replica.step()
    except ReplicaLostError:
        return []


class DataParallelEngine:
    step_leader = None  # no replica spans hosts (each node's are its own JAX processes)

    def __init__(self, args: EngineArgs):
        t0 = time.perf_counter()
        server = listen(args) if args.data_parallel_local < args.data_parallel_size else None
        try:
            self.replicas = local_replicas(args)
            if server is not None:
                self.replicas += accept_replicas(server, args)
        finally:
            if server is not None:
                server.close()
        first = self.replicas[0]
        self.args = args
        self.model_config = first.model_config
        self.tokenizer = first.tokenizer
        self.eos_token_ids = first.eos_token_ids
        self.generation_defaults = first.generation_defaults
        # The pooling tasks and classifier head (LLM.score, /classify): every replica's.
        self.supported_tasks = first.supported_tasks
        self.classifier = first.classifier
        self.startup_times = dict(first.startup_times, total=time.perf_counter() - t0)
        self.router = PrefixAffinityRouter(args.block_size)
        self._replica_of: dict[str, LLMEngine] = {}
        self._failed: list[ReplicaLostError] = []
        self._pool = ThreadPoolExecutor(max_workers=len(self.replicas),
                                        thread_name_prefix="jaxllm-dp")
        atexit.register(self.close)

    @property
    def replica_of(self) -> MappingProxyType:
        """Request id -> the replica running it, for each unfinished request (a live read-only
        view: routing is the router's and this engine's to change)."""
        return MappingProxyType(self._replica_of)

    @property
    def alive(self) -> bool:
        """The API node's own replicas are never lost."""
        return any(r.alive for r in self.replicas)

    def get_tokenizer(self):
        return self.tokenizer

    def process_prompt(self, prompt: PromptType, truncate_prompt_tokens: Optional[int] = None
                       ) -> tuple[Optional[str], list[int]]:
        return self.replicas[0].process_prompt(prompt, truncate_prompt_tokens)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: Optional[SamplingParams] = None, priority: int = 0,
                    arrival_time: Optional[float] = None,
                    lora_request: Optional[LoRARequest] = None) -> None:
        if lora_request is not None:
            _no_lora()
        if request_id in self._replica_of:
            raise ValueError(f"request id {request_id!r} is already running")
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            raise ValueError("multi_modal_data: images are not implemented with "
                             "--data-parallel-size > 1 (serve the model with one replica)")
        # tokenized once, here: the router reads the ids the replica will run
        text, ids = self.process_prompt(prompt, params.truncate_prompt_tokens if params else None)
        # A replica found lost here never started the request: route it again (the API
        # node's own replicas are never lost, so this ends).
        while True:
            replica = self.replicas[self.router.choose(
                ids, [r.stats() for r in self.replicas], [r.alive for r in self.replicas])]
            try:
                replica.add_request(request_id, {"prompt": text, "prompt_token_ids": ids},
                                    params, priority, arrival_time)
                break
            except ReplicaLostError:
                self._fail_lost()
        self._replica_of[request_id] = replica

    def add_lora(self, lora_request: LoRARequest) -> bool:
        _no_lora()

    def remove_lora(self, lora_int_id: int) -> bool:
        _no_lora()

    def list_loras(self) -> set[int]:
        return set()

    def encode(self, request_id: str, prompt: PromptType,
               params: Optional[PoolingParams] = None) -> PoolingRequestOutput:
        """Pooling (--runner pooling) takes no KV-cache place: the replica with the fewest
        unfinished requests runs it."""
        while True:
            replica = min((r for r in self.replicas if r.alive),
                          key=lambda r: r.get_num_unfinished_requests())
            try:
                return replica.encode(request_id, prompt, params)
            except ReplicaLostError:
                continue

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            replica = self._replica_of.pop(rid, None)
            if replica is not None:
                try:
                    replica.abort_request(rid)
                except ReplicaLostError:  # lost meanwhile: its other requests fail next step
                    self._fail_lost()

    def has_unfinished_requests(self) -> bool:
        return bool(self._failed) or any(r.has_unfinished_requests() for r in self.replicas)

    def get_num_unfinished_requests(self) -> int:
        return len(self._failed) + sum(r.get_num_unfinished_requests() for r in self.replicas)

    def wait_for_background_compiles(self, load_cached: bool = False) -> None:
        for r in self.replicas:
            r.wait_for_background_compiles(load_cached)

    def step(self) -> list[Union[RequestOutput, ReplicaLostError]]:
        """One step of every replica with work, each in its own thread. The requests of a
        replica lost meanwhile come out as ReplicaLostError (finished, with their id)."""
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        outputs = [o for outs in self._pool.map(_step, busy) for o in outs]
        for out in outputs:
            if out.finished:
                self._replica_of.pop(out.request_id, None)
        self._fail_lost()
        failed, self._failed = self._failed, []
        return outputs + failed

    def _fail_lost(self) -> None:
        """Each request of a lost replica becomes a ReplicaLostError, out with the next step."""
        lost = [(rid, r) for rid, r in self._replica_of.items() if not r.alive]
        for rid, r in lost:
            del self._replica_of[rid]
            self._failed.append(ReplicaLostError(
                f"data-parallel rank {r.rank} is lost: {r.lost_reason}", rid))

    def close(self) -> None:
        """Tell the other nodes' replicas to stop (they exit 0)."""
        for r in self.replicas:
            if isinstance(r, RemoteReplica):
                r.close()

    def stats(self) -> EngineStats:
        """The totals (KV usage over all replicas' blocks), each replica's own in replicas."""
        return sum_stats([r.stats() for r in self.replicas],
                         prefix_affinity_hits=self.router.affinity_hits)
