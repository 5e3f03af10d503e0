"""Data-parallel replicas on other nodes, seen from the API node: each is a `RemoteReplica`
that the data-parallel engine (jaxllm/deploy/data_parallel.py) drives like a local LLMEngine.

Why a socket per replica and not jax.distributed: replicas share no array and run no
collective with one another (expert parallelism stays inside a replica), so each node is a JAX
process of its own and only the engine's calls cross: `add_request` (its LoRA adapter's
request included), `abort_request`, `step`, `encode` and the LoRA registry's `add_lora`,
`remove_lora` and `list_loras`, pickled, one request and one reply each (frames from jaxllm/parallel/wire.py).
Every reply carries the replica's `stats()`, its unfinished count and its clock, so routing,
`has_unfinished_requests()` and /metrics need no call of their own, and the request timings
in its outputs (monotonic clocks differ between hosts) are moved onto this node's clock.

A lost node (its process ended, or no reply within --distributed-timeout-seconds) fails the
requests it held with ReplicaLostError and is routed no more; the other replicas keep serving,
since nothing of theirs waits on it. An exception inside a remote step is fatal, as a local
step's is (jaxllm/engine/async_engine.py): the engine cannot know what state it left.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import pickle
import socket
import threading
import time
from typing import Any, Optional

from jaxllm.config import ConfigError, EngineArgs
from jaxllm.engine.errors import ReplicaLostError
from jaxllm.engine.stats import EngineStats
from jaxllm.parallel.distributed import STARTUP_TIMEOUT
from jaxllm.parallel.wire import no_delay, recv_frame, send_frame

logger = logging.getLogger("jaxllm")

STOP = b"stop"
# Engine arguments that may differ between the nodes of one deployment: the per-node DP flags,
# and what only shapes a node's logs, downloads or API. Every other one must be the same
# everywhere (a replica's outputs depend on it).
PER_NODE_ARGS = ("headless", "data_parallel_size_local", "data_parallel_start_rank",
                 "disable_log_stats", "use_tqdm_on_load", "download_dir", "served_model_name")
_TIMES = ("arrival_time", "first_token_time", "finished_time")


def node_fingerprint(args: EngineArgs) -> dict:
    """The engine arguments every node must share."""
    return {k: v for k, v in vars(args).items() if k not in PER_NODE_ARGS}


def listen(args: EngineArgs) -> socket.socket:
    """The API node's listening socket, open before its own replicas load so the other nodes'
    connections queue meanwhile."""
    try:
        return socket.create_server((args.data_parallel_address, args.data_parallel_rpc_port),
                                    backlog=args.data_parallel_size)
    except OSError as e:
        raise ConfigError(f"--data-parallel-address {args.data_parallel_address} "
                          f"--data-parallel-rpc-port {args.data_parallel_rpc_port}: cannot "
                          f"listen there ({e})") from None


def accept_replicas(server: socket.socket, args: EngineArgs,
                    timeout: float = STARTUP_TIMEOUT) -> list["RemoteReplica"]:
    """Wait for every rank from --data-parallel-size-local up to register; a node whose engine
    arguments differ from this one's is refused (told why, and named here)."""
    want = set(range(args.data_parallel_local, args.data_parallel_size))
    mine, got = node_fingerprint(args), {}
    deadline = time.monotonic() + timeout
    logger.info("Waiting for data-parallel ranks %s on %s:%d", sorted(want),
                args.data_parallel_address, args.data_parallel_rpc_port)
    try:
        while want - set(got):
            server.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                sock, peer = server.accept()
            except socket.timeout:
                raise ConfigError(f"--data-parallel-size {args.data_parallel_size}: ranks "
                                  f"{sorted(want - set(got))} did not register within "
                                  f"{timeout:.0f} s (start them with --headless)") from None
            sock.settimeout(timeout)
            hello = pickle.loads(recv_frame(no_delay(sock)))
            rank, theirs = hello["rank"], hello["args"]
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            why = (f"engine arguments differ from the API node's: {', '.join(diff)}" if diff
                   else None if rank in want - set(got)
                   else f"rank {rank} is not one the API node waits for ({sorted(want)})")
            send_frame(sock, pickle.dumps({"error": why, "clock": time.monotonic()}))
            if why:
                sock.close()
                raise ConfigError(f"data-parallel node {peer[0]}: {why}")
            got[rank] = RemoteReplica(sock, rank, peer[0], hello, args.distributed_timeout_seconds)
            logger.info("Data-parallel rank %d registered from %s", rank, peer[0])
    finally:
        server.close()
    return [got[r] for r in sorted(got)]


