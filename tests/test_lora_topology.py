"""LoRA adapters under data parallelism and pipeline parallelism (issue 46's topologies).

Default (no model): the data-parallel engine over a local replica and one on another "node"
served from a thread over a real loopback socket (each a `LoraCountingEngine`: LLMEngine's
LoRA calls, recorded), as tests/test_dp_remote.py does without LoRA: a request's adapter
reaches the replica that runs it, remote included; add_lora / remove_lora reach every
replica, and a replica's refusal undoes the others' registration; the router roots prefix
affinity at the adapter; the replicas' adapter stats are merged.

Slow (real engines, a subprocess of two virtual CPU devices): DP 2 and PP 2, with three
adapters and the base model in one batch over two slots, give the single-engine tokens and
logprobs (which tests/test_lora.py checks against transformers + peft).
"""

from __future__ import annotations

import json
import os
import sys
import threading

import numpy as np
import pytest

from jaxllm import LoRARequest, SamplingParams
from jaxllm.config import ConfigError, EngineArgs
from jaxllm.deploy import data_parallel, replica_node
from jaxllm.deploy.remote_replica import RemoteReplica
from jaxllm.deploy.router import PrefixAffinityRouter
from jaxllm.engine.stats import EngineStats, LoraStats
from test_dp_remote import CountingEngine, _args, _free_port

NEW = 6


class LoraCountingEngine(CountingEngine):
    """CountingEngine with LLMEngine's LoRA calls: adapters registered by add_lora or by a
    request's first use, each request's adapter recorded; a folder named 'unreadable' is
    refused as a bad adapter is."""

    def __init__(self, unreadable: str = "unreadable"):
        super().__init__()
        self.loras: dict[int, LoRARequest] = {}
        self.adapter_of: dict[str, LoRARequest] = {}
        self.unreadable = unreadable

    def add_request(self, request_id, prompt, params=None, priority=0, arrival_time=None,
                    lora_request=None):
        if lora_request is not None:
            self.add_lora(lora_request)
            self.adapter_of[request_id] = lora_request
        super().add_request(request_id, prompt, params, priority, arrival_time)

    def add_lora(self, req: LoRARequest) -> bool:
        if req.lora_path == self.unreadable:
            raise ValueError(f"LoRA adapter {req.lora_name!r} ({req.lora_path}): no "
                             f"adapter_config.json")
        new = req.lora_int_id not in self.loras
        self.loras[req.lora_int_id] = req
        return new

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.loras.pop(lora_int_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self.loras)

    def stats(self):
        running = tuple(sorted({self.adapter_of[r].lora_name for r in self.requests
                                if r in self.adapter_of}))
        return EngineStats(num_running=len(self.requests), num_total_blocks=8,
                           generation_tokens_total=self.generated,
                           lora=LoraStats(running, (), 2))


@pytest.fixture
def lora_pair(monkeypatch):
    """(the API node's DP engine, the other node's engine) on one loopback port."""
    port = _free_port()
    remote = LoraCountingEngine()

    def serve():
        sock = replica_node.connect(_args(port, headless=True, data_parallel_start_rank=1),
                                    1, remote, timeout=30)
        replica_node.serve(sock, remote, 1)

    monkeypatch.setattr(replica_node, "host_lost", lambda reason: (_ for _ in ()).throw(
        SystemExit(reason)))
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    monkeypatch.setattr(data_parallel, "local_replicas", lambda args: [LoraCountingEngine()])
    engine = data_parallel.DataParallelEngine(_args(port))
    yield engine, remote
    engine.close()
    thread.join(timeout=10)


def test_requests_carry_their_adapter_to_the_replica_that_runs_them(lora_pair):
    engine, remote = lora_pair
    local = engine.replicas[0]
    assert isinstance(engine.replicas[1], RemoteReplica)
    a, b = LoRARequest("a", 1, "/ad/a"), LoRARequest("b", 2, "/ad/b")
    params = SamplingParams(max_tokens=NEW)
    adapters = {"r0": a, "r1": b, "r2": None, "r3": a}
    for i, (rid, req) in enumerate(adapters.items()):
        engine.add_request(rid, {"prompt_token_ids": [10 + i, 11, 12]}, params,
                           lora_request=req)
    where = {rid: "remote" if r is engine.replicas[1] else "local"
             for rid, r in engine.replica_of.items()}
    assert set(where.values()) == {"local", "remote"}  # both replicas took requests
    for rid, req in adapters.items():
        ran = (remote if where[rid] == "remote" else local).adapter_of.get(rid)
        assert ran == req and (ran is None or ran.lora_path == req.lora_path), rid
    # a request's adapter registers on its own replica only; the engine knows them all
    assert engine.list_loras() == {1, 2}
    stats = engine.stats()
    assert set(stats.lora.running) == {"a", "b"} and stats.lora.max_lora == 2
    assert stats.lora.running == tuple(sorted(set(stats.replicas[0].lora.running)
                                              | set(stats.replicas[1].lora.running)))
    done = set()
    while engine.has_unfinished_requests():
        done |= {o.request_id for o in engine.step() if o.finished}
    assert done == set(adapters)


