"""Data parallelism: the router's choices (prefix affinity, then load), and DP 2 x TP 2 on 8
virtual CPU devices giving the single-device tokens through the engine (continuous batching,
chunked prefill, preemption), with both replicas busy and their stats summed.

The engine run is a subprocess of this file's __main__ (JAX fixes its devices at import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxllm.deploy.router import PrefixAffinityRouter
from jaxllm.engine.stats import EngineStats

NEW = 10


def _load(waiting=0, usage=0.0, running=0):
    return EngineStats(num_waiting=waiting, kv_cache_usage=usage, num_running=running)


def test_router_prefers_the_least_loaded_replica():
    r = PrefixAffinityRouter(block_size=4)
    assert r.choose([1, 2, 3], [_load(2), _load(1), _load(1, 0.5)]) == 1
    assert r.choose([1, 2, 3], [_load(0, 0.3), _load(0, 0.1), _load(0, 0.1, 1)]) == 1


def test_router_keeps_prefix_affinity_until_the_owner_is_much_busier():
    r = PrefixAffinityRouter(block_size=4, slack=2)
    shared = list(range(100, 112))  # three full blocks
    assert r.choose(shared + [1], [_load(1), _load(0)]) == 1
    # Same prefix, replica 0 now idler: affinity wins within the slack ...
    assert r.choose(shared + [2, 3], [_load(0), _load(2)]) == 1
    assert r.affinity_hits == 1
    # ... a different first block has no owner: least loaded
    assert r.choose([9] + shared, [_load(0), _load(2)]) == 0
    # ... and an owner busier than the slack allows loses the request
    assert r.choose(shared, [_load(0), _load(3)]) == 0
    # A prompt shorter than a block has no prefix to keep
    assert r.choose([1, 2], [_load(1), _load(0)]) == 1


def test_router_never_chooses_a_lost_replica():
    r = PrefixAffinityRouter(block_size=4)
    shared = list(range(100, 108))
    assert r.choose(shared, [_load(), _load(1)]) == 0  # replica 0 now owns the prefix
    # lost: neither its prefix nor its lighter load brings it the request
    assert r.choose(shared + [1], [_load(), _load(3)], alive=[False, True]) == 1
    assert r.affinity_hits == 0


def test_router_memory_is_bounded():
    r = PrefixAffinityRouter(block_size=1, capacity=8)
    for i in range(20):
        r.choose([i, i + 1, i + 2], [_load(), _load()])
    assert r.num_remembered_prefixes == 8


def test_metrics_show_each_replica():
    from jaxllm.engine.stats import sum_stats
    from serving.metrics import EngineStatsCollector

    class Engine:
        def stats(self):
            one = EngineStats(num_running=1, num_waiting=2, kv_cache_usage=0.25,
                              num_total_blocks=8)
            two = EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.75,
                              num_total_blocks=8)
            return sum_stats([one, two])

    families = {m.name: m for m in EngineStatsCollector(Engine(), "m").collect()}
    assert families["jaxllm:num_requests_running"].samples[0].value == 4  # the total
    running = families["jaxllm:replica_num_requests_running"].samples
    assert [(s.labels["engine"], s.value) for s in running] == [("0", 1), ("1", 3)]
    usage = families["jaxllm:replica_kv_cache_usage_perc"].samples
    assert [s.value for s in usage] == [0.25, 0.75]


def _dp_against_one_device(path: str, dp: dict) -> tuple[dict, dict]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu", "JAXLLM_FAIL_ON_RECOMPILE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, __file__, path, json.dumps(dp)], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    dp, one = report["dp"], report["one"]
    assert dp["tokens"] == one["tokens"]
    assert all(len(t) == NEW for t in dp["tokens"])
    assert dp["devices"] == [[0, 1], [2, 3]]  # each replica on its own TP=2 sub-mesh
    per = dp["stats"]["replicas"]
    assert all(s["generation_tokens_total"] > 0 for s in per)  # both replicas served
    assert dp["stats"]["generation_tokens_total"] == sum(s["generation_tokens_total"]
                                                         for s in per)
    assert dp["stats"]["num_preemptions"] > 0  # the small caches forced recompute
    assert dp["stats"]["prefix_affinity_hits"] >= 2  # the prompts sharing a prefix: together
    return dp, one


@pytest.mark.slow
def test_dp2_tp2_matches_single_device(tiny_llama):
    _dp_against_one_device(tiny_llama, dict(data_parallel_size=2, tensor_parallel_size=2))


@pytest.mark.slow
def test_dp2_with_expert_parallel_matches_single_device(make_tiny_checkpoint):
    """Mixtral (8 experts, top 2): each replica shards its experts over its 2 devices."""
    dp, _ = _dp_against_one_device(make_tiny_checkpoint("mixtral"), dict(
        data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True))
    assert dp["experts_spec"] == [None, "model", None, None, None]


def _run(path: str, **kw) -> dict:
    import numpy as np

    from jaxllm import LLM, SamplingParams

    llm = LLM(path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
              max_model_len=64, num_gpu_blocks_override=20, use_tqdm_on_load=False, seed=0,
              disable_log_stats=True, attention_backend="reference", **kw)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=int(rng.integers(3, 40))).tolist() for _ in range(10)]
    shared = rng.integers(3, 500, size=16).tolist()
    prompts += [shared + [i + 3] for i in range(3)]  # a common prefix of four blocks
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = llm.llm_engine
    replicas = getattr(engine, "replicas", [engine])
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "stats": engine.stats().to_dict(),
            "devices": [[d.id for d in r.runner.mesh.devices.flat] for r in replicas],
            "experts_spec": _experts_spec(replicas[0])}


def _experts_spec(engine):
    """The sharding of the first MoE layer's expert weights (None for a dense model)."""
    from flax import nnx

    for path, var in nnx.to_flat_state(engine.runner.state):
        if path[-1] == "experts_gate_up":
            spec = list(var[...].sharding.spec)
            return spec + [None] * (5 - len(spec))
    return None


if __name__ == "__main__":
    print(json.dumps({"dp": _run(sys.argv[1], **json.loads(sys.argv[2])),
                      "one": _run(sys.argv[1])}))
