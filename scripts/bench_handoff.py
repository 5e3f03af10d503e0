"""What handing a pipeline stage's hidden states [T, hidden] to the next stage costs per call:
between two sub-meshes of one process (`jax.device_put`), and between two processes on
loopback (the same `device_put`, over JAX's cross-host transfer server, as
jaxllm/worker/pipeline_runner.py does across hosts).

    python scripts/bench_handoff.py [--tokens 16,256,2048] [--hidden 768] [--calls 50]

It starts its own two processes (4 CPU devices each, 127.0.0.1) and one with 8 devices, and
prints one line per case: the sender's time to issue a call, and the ping-pong round trip
(A -> B -> A, waited for on A) halved, the time a hand-off takes end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, nprocs: int, port: int, sizes: list[int], hidden: int, calls: int):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxllm.parallel import distributed
    from jaxllm.parallel.mesh import absent_array

    if nprocs > 1:
        distributed.initialize(nprocs, rank, "127.0.0.1", port, cross_host_transfers=True)
    devices = jax.devices()
    a, b = (NamedSharding(Mesh(np.array(devices[i * 4:(i + 1) * 4]), ("model",)), P())
            for i in (0, 1))
    mine = lambda s: s.mesh.devices.flat[0].process_index == rank  # noqa: E731
    results = []
    for T in sizes:
        host = np.ones((T, hidden), np.float32)
        x = jax.device_put(host, a) if mine(a) else absent_array(host.shape, host.dtype, a)
        jax.block_until_ready(jax.device_put(jax.device_put(x, b), a))  # connect, warm up
        issue, t = [], time.perf_counter()
        for _ in range(calls):
            t0 = time.perf_counter()
            y = jax.device_put(x, b)
            issue.append(time.perf_counter() - t0)
            x = jax.device_put(y, a)
            jax.block_until_ready(x)
        row = {"T": T, "bytes": host.nbytes, "processes": nprocs,
               "issue_us": float(np.median(issue) * 1e6),
               "one_way_us": (time.perf_counter() - t) / calls / 2 * 1e6}
        results.append(row)
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="16,256,2048")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--worker", nargs=3, type=int, help=argparse.SUPPRESS)  # rank nprocs port
    args = p.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    if args.worker:
        rank, nprocs, port = args.worker
        print(json.dumps(_run(rank, nprocs, port, sizes, args.hidden, args.calls)), flush=True)
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = lambda n: {**os.environ, "JAX_PLATFORMS": "cpu",  # noqa: E731
                     "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}",
                     "PYTHONPATH": os.pathsep.join(filter(None, [root,
                                                                 os.environ.get("PYTHONPATH")]))}
    cmd = lambda *w: [sys.executable, __file__, "--tokens", args.tokens,  # noqa: E731
                      "--hidden", str(args.hidden), "--calls", str(args.calls),
                      "--worker", *map(str, w)]
    port = _free_port()
    for group in ([(0, 1, 0, 8)], [(0, 2, port, 4), (1, 2, port, 4)]):
        procs = [subprocess.Popen(cmd(r, n, pt), env=env(d), stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
                 for r, n, pt, d in group]
        try:
            out = procs[0].communicate(timeout=600)[0]
            for proc in procs[1:]:
                proc.wait(timeout=60)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        # gloo prints its own lines to stdout, some at exit
        for row in json.loads([line for line in out.splitlines() if line.startswith("[{")][-1]):
            print(json.dumps(row))
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
