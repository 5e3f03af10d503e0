"""Data parallelism across nodes, in one process and without a model: the API node's engine
(DP 2, one replica local) and the other node's replica served from a thread over a real
loopback socket, each replica a `CountingEngine` (LLMEngine's calls, one made-up token per
step). Requests routed to the remote replica come back as the local one gives them; aborts and
per-replica stats cross; a bad request is refused with the replica's own error; a node with
other engine arguments is refused by name; a lost node fails its requests with
ReplicaLostError while the local replica serves on.

The flags' checks are here too. Real engines in two processes (tokens equal one process's,
`jaxllm serve` with a lost node) are in tests/test_dp_multinode.py (slow).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from jaxllm import SamplingParams
from jaxllm.config import ConfigError, EngineArgs
from jaxllm.deploy import data_parallel, replica_node
from jaxllm.deploy.remote_replica import RemoteReplica, accept_replicas, listen
from jaxllm.engine.errors import ReplicaLostError
from jaxllm.engine.stats import EngineStats
from jaxllm.outputs import CompletionOutput, RequestOutput

NEW = 6


@pytest.mark.parametrize("kw, flag", [
    (dict(data_parallel_size=2, data_parallel_size_local=3), "--data-parallel-size-local"),
    (dict(data_parallel_size=2, data_parallel_size_local=0), "--data-parallel-size-local"),
    (dict(data_parallel_size=2, data_parallel_start_rank=1), "--data-parallel-start-rank"),
    (dict(data_parallel_size=2, data_parallel_start_rank=2, headless=True),
     "--data-parallel-start-rank"),
    (dict(data_parallel_size=4, data_parallel_size_local=3, data_parallel_start_rank=2,
          headless=True), "--data-parallel-size-local"),
    (dict(data_parallel_size=2, data_parallel_size_local=1, headless=True),
     "--data-parallel-start-rank"),  # rank 0 is the API node's
    (dict(data_parallel_size=2, data_parallel_rpc_port=0), "--data-parallel-rpc-port"),
    (dict(headless=True), "--headless"),  # nothing to be headless for
    (dict(data_parallel_size=2, nnodes=2), "--data-parallel-size"),  # a replica across hosts
])
def test_data_parallel_flags_are_checked_by_name(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        EngineArgs(**kw)


def test_data_parallel_flags_accept_vllm_layouts():
    head = EngineArgs(data_parallel_size=4, data_parallel_size_local=2,
                      data_parallel_address="10.0.0.1", data_parallel_rpc_port=13345)
    node = EngineArgs(data_parallel_size=4, data_parallel_size_local=2,
                      data_parallel_start_rank=2, headless=True,
                      data_parallel_address="10.0.0.1", data_parallel_rpc_port=13345)
    assert (head.data_parallel_local, node.data_parallel_local) == (2, 2)
    assert EngineArgs(data_parallel_size=3).data_parallel_local == 3  # default: all local


def test_vllm_short_flags_parse():
    from serving.cli.serve import parse_args
    args = EngineArgs.from_cli_args(parse_args(
        ["-dp", "2", "-dpl", "1", "-dpr", "1", "-dpa", "10.0.0.1", "-dpp", "1234",
         "--headless"]))
    assert (args.data_parallel_size_local, args.data_parallel_start_rank,
            args.data_parallel_address, args.data_parallel_rpc_port) == (1, 1, "10.0.0.1", 1234)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(port: int, **kw) -> EngineArgs:
    return EngineArgs(**{**dict(model="m", max_model_len=32, data_parallel_size=2,
                                data_parallel_size_local=1, data_parallel_rpc_port=port,
                                distributed_timeout_seconds=30), **kw})


class CountingEngine:
    """LLMEngine's calls as the DP engine makes them, without a model: request r's k-th token
    is its last prompt token + k, one per step."""

    model_config = tokenizer = eos_token_ids = generation_defaults = None
    supported_tasks, classifier = ("generate",), None
    startup_times: dict = {}
    alive = True

    def __init__(self):
        self.requests: dict = {}
        self.generated = 0

    def process_prompt(self, prompt, truncate_prompt_tokens=None):
        return None, list(prompt["prompt_token_ids"])

    def add_request(self, request_id, prompt, params=None, priority=0, arrival_time=None):
        ids = prompt["prompt_token_ids"]
        if len(ids) > 32:
            raise ValueError(f"the prompt ({len(ids)} tokens) is longer than max_model_len 32")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.requests[request_id] = (ids, params.max_tokens, [], arrival)

    def abort_request(self, request_ids):
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.requests.pop(rid, None)

    def step(self):
        outs = []
        for rid, (ids, n, tokens, arrival) in list(self.requests.items()):
            tokens.append(ids[-1] + len(tokens) + 1)
            done = len(tokens) == n
            if done:
                del self.requests[rid]
            outs.append(RequestOutput(
                rid, None, ids, None,
                [CompletionOutput(0, "", list(tokens), None, None, "length" if done else None)],
                done, metrics={"arrival_time": arrival, "first_token_time": time.monotonic()}))
        self.generated += len(outs)
        return outs

    def stats(self):
        """An engine's stats: zero but what it counts."""
        return EngineStats(num_running=len(self.requests), num_total_blocks=8,
                           generation_tokens_total=self.generated)

    def get_num_unfinished_requests(self):
        return len(self.requests)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def wait_for_background_compiles(self):
        pass


