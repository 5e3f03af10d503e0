"""Data parallelism across processes on loopback (vLLM's --data-parallel-size-local layout):
the API node runs replica 0 and the other process runs replica 1 headless, one CPU device
each. Its greedy tokens equal one process's on one device and one process's DP 2 on two
devices; the head stopping cleanly makes the node exit 0. Through `jaxllm serve`: both nodes'
replicas answer and show in /metrics, and a node that stops answering fails only its own
requests (HTTP 500 naming the lost rank) while the API node serves on.

Every process is a subprocess (this file's __main__, or `jaxllm serve`), each wait bounded;
the tests kill only the processes they started, on ports chosen at run time.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import time

import pytest

from test_multihost import (NEW, _engine_args, _env, _finish, _free_port, _report, _start,
                            stop_all, wait_healthy)


@pytest.fixture(scope="module")
def checkpoint(tiny_llama) -> str:
    return tiny_llama


@pytest.mark.slow
def test_dp2_over_two_processes_matches_one_process(checkpoint):
    port = _free_port()
    dp = dict(data_parallel_size=2, data_parallel_size_local=1, data_parallel_rpc_port=port)
    head, node = _finish([_start("head", checkpoint, 1, __file__, **dp),
                          _start("node", checkpoint, 1, __file__, headless=True,
                                 data_parallel_start_rank=1, **dp)])
    two = _report(head)
    assert node[0] == 0, node[2][-3000:]  # told to stop by the head's clean exit
    one, local = (_report(r) for r in _finish([
        _start("head", checkpoint, 1, __file__),
        _start("head", checkpoint, 2, __file__, data_parallel_size=2)]))
    assert two["tokens"] == one["tokens"] == local["tokens"]
    assert all(len(t) == NEW for t in two["tokens"])
    assert two["remote_requests"] > 0 and two["local_requests"] > 0  # both replicas served
    assert two["stats"]["replicas"][1]["generation_tokens_total"] > 0
    assert two["stats"]["num_preemptions"] > 0  # small caches: recompute on both
    print(f"\nDP 2 over 2 processes: {two['tokens_per_s']:.0f} tokens/s; DP 2 in 1 process "
          f"(2 devices): {local['tokens_per_s']:.0f}; 1 device: {one['tokens_per_s']:.0f}. "
          f"add_request median: local {two['add_us']['local']:.0f} us, remote "
          f"{two['add_us']['remote']:.0f} us; per remote call, beyond the node's engine time: "
          f"{two['rpc_overhead_us']:.0f} us")


def _serve(log, path: str, port: int, rpc_port: int, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "serving.cli.main", "serve", path, "--port", str(port),
           "--dtype", "float32", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
           "--block-size", "4", "--max-model-len", "64", "--attention-backend", "reference",
           "-dp", "2", "-dpl", "1", "-dpa", "127.0.0.1", "-dpp", str(rpc_port),
           "--distributed-timeout-seconds", "15", "--no-use-tqdm-on-load", *flags]
    env = dict(_env(1), JAXLLM_TEST_STEP_DELAY="0.2")  # requests outlive the node's stop
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_server_over_two_nodes_survives_a_lost_node(checkpoint, tmp_path):
    import httpx

    port, rpc = _free_port(), _free_port()
    logs = [open(tmp_path / f"node{i}.log", "w+") for i in (0, 1)]
    head = _serve(logs[0], checkpoint, port, rpc)
    node = _serve(logs[1], checkpoint, _free_port(), rpc, "--headless", "-dpr", "1")
    url = f"http://127.0.0.1:{port}"

    def complete(i: int, new: int = NEW) -> httpx.Response:
        body = {"model": checkpoint, "prompt": [5 + i, 17, 99, 3], "max_tokens": new,
                "temperature": 0.0, "ignore_eos": True}
        return httpx.post(url + "/v1/completions", json=body, timeout=120)

    try:
        wait_healthy(url, [head, node], logs)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(complete, range(4)))
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        metrics = httpx.get(url + "/metrics").text
        assert 'jaxllm:replica_num_requests_running{engine="1"' in metrics
        generated = [line for line in metrics.splitlines()
                     if line.startswith("jaxllm:generation_tokens_total")]
        assert generated and float(generated[0].split()[-1]) == 4 * NEW

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(complete, i, 40) for i in range(4)]
            time.sleep(3.0)  # all four running, on both replicas
            node.send_signal(signal.SIGSTOP)  # hung, not closed: found by the timeout
            t = time.monotonic()
            answers = [f.result() for f in futures]
        failed = [r for r in answers if r.status_code != 200]
        assert failed and len(failed) < 4, [r.text for r in answers]
        assert all(r.status_code == 500 and "rank 1 is lost" in r.json()["error"]["message"]
                   for r in failed)
        assert time.monotonic() - t < 15 + 30
        assert complete(9).status_code == 200  # the API node serves on with replica 0
        assert head.poll() is None
    finally:
        stop_all([head, node], logs)


# --- the processes --------------------------------------------------------------------------

def _args(kw: dict) -> dict:
    return _engine_args({"tensor_parallel_size": 1, **kw})  # test_multihost's, one device


def _head(path: str, kw: dict) -> dict:
    import numpy as np

    from jaxllm import LLM, SamplingParams
    from jaxllm.deploy.remote_replica import RemoteReplica

    llm = LLM(path, **_args(kw))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=int(rng.integers(3, 40))).tolist() for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    engine = llm.llm_engine
    add_us = {"local": [], "remote": []}
    if hasattr(engine, "replicas"):  # time each routing decision and hand-over
        add = engine.add_request

        def timed(rid, *a, **k):
            t = time.perf_counter()
            add(rid, *a, **k)
            kind = "remote" if isinstance(engine.replica_of[rid], RemoteReplica) else "local"
            add_us[kind].append((time.perf_counter() - t) * 1e6)
        engine.add_request = timed
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    counts = {k: len(v) for k, v in add_us.items()}
    engine.wait_for_background_compiles()
    t = time.perf_counter()  # a second, warm run: the throughput the report quotes
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    remote = [r for r in getattr(engine, "replicas", []) if isinstance(r, RemoteReplica)]
    stats = engine.stats().to_dict()
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "stats": stats,
            "local_requests": counts["local"], "remote_requests": counts["remote"],
            "tokens_per_s": len(prompts) * NEW / seconds,
            "add_us": {k: float(np.median(v)) if v else 0.0 for k, v in add_us.items()},
            "rpc_overhead_us": float(np.median(remote[0].overhead_seconds) * 1e6)
            if remote else 0.0}


def _node(path: str, kw: dict) -> int:
    from jaxllm.config import EngineArgs
    from jaxllm.deploy.replica_node import run_dp_node
    return run_dp_node(EngineArgs(model=path, **_args(kw)))


if __name__ == "__main__":
    role, model, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    print(json.dumps(_head(model, extra) if role == "head" else _node(model, extra)),
          flush=True)