def test_load_and_unload_reach_every_replica(lora_pair):
    engine, remote = lora_pair
    local = engine.replicas[0]
    sql = LoRARequest("sql", 7, "/ad/sql")
    assert engine.add_lora(sql) is True
    assert 7 in local.loras and 7 in remote.loras and engine.list_loras() == {7}
    assert engine.add_lora(sql) is False  # every replica had it
    # one name or id is one adapter across the replicas
    with pytest.raises(ValueError, match="same name or id"):
        engine.add_lora(LoRARequest("sql", 8, "/ad/other"))
    with pytest.raises(ValueError, match="same name or id"):
        engine.add_request("x", {"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=2),
                           lora_request=LoRARequest("chat", 7, "/ad/chat"))
    assert engine.remove_lora(7) is True
    assert 7 not in local.loras and 7 not in remote.loras and engine.list_loras() == set()
    assert engine.remove_lora(7) is False
    # the other node refuses an adapter (it cannot read the folder): the local replica,
    # which took it, forgets it again, and the refusal reaches the caller with its reason
    remote.unreadable = "/only/here"
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.add_lora(LoRARequest("here", 9, "/only/here"))
    assert 9 not in local.loras and engine.list_loras() == set()


def test_topologies_with_lora_accepted_or_refused_by_name():
    """DP, PP and several hosts take --enable-lora; the pooling runner still does not."""
    assert EngineArgs(enable_lora=True, data_parallel_size=2).data_parallel_size == 2
    assert EngineArgs(enable_lora=True, pipeline_parallel_size=2).pipeline_parallel_size == 2
    assert EngineArgs(enable_lora=True, nnodes=2).nnodes == 2
    for kw in (dict(runner="pooling"), dict(convert="embed")):
        with pytest.raises(ConfigError, match="--runner.*with --enable-lora is not implemented"):
            EngineArgs(enable_lora=True, **kw)


def test_router_roots_prefix_affinity_at_the_adapter():
    def load(waiting=0):
        return EngineStats(num_waiting=waiting)

    r = PrefixAffinityRouter(block_size=4, slack=2)
    prompt = list(range(100, 112))  # three full blocks
    assert r.choose(prompt, [load(1), load(0)], root=("a", 1, "/a")) == 1
    # the same prompt and adapter: kept with its blocks within the slack
    assert r.choose(prompt, [load(0), load(1)], root=("a", 1, "/a")) == 1
    assert r.affinity_hits == 1
    # under another adapter (or none) no replica holds its blocks: the least loaded
    assert r.choose(prompt, [load(0), load(1)], root=("b", 2, "/b")) == 0
    assert r.choose(prompt, [load(1), load(0)]) == 1
    assert r.choose(prompt, [load(0), load(1)], root=("b", 2, "/b")) == 0
    assert r.affinity_hits == 2


def test_a_stage_gets_its_own_layers_of_an_adapter():
    """An adapter in slot layout, keyed by the model's layer groups, cut to a stage: a stage
    running the last layer of group 0 and the first two of group 1 (`stage_cuts`) gets
    those layers, keyed by its own groups 0 and 1; other groups' projections are absent."""
    from jaxllm.models.pipeline_stage import stage_lora_share

    def ab(L, tag):
        return (np.full((L, 4, 2), tag, np.float32) + np.arange(L)[:, None, None],
                np.full((L, 2, 4), -tag, np.float32) - np.arange(L)[:, None, None])

    weights = {(0, "qkv"): ab(3, 10), (1, "qkv"): ab(4, 20), (1, "down"): ab(4, 30),
               (2, "o"): ab(2, 40)}
    share = stage_lora_share(weights, [(0, 2, 3), (1, 0, 2)])
    assert set(share) == {(0, "qkv"), (1, "qkv"), (1, "down")}
    for (j, proj), (i, lo, hi) in (((0, "qkv"), (0, 2, 3)), ((1, "qkv"), (1, 0, 2)),
                                   ((1, "down"), (1, 0, 2))):
        for got, whole in zip(share[(j, proj)], weights[(i, proj)]):
            np.testing.assert_array_equal(got, whole[lo:hi])


# --- real engines: DP 2 and PP 2 against one engine (slow) ------------------------------------

@pytest.fixture(scope="module")
def topology_runs(tiny_llama, tmp_path_factory):
    """One subprocess of two virtual devices: the single engine, DP 2 and PP 2 runs."""
    from conftest import run_with_host_devices
    from lora_adapters import ADAPTERS, make_adapters

    adapters = make_adapters(tiny_llama, str(tmp_path_factory.mktemp("lora_topo")))
    paths = {name: adapters[name][0] for name in ADAPTERS}
    proc = run_with_host_devices(2, [__file__, json.dumps([tiny_llama, paths])])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _same_outputs(got: dict, want: dict) -> None:
    assert len(got["outputs"]) == len(want["outputs"])
    for i, (a, b) in enumerate(zip(got["outputs"], want["outputs"])):
        assert a["adapter"] == b["adapter"]
        assert a["tokens"] == b["tokens"], (i, a["adapter"])
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-4,
                                   err_msg=str((i, a["adapter"])))
    # the adapters change the outputs (else equal outputs would prove little): the last
    # prompt, under the base and each adapter, continues four ways
    assert len({tuple(o["tokens"]) for o in want["outputs"][-4:]}) == 4