class RemoteReplica:
    """A replica on another node, with LLMEngine's calls (the ones the DP engine makes)."""

    runner = None  # its devices are the other node's

    def __init__(self, sock: socket.socket, rank: int, host: str, hello: dict, timeout: float):
        self.sock, self.rank, self.host, self.timeout = sock, rank, host, timeout
        self.sock.settimeout(timeout)
        self.lost_reason: Optional[str] = None
        self._stats: dict = hello["stats"]
        self._unfinished = 0
        self._offset = time.monotonic() - hello["clock"]  # this clock minus the node's
        self._lock = threading.Lock()
        # Round trip of each call minus the node's time inside the engine: what the socket,
        # pickling and the node's loop add (docs/multi-host.md).
        self.overhead_seconds: collections.deque = collections.deque(maxlen=4096)

    @property
    def alive(self) -> bool:
        return self.lost_reason is None

    def _call(self, method: str, *args) -> Any:
        if not self.alive:
            raise ReplicaLostError(f"data-parallel rank {self.rank} is lost: {self.lost_reason}")
        t = time.monotonic()
        with self._lock:
            try:
                send_frame(self.sock, pickle.dumps((method, args)))
                reply = pickle.loads(recv_frame(self.sock))
            except socket.timeout:
                self._lose(f"no reply from {self.host} for {self.timeout:.0f} s")
            except OSError as e:  # ConnectionError included: the process ended
                self._lose(f"the connection to {self.host} failed ({e})")
        now = time.monotonic()
        self.overhead_seconds.append(now - t - reply["seconds"])
        self._offset = now - reply["clock"]
        self._stats, self._unfinished = reply["stats"], reply["unfinished"]
        if reply["kind"] == "invalid":
            raise ValueError(reply["error"])
        if reply["kind"] == "failed":
            raise RuntimeError(f"data-parallel rank {self.rank} on {self.host} failed: "
                               f"{reply['error']}")
        return reply["result"]

    def _lose(self, reason: str):
        self.lost_reason = reason
        self._unfinished = 0
        self.sock.close()
        logger.error("Data-parallel rank %d lost: %s; its requests fail, the others serve on",
                     self.rank, reason)
        raise ReplicaLostError(f"data-parallel rank {self.rank} is lost: {reason}")

    def add_request(self, request_id, prompt, params=None, priority=0, arrival_time=None,
                    lora_request=None):
        """lora_request (a LoRARequest, pickled with the call): the node reads the adapter
        from its folder, so the path must be one the node can read (as with vLLM's nodes)."""
        arrival = (time.monotonic() if arrival_time is None else arrival_time) - self._offset
        adapter = () if lora_request is None else (lora_request,)
        self._call("add_request", request_id, prompt, params, priority, arrival, *adapter)

    def abort_request(self, request_ids) -> None:
        if self.alive:
            self._call("abort_request", request_ids)

    def step(self) -> list:
        outputs = self._call("step")
        for out in outputs:
            for key in _TIMES:
                if out.metrics.get(key) is not None:
                    out.metrics[key] += self._offset
        return outputs

    def encode(self, request_id, prompt, params=None):
        return self._call("encode", request_id, prompt, params)

    def add_lora(self, lora_request) -> bool:
        return self._call("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._call("remove_lora", lora_int_id)

    def list_loras(self) -> set[int]:
        return self._call("list_loras")

    def has_unfinished_requests(self) -> bool:
        return self._unfinished > 0

    def get_num_unfinished_requests(self) -> int:
        return self._unfinished

    def wait_for_background_compiles(self, load_cached: bool = False) -> None:
        """The node compiled everything before it registered (its cached programs load on
        their node)."""

    def stats(self) -> EngineStats:
        """As of the last reply; a lost replica holds nothing and has no cache (its token
        counters stay, so totals never go down)."""
        if self.alive:
            return self._stats
        return dataclasses.replace(self._stats, num_running=0, num_waiting=0,
                                   kv_cache_usage=0.0, num_free_blocks=0, num_total_blocks=0)

    def close(self) -> None:
        """Tell the node this deployment stopped (it exits 0)."""
        if self.alive:
            try:
                send_frame(self.sock, STOP)
            except OSError:
                pass
            self.sock.close()
