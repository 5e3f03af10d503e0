"""Multi-host: two processes on loopback with 4 CPU devices each (and four with 2 each),
joined by jax.distributed (gloo collectives), run one tensor-parallel model over all 8
devices; rank 0 schedules, the other ranks run its steps headless. Its greedy tokens must
equal one process's on 8 devices (same program) and on 1 device, through the engine with
continuous batching, chunked prefill and preemption. Two processes also run a pipeline, one
stage on each, against one process running the same stages. A stopped follower makes rank 0 exit
with HOST_LOST_EXIT instead of hanging.

Every process is a subprocess of this file's __main__ (JAX fixes its devices at import); the
test kills only the processes it started, and each wait is bounded. The API server test runs
`jaxllm serve` on both hosts and stops the follower mid-service.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from jaxllm.parallel.step_channel import HOST_LOST_EXIT

NEW = 10
TIMEOUT = 900  # seconds for a whole run (compiles included): 3-10 min on 2 busy cores
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "JAX_PLATFORMS": "cpu", "JAXLLM_FAIL_ON_RECOMPILE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def _start(role: str, path: str, devices: int, script: str = __file__,
           **kw) -> subprocess.Popen:
    """`script`'s __main__ (this file's by default) as `role`; its output goes to temporary
    files (a full pipe would block a process while the test waits for another)."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, script, role, path, json.dumps(kw)],
                            env=_env(devices), stdout=out, stderr=err)
    proc.logs = (out, err)
    return proc