@pytest.mark.slow  # three engines in a subprocess of two virtual devices (~60 s)
def test_lora_data_parallel_matches_one_engine(topology_runs):
    dp = topology_runs["dp"]
    _same_outputs(dp, topology_runs["one"])
    assert all(n > 0 for n in dp["tokens_per_replica"])  # both replicas served
    assert dp["adapters_per_replica"] and all(dp["adapters_per_replica"])
    # add_lora / remove_lora on the DP engine reached every replica
    assert dp["loaded_everywhere"] and dp["unloaded_everywhere"]


@pytest.mark.slow  # shares topology_runs' subprocess
def test_lora_pipeline_parallel_matches_one_engine(topology_runs):
    pp = topology_runs["pp"]
    _same_outputs(pp, topology_runs["one"])
    assert pp["stages"] == 2
    # each stage holds the slots of its own layers only
    assert pp["stage_slot_layers"] == [[1], [1]]


def _child(base: str, paths: dict, runs: tuple = ("one", "dp", "pp")) -> dict:
    from jaxllm import LLM

    reqs = {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(paths.items())}
    names = [None, *paths] * 3
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=int(rng.integers(4, 20))).tolist() for _ in names]
    prompts[-4:] = [prompts[-1]] * 4  # one prompt under the base and each adapter
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=0, ignore_eos=True)
    report = {}
    for run, kw in (("one", {}), ("dp", dict(data_parallel_size=2)),
                    ("pp", dict(pipeline_parallel_size=2))):
        if run not in runs:
            continue
        llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
                  max_num_seqs=4, max_num_batched_tokens=32, block_size=4, seed=0,
                  use_tqdm_on_load=False, disable_log_stats=True, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                            lora_request=[reqs.get(n) for n in names], use_tqdm=False)
        r = report[run] = {"outputs": [
            {"adapter": n, "tokens": list(o.outputs[0].token_ids),
             "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                         o.outputs[0].token_ids)]}
            for n, o in zip(names, outs)]}
        engine = llm.llm_engine
        if run == "dp":
            r["tokens_per_replica"] = [s.generation_tokens_total
                                       for s in engine.stats().replicas]
            r["adapters_per_replica"] = [sorted(x.list_loras()) for x in engine.replicas]
            extra = LoRARequest("extra", 99, paths["qv"])
            engine.add_lora(extra)
            r["loaded_everywhere"] = all(99 in x.list_loras() for x in engine.replicas)
            engine.remove_lora(99)
            r["unloaded_everywhere"] = all(99 not in x.list_loras() for x in engine.replicas)
        if run == "pp":
            runner = engine.runner
            r["stages"] = runner.num_stages
            r["stage_slot_layers"] = [
                sorted({int(g["qkv_lora_a"].shape[0]) for g in st["layers"].values()})
                for st in runner.stage_states]
        del llm, engine
    return report


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps(_child(*json.loads(sys.argv[1]))))