class _Node:
    """The other node's replica, served from a thread; `lost` records its host_lost call."""

    def __init__(self, args: EngineArgs, monkeypatch):
        self.lost = []
        self.engine = CountingEngine()
        monkeypatch.setattr(replica_node, "host_lost", self.host_lost)
        self.thread = threading.Thread(target=self.serve, args=(args,), daemon=True)
        self.thread.start()

    def serve(self, args):
        try:
            sock = replica_node.connect(args, 1, self.engine, timeout=30)
            replica_node.serve(sock, self.engine, 1)
        except SystemExit:  # from host_lost
            pass

    def host_lost(self, reason):
        self.lost.append(reason)
        raise SystemExit(reason)  # ends the thread, not the test process (as os._exit would)


@pytest.fixture
def pair(monkeypatch):
    """(API node's DP engine, the other node) on one loopback port."""
    port = _free_port()
    node = _Node(_args(port, headless=True, data_parallel_start_rank=1), monkeypatch)
    monkeypatch.setattr(data_parallel, "local_replicas", lambda args: [CountingEngine()])
    engine = data_parallel.DataParallelEngine(_args(port))
    yield engine, node
    engine.close()
    node.thread.join(timeout=10)


def _run(engine, prompts: dict, params) -> dict:
    for rid, p in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    done, failed = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if isinstance(out, ReplicaLostError):
                failed[out.request_id] = str(out)
            elif out.finished:
                done[out.request_id] = out
    return {"done": done, "failed": failed}


def test_remote_replica_serves_like_a_local_one(pair):
    engine, node = pair
    remote = engine.replicas[1]
    assert isinstance(remote, RemoteReplica) and remote.rank == 1
    prompts = {f"r{i}": [5 + i, 17, 99, 3 + i][: 2 + i % 3] for i in range(6)}
    params = SamplingParams(max_tokens=NEW)
    got = _run(engine, prompts, params)
    assert node.engine.generated > 0 and engine.replicas[0].generated > 0  # both served
    per = engine.stats().replicas
    assert per[1].generation_tokens_total == node.engine.generated  # the node's own count
    assert engine.stats().generation_tokens_total == 6 * NEW
    alone = _run(engine.replicas[0], {k: p for k, p in prompts.items()}, params)
    assert ({k: o.outputs[0].token_ids for k, o in got["done"].items()}
            == {k: o.outputs[0].token_ids for k, o in alone["done"].items()})
    for out in got["done"].values():  # timings on this node's clock, in order
        assert out.metrics["arrival_time"] <= out.metrics["first_token_time"] <= time.monotonic()
    assert len(remote.overhead_seconds) > 0


def test_abort_reaches_the_remote_replica(pair):
    engine, node = pair
    params = SamplingParams(max_tokens=NEW)
    engine.add_request("k0", {"prompt_token_ids": [3, 4, 5]}, params)
    engine.add_request("k1", {"prompt_token_ids": [6, 7, 8]}, params)  # the idler replica
    assert engine.replicas[1].get_num_unfinished_requests() == 1 and node.engine.requests
    engine.abort_request(["k0", "k1"])
    assert not engine.has_unfinished_requests() and not node.engine.requests


def test_a_bad_request_is_refused_by_the_remote_replica(pair):
    engine, _ = pair
    remote = engine.replicas[1]
    with pytest.raises(ValueError, match="longer than max_model_len"):
        remote.add_request("bad", {"prompt_token_ids": list(range(3, 60))},
                           SamplingParams(max_tokens=4))
    assert remote.alive and not remote.has_unfinished_requests()


def test_a_node_with_other_engine_arguments_is_refused():
    port = _free_port()
    head_args = _args(port)
    server = listen(head_args)
    errors = []

    def node():
        args = _args(port, headless=True, data_parallel_start_rank=1, max_num_seqs=8)
        try:
            replica_node.connect(args, 1, CountingEngine(), timeout=30)
        except ConfigError as e:
            errors.append(str(e))

    t = threading.Thread(target=node)
    t.start()
    with pytest.raises(ConfigError, match="max_num_seqs"):
        accept_replicas(server, head_args, timeout=30)
    t.join(timeout=30)
    assert errors and "max_num_seqs" in errors[0]


def test_a_lost_node_fails_its_requests_and_the_rest_serve_on(pair):
    engine, node = pair
    remote = engine.replicas[1]
    params = SamplingParams(max_tokens=NEW)
    for i in range(4):  # two per replica (least loaded)
        engine.add_request(f"x{i}", {"prompt_token_ids": [7, 8, 9, i + 3]}, params)
    on_remote = {rid for rid, r in engine.replica_of.items() if r is remote}
    assert len(on_remote) == 2
    engine.step()
    remote.sock.shutdown(socket.SHUT_RDWR)  # the connection dies mid-service
    got = {"done": {}, "failed": {}}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if isinstance(out, ReplicaLostError):
                got["failed"][out.request_id] = str(out)
            elif out.finished:
                got["done"][out.request_id] = out
    assert set(got["failed"]) == on_remote
    assert all("rank 1 is lost" in m for m in got["failed"].values())
    assert set(got["done"]) == {f"x{i}" for i in range(4)} - on_remote
    assert not remote.alive and engine.stats().replicas[1].num_total_blocks == 0
    out = _run(engine, {"y": [5, 6, 7]}, params)  # new requests go to the replica left
    assert len(out["done"]["y"].outputs[0].token_ids) == NEW and engine.replica_of == {}
    node.thread.join(timeout=10)
    assert node.lost  # the node saw its API node go and would exit (HOST_LOST_EXIT)


def test_a_node_lost_while_idle_is_found_at_routing(pair):
    engine, node = pair
    engine.replicas[1].sock.shutdown(socket.SHUT_RDWR)
    engine.add_request("a", {"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=NEW))
    engine.add_request("b", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=NEW))
    assert set(engine.replica_of.values()) == {engine.replicas[0]}  # b rerouted
    got = _run(engine, {}, None)
    assert set(got["done"]) == {"a", "b"} and not got["failed"]