def _finish(procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> list[tuple]:
    """(returncode, stdout, stderr) of each; all are killed if any overruns the timeout."""
    deadline, results, overran = time.monotonic() + timeout, [], False
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        overran = True
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            texts = []
            for f in p.logs:
                f.seek(0)
                texts.append(f.read())
                f.close()
            results.append((p.returncode, *texts))
    assert not overran, f"over {timeout} s; last stderr:\n" + "\n".join(
        r[2][-1500:] for r in results)
    return results


def _report(result: tuple) -> dict:
    code, stdout, stderr = result
    assert code == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkpoint(make_tiny_checkpoint) -> str:
    # 8 heads and KV heads: attention, MLP and vocabulary all split over the 8 devices
    return make_tiny_checkpoint("llama", num_attention_heads=8, num_key_value_heads=8)


@pytest.fixture(scope="module")
def one_process(checkpoint) -> tuple[dict, dict]:
    """One process's reports: on 8 devices (TP 8, the same program) and on 1."""
    one8, one1 = (_report(r) for r in _finish([_start("leader", checkpoint, 8),
                                                _start("leader", checkpoint, 1,
                                                       tensor_parallel_size=1)]))
    assert one8["devices"] == 8 and one1["devices"] == 1 and one8["processes"] == 1
    return one8, one1


@pytest.mark.slow
@pytest.mark.parametrize("hosts", [2, 4])
def test_hosts_tp8_match_one_process(checkpoint, one_process, hosts):
    """2 processes x 4 devices, and 4 x 2: TP 8 over all of them."""
    port, devices = _free_port(), 8 // hosts
    results = _finish(
        [_start("leader", checkpoint, devices, nnodes=hosts, node_rank=0, master_port=port)]
        + [_start("follower", checkpoint, devices, nnodes=hosts, node_rank=rank,
                  master_port=port, headless=True) for rank in range(1, hosts)],
        timeout=TIMEOUT * hosts / 2)  # each host loads and compiles on the same 2 cores
    assert [r[0] for r in results] == [0] * hosts, "\n".join(
        f"rank {i} (exit {r[0]}): {r[2][-1500:]}" for i, r in enumerate(results))
    many = _report(results[0])
    calls = [int(r[1].strip().splitlines()[-1]) for r in results[1:]]
    one8, one1 = one_process
    assert many["devices"] == 8 and many["processes"] == hosts
    assert many["tokens"] == one8["tokens"] == one1["tokens"]
    assert all(len(t) == NEW for t in many["tokens"])
    assert many["preemptions"] > 0 and many["steps"] > len(many["tokens"])  # batching, preemption
    assert calls == [many["channel_calls"]] * (hosts - 1)  # every follower ran every call
    assert many["channel_calls"] > 0
    print(f"\n{hosts} processes: {many['tokens_per_s']:.0f} tokens/s, channel per call (wall, "
          f"CPU) {many['channel_us'][0]:.0f}, {many['channel_us'][1]:.0f} us; 1 process, 8 "
          f"devices: {one8['tokens_per_s']:.0f} tokens/s; 1 device: "
          f"{one1['tokens_per_s']:.0f} tokens/s")


@pytest.mark.slow
def test_two_hosts_restore_a_sharded_state(checkpoint, one_process, tmp_path):
    """`jaxllm convert` on one device, then 2 processes x 4 devices restore it (each host
    reading the shards of its own devices): the same tokens as the original checkpoint."""
    out = str(tmp_path / "sharded")
    proc = subprocess.run([sys.executable, "-m", "serving.cli.main", "convert", checkpoint, out,
                           "--dtype", "float32"], env=_env(1), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    port = _free_port()
    results = _finish([_start("leader", out, 4, nnodes=2, node_rank=0, master_port=port),
                       _start("follower", out, 4, nnodes=2, node_rank=1, master_port=port,
                              headless=True)])
    assert [r[0] for r in results] == [0, 0], "\n".join(r[2][-1500:] for r in results)
    many = _report(results[0])
    assert many["processes"] == 2 and many["tokens"] == one_process[1]["tokens"]


@pytest.mark.slow
def test_two_hosts_pipeline_match_one_process(checkpoint):
    """Pipeline parallelism across hosts: 2 processes x 4 devices, one stage (TP 4) on each,
    the hidden states and sampled tokens crossing between them; its greedy tokens equal one
    process's running the same PP 2 x TP 4 on 8 devices, and one device's."""
    pp = dict(pipeline_parallel_size=2, tensor_parallel_size=4)
    one_pp, one1 = (_report(r) for r in _finish(
        [_start("leader", checkpoint, 8, **pp),
         _start("leader", checkpoint, 1, tensor_parallel_size=1)]))
    port = _free_port()
    results = _finish([_start("leader", checkpoint, 4, nnodes=2, node_rank=0, master_port=port,
                              **pp),
                       _start("follower", checkpoint, 4, nnodes=2, node_rank=1,
                              master_port=port, headless=True, **pp)])
    assert [r[0] for r in results] == [0, 0], "\n".join(
        f"rank {i} (exit {r[0]}): {r[2][-1500:]}" for i, r in enumerate(results))
    two = _report(results[0])
    assert two["processes"] == 2 and two["stages"] == one_pp["stages"] == 2
    assert two["tokens"] == one_pp["tokens"] == one1["tokens"]
    assert all(len(t) == NEW for t in two["tokens"])
    assert two["preemptions"] > 0 and two["steps"] > len(two["tokens"])
    assert int(results[1][1].strip().splitlines()[-1]) == two["channel_calls"] > 0
    # each host holds one stage, as big as the single process's same stage
    assert [m["host"] for m in two["memory"]] == [0, 1]
    for m, m1 in zip(two["memory"], one_pp["memory"]):
        assert m["weight_bytes_per_device"] == m1["weight_bytes_per_device"] > 0
        assert m["kv_bytes_per_device"] == m1["kv_bytes_per_device"] > 0
    print(f"\n2 hosts, PP 2 x TP 4: {two['tokens_per_s']:.0f} tokens/s; 1 process, same: "
          f"{one_pp['tokens_per_s']:.0f} tokens/s; 1 device: {one1['tokens_per_s']:.0f}")


def wait_healthy(url: str, procs: list[subprocess.Popen], logs: list) -> None:
    """Until `url` answers /health (bounded); fails with a log's tail if a process ends."""
    import httpx

    deadline = time.monotonic() + TIMEOUT
    while True:
        for p, log in zip(procs, logs):
            assert p.poll() is None, open(log.name).read()[-3000:]
        assert time.monotonic() < deadline, open(logs[0].name).read()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1.0)


def _serve(log, path: str, port: int, master_port: int, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "serving.cli.main", "serve", path, "--port", str(port),
           "--dtype", "float32", "-tp", "2", "--max-num-seqs", "4",
           "--max-num-batched-tokens", "16", "--block-size", "4", "--max-model-len", "64",
           "--attention-backend", "reference", "--nnodes", "2", "--master-port",
           str(master_port), "--distributed-timeout-seconds", "20", "--no-use-tqdm-on-load",
           *flags]
    return subprocess.Popen(cmd, env=_env(1), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_server_on_rank_0_and_a_hung_follower(checkpoint, tmp_path):
    """`jaxllm serve` on rank 0 answers with both hosts' devices (one each: TP 2 compiles
    faster than TP 8, and the TP 8 equality is the test above); when the follower stops
    answering (SIGSTOP: stuck, not closed), the request in flight fails with an OpenAI-shaped
    error within the heartbeat timeout and rank 0 exits non-zero instead of hanging."""
    import httpx

    port, master = _free_port(), _free_port()
    logs = [open(tmp_path / f"rank{i}.log", "w+") for i in (0, 1)]
    leader = _serve(logs[0], checkpoint, port, master, "--node-rank", "0")
    follower = _serve(logs[1], checkpoint, _free_port(), master, "--node-rank", "1",
                      "--headless")
    tail = lambda i: open(logs[i].name).read()[-3000:]  # noqa: E731
    url = f"http://127.0.0.1:{port}"
    body = {"model": checkpoint, "prompt": [5, 17, 99, 3], "max_tokens": NEW,
            "temperature": 0.0, "ignore_eos": True}
    try:
        wait_healthy(url, [leader, follower], logs)
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == NEW
        assert r.json()["choices"][0]["finish_reason"] == "length"

        follower.send_signal(signal.SIGSTOP)
        t = time.monotonic()
        r = httpx.post(url + "/v1/completions", json=body, timeout=90)
        assert r.status_code == 500 and "host" in r.json()["error"]["message"], r.text
        assert leader.wait(timeout=60) == HOST_LOST_EXIT
        assert time.monotonic() - t < 20 + 30  # the heartbeat timeout, then a prompt exit
        assert "Host lost" in tail(0)
    finally:
        stop_all([leader, follower], logs)


def stop_all(procs: list[subprocess.Popen], logs: list) -> None:
    """Kill those of `procs` still running (only these: the test started them), close logs."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for f in logs:
        f.close()


# --- the processes --------------------------------------------------------------------------

def _engine_args(kw: dict) -> dict:
    return {**dict(dtype="float32", tensor_parallel_size=8, max_num_seqs=4,
                   max_num_batched_tokens=16, block_size=4, max_model_len=64,
                   num_gpu_blocks_override=24, use_tqdm_on_load=False, seed=0,
                   disable_log_stats=True, attention_backend="reference"), **kw}


def _leader(path: str, kw: dict) -> dict:
    import jax
    import numpy as np

    from jaxllm import LLM, SamplingParams

    llm = LLM(path, **_engine_args(kw))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=int(rng.integers(3, 40))).tolist() for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    engine = llm.llm_engine
    steps = []
    engine.runner.add_step_hook(lambda e: steps.append(e.kind) if e.kind == "dispatch" else None)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine.wait_for_background_compiles()
    t = time.perf_counter()  # a second, warm run: the throughput the report quotes
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    leader = engine.step_leader
    meshes = getattr(engine.runner, "meshes", [engine.runner.mesh])
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "devices": sum(len(m.devices.flat) for m in meshes), "stages": len(meshes),
            "memory": engine.runner.memory_report() if len(meshes) > 1 else None,
            "processes": jax.process_count(),
            "preemptions": engine.stats().num_preemptions, "steps": len(steps),
            "channel_calls": leader.calls if leader else 0,
            "tokens_per_s": len(prompts) * NEW / seconds,
            "channel_us": leader and [float(np.median(leader.call_seconds) * 1e6),
                                      float(np.median(leader.call_cpu_seconds) * 1e6)]}


def _follower(path: str, kw: dict) -> int:
    from jaxllm.config import EngineArgs
    from jaxllm.deploy.follower import run_headless
    return run_headless(EngineArgs(model=path, **_engine_args(kw)))


if __name__ == "__main__":
    role, model, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    print(json.dumps(_leader(model, extra) if role == "leader" else _follower(model, extra)),
          flush=True)
