"""Data parallelism across nodes, in one process: the API node's engine (DP 2, one replica
local) and the other node's replica served from a thread over a real loopback socket, both on
this process's device. Requests routed to the remote replica come back with the tokens the
local one gives; per-replica stats include it; a bad request is refused with the replica's own
error; a node with different engine arguments is refused by name; a lost node fails its
requests with ReplicaLostError while the local replica serves on.

The flags' checks are here too; the two-process runs are in tests/test_multihost.py (slow).
"""

from __future__ import annotations

import socket
import threading

import pytest

from jaxllm import SamplingParams
from jaxllm.config import ConfigError, EngineArgs
from jaxllm.engine import dp_node
from jaxllm.engine.dp_engine import DataParallelEngine
from jaxllm.engine.dp_remote import RemoteReplica
from jaxllm.engine.engine import LLMEngine
from jaxllm.engine.errors import ReplicaLostError

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


def _args(path: str, port: int, **kw) -> EngineArgs:
    return EngineArgs(**{**dict(
        model=path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
        max_model_len=64, num_gpu_blocks_override=24, use_tqdm_on_load=False, seed=0,
        disable_log_stats=True, attention_backend="reference", enforce_eager=True,
        data_parallel_size=2, data_parallel_size_local=1, data_parallel_rpc_port=port,
        distributed_timeout_seconds=30), **kw})


class _Node:
    """The other node's replica, served from a thread; `lost` records its host_lost call."""

    def __init__(self, args: EngineArgs, monkeypatch):
        self.lost = []
        self.engine = LLMEngine(args)
        monkeypatch.setattr(dp_node, "host_lost", self._host_lost)
        self.thread = threading.Thread(target=self._run, args=(args,), daemon=True)
        self.error = None
        self.thread.start()

    def _run(self, args):
        try:
            dp_node.serve(dp_node.connect(args, 1, self.engine, timeout=120), self.engine, 1)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e

    def _host_lost(self, reason):
        self.lost.append(reason)
        raise SystemExit(reason)  # ends the thread, not the test process


def _run(engine, prompts: dict, params) -> dict:
    for rid, p in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    done, failed = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if isinstance(out, ReplicaLostError):
                failed[out.request_id] = str(out)
            elif out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return {"done": done, "failed": failed}


@pytest.fixture(scope="module")
def pair(tiny_llama):
    """(API node's DP engine, the other node) on one loopback port."""
    mp = pytest.MonkeyPatch()
    port = _free_port()
    node_args = _args(tiny_llama, port, headless=True, data_parallel_start_rank=1)
    node = _Node(node_args, mp)
    engine = DataParallelEngine(_args(tiny_llama, port))
    yield engine, node
    engine.close()
    node.thread.join(timeout=10)
    mp.undo()


def test_remote_replica_serves_like_a_local_one(pair):
    engine, node = pair
    assert isinstance(engine.replicas[1], RemoteReplica) and engine.replicas[1].rank == 1
    prompts = {f"r{i}": [5 + i, 17, 99, 3 + i, 42][: 3 + i % 3] for i in range(6)}
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    got = _run(engine, prompts, params)
    per = engine.stats()["replicas"]
    assert per[1]["generation_tokens_total"] > 0 and per[0]["generation_tokens_total"] > 0
    assert engine.stats()["generation_tokens_total"] == 6 * NEW
    # the same prompts on the local replica alone: the same tokens
    alone = _run(engine.replicas[0], {f"a{k}": p for k, p in prompts.items()}, params)
    assert got["done"] == {k[1:]: v for k, v in alone["done"].items()}
    assert all(len(t) == NEW for t in got["done"].values())
    overhead = engine.replicas[1].overhead_seconds
    assert len(overhead) > 0 and all(o >= 0 for o in overhead)


def test_a_bad_request_is_refused_by_the_remote_replica(pair):
    engine, _ = pair
    remote = engine.replicas[1]
    with pytest.raises(ValueError, match="max_model_len|too long|longer"):
        remote.add_request("bad", {"prompt_token_ids": list(range(3, 200))},
                           SamplingParams(max_tokens=4))
    assert remote.alive and not remote.has_unfinished_requests()


def test_abort_reaches_the_remote_replica(pair):
    engine, _ = pair
    params = SamplingParams(temperature=0.0, max_tokens=NEW)
    engine.add_request("k0", {"prompt_token_ids": [3, 4, 5]}, params)
    engine.add_request("k1", {"prompt_token_ids": [6, 7, 8]}, params)  # the idler replica
    assert engine.replicas[1].get_num_unfinished_requests() == 1
    engine.abort_request(["k0", "k1"])
    assert not engine.has_unfinished_requests()
    assert engine.stats()["replicas"][1]["num_waiting"] == 0


def test_a_node_with_other_engine_arguments_is_refused(tiny_llama, monkeypatch):
    port = _free_port()
    head_args = _args(tiny_llama, port)
    from jaxllm.engine.dp_remote import accept_replicas, listen

    server = listen(head_args)
    errors = []

    def node():
        args = _args(tiny_llama, port, headless=True, data_parallel_start_rank=1,
                     max_num_seqs=8)
        engine = type("E", (), {"stats": lambda self: {}})()
        try:
            dp_node.connect(args, 1, engine, timeout=30)
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
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for i in range(4):  # two per replica (least loaded)
        engine.add_request(f"x{i}", {"prompt_token_ids": [7, 8, 9, i + 3]}, params)
    on_remote = {rid for rid, r in engine._replica_of.items() if r is remote}
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
    assert not remote.alive and engine.stats()["replicas"][1]["num_total_blocks"] == 0
    # new requests all go to the replica left
    out = _run(engine, {"y": [5, 6, 7]}, params)
    assert len(out["done"]["y"]) == NEW and engine._replica_of == {}
    node.thread.join(timeout=10)
    assert node.lost  # the node saw its API node go and would exit (HOST_LOST_EXIT)
