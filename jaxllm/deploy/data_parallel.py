"""Data parallelism (`--data-parallel-size N`): N engine replicas, each on its own sub-mesh of
--tensor-parallel-size devices, behind one engine interface (what `LLM` and the API server
use), with a router choosing each request's replica (jaxllm/deploy/router.py). With
--data-parallel-size-local L < N, replicas L .. N-1 run on other nodes and are driven over a
socket (jaxllm/deploy/remote_replica.py); a lost one fails its requests and the rest serve on.

Each replica is a whole `LLMEngine` (scheduler, KV cache, weights, compiled programs) on its
devices, so replicas share nothing and a request runs exactly as on one engine: outputs equal
the single-engine ones token for token. `step()` steps every replica with work in its own
thread (a step's device work releases the GIL), so replicas' devices run at once.

LoRA adapters (--enable-lora): each replica has its own slots and host cache. A request's
adapter travels with it to the replica that serves it, which registers and reads it on first
use; `add_lora` (the server's --lora-modules and load route) registers it on every replica, so
a bad adapter is refused at load and any replica can take its requests; `remove_lora` reaches
every replica. The router roots its prefix affinity at the adapter (a replica's cached blocks
are its adapter's only), so requests with one adapter and a shared prefix land together; it
does not otherwise prefer a replica with the adapter resident (as vLLM's DP).
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


def _step(replica) -> list:
    """A replica's step; a remote one lost during it has no outputs (its requests fail)."""
    try:
        return replica.step()
    except ReplicaLostError:
        return []


def _adapter_key(req: Optional[LoRARequest]) -> Optional[tuple]:
    """What roots a prompt's prefix hashes on a replica: its adapter (None: the base)."""
    return None if req is None else (req.lora_name, req.lora_int_id, req.lora_path)


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
        # Every adapter sent to a replica, by name: one name or id is one adapter across all
        # replicas (each replica only checks its own).
        self._loras: dict[str, LoRARequest] = {}
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
            self._check_lora(lora_request)
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
                ids, [r.stats() for r in self.replicas], [r.alive for r in self.replicas],
                root=_adapter_key(lora_request))]
            adapter = {} if lora_request is None else {"lora_request": lora_request}
            try:
                replica.add_request(request_id, {"prompt": text, "prompt_token_ids": ids},
                                    params, priority, arrival_time, **adapter)
                break
            except ReplicaLostError:
                self._fail_lost()
        self._replica_of[request_id] = replica
        if lora_request is not None:
            self._loras[lora_request.lora_name] = lora_request

    # --- LoRA adapters: on every replica -------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register and read an adapter on every live replica (False: every one had it). If
        one refuses it (a bad adapter; a folder another node cannot read), the replicas that
        took it forget it again and the refusal is raised."""
        self._check_lora(lora_request)
        took, new = [], False
        for r in self._live():
            try:
                added = r.add_lora(lora_request)
            except ReplicaLostError:
                self._fail_lost()
                continue
            except Exception:
                for t in took:
                    self._call_live(t, "remove_lora", lora_request.lora_int_id)
                raise
            new |= added
            if added:
                took.append(r)
        self._loras[lora_request.lora_name] = lora_request
        return new

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter on every replica (False if none knew it); requests running with
        it finish with it."""
        known = [n for n, r in self._loras.items() if r.lora_int_id == lora_int_id]
        for n in known:
            del self._loras[n]
        removed = [self._call_live(r, "remove_lora", lora_int_id) for r in self._live()]
        return bool(known) or any(removed)

    def list_loras(self) -> set[int]:
        """The ids of the adapters registered through this engine (on load, or by a request
        on the replica that ran it)."""
        return {r.lora_int_id for r in self._loras.values()}

    def _check_lora(self, req: LoRARequest) -> None:
        """The refusal LoRASlots gives on one replica, across all of them: a name or id
        already another adapter's."""
        for other in self._loras.values():
            same = (other.lora_name, other.lora_int_id, other.lora_path) == (
                req.lora_name, req.lora_int_id, req.lora_path)
            if not same and (other.lora_name == req.lora_name
                             or other.lora_int_id == req.lora_int_id):
                raise ValueError(
                    f"LoRA adapter {req.lora_name!r} (id {req.lora_int_id}, {req.lora_path}): "
                    f"{other.lora_name!r} (id {other.lora_int_id}, {other.lora_path}) is "
                    f"registered under the same name or id; remove it first")

    def _live(self) -> list:
        return [r for r in self.replicas if r.alive]

    def _call_live(self, replica, method: str, *args):
        """replica.method(*args); None if the replica is lost meanwhile."""
        try:
            return getattr(replica, method)(*args)
        except ReplicaLostError:
            self._fail_lost()
            return None

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
