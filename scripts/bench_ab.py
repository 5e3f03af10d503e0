"""Paired A/B of jaxllm checkouts on one model: one worker process per checkout (its tree on
PYTHONPATH), the same seeded prompts, the checkouts taking turns (the order rotating each rep),
and for each workload the wall time and the worker's process CPU time (all its threads), which
the load of other jobs on a shared machine disturbs less. Lighter than compare_peers.py, whose
full llama124m run took ~30 minutes on 2 loaded cores. Workloads: prefill (8 prompts of 128
tokens, 1 output token), through (64 prompts of 16 tokens, 16 output tokens: mostly 64-row
decode steps), ttft (one 128-token prompt, 1 token), decode1 (one prompt, 64 tokens). Prints
each run and, per workload, the median paired ratio of each checkout's time to the last's.

    python scripts/bench_ab.py --trees . /path/to/base --names new base --dtype bfloat16 --reps 3
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

WORKER = r'''
import json, sys, time, os
import numpy as np
from jaxllm import LLM, SamplingParams
model, dtype = sys.argv[1], sys.argv[2]
llm = LLM(model, dtype=dtype, max_model_len=1024, max_num_seqs=64, disable_log_stats=True, seed=0)
try:
    llm.llm_engine.runner.wait_for_background_compiles(load_cached=True)
except Exception:
    pass
rng = np.random.default_rng(0)
def prompts(n, L, seed):
    r = np.random.default_rng(seed)
    return [{"prompt_token_ids": r.integers(100, 31000, L).tolist()} for _ in range(n)]
def run(kind, seed):
    if kind == "prefill": ps, mt = prompts(8, 128, seed), 1
    elif kind == "through": ps, mt = prompts(64, 16, seed), 16
    elif kind == "ttft": ps, mt = prompts(1, 128, seed), 1
    elif kind == "decode1": ps, mt = prompts(1, 128, seed), 64
    p = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=mt)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(ps, p, use_tqdm=False)
    return time.perf_counter() - t0, time.process_time() - c0, sum(len(o.outputs[0].token_ids) for o in outs)
for k in ("prefill", "through", "ttft", "decode1"):
    run(k, 999)
print("READY", flush=True)
for line in sys.stdin:
    kind, seed = line.split()
    w, c, n = run(kind, int(seed))
    print(json.dumps({"kind": kind, "wall": w, "cpu": c, "tokens": n}), flush=True)
'''

ap = argparse.ArgumentParser()
ap.add_argument("--trees", nargs="+", required=True)
ap.add_argument("--names", nargs="+", required=True)
ap.add_argument("--dtype", default="float32")
ap.add_argument("--model", default=os.path.expanduser("~/.cache/jaxllm/bench_models/llama124m"))
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--kinds", nargs="+", default=["prefill", "through", "ttft", "decode1"])
ap.add_argument("--env", default="")
a = ap.parse_args()
procs = {}
for name, tree in zip(a.names, a.trees):
    env = dict(os.environ, PYTHONPATH=tree, PYTHONUNBUFFERED="1")
    for kv in filter(None, a.env.split(",")):
        k, v = kv.split("="); env[k] = v
    procs[name] = subprocess.Popen([sys.executable, "-c", WORKER, a.model, a.dtype], cwd=tree, env=env,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(os.path.join(tempfile.gettempdir(), f"bench_ab_{name}_{a.dtype}.log"), "w"), text=True)
for name, p in procs.items():
    while True:
        l = p.stdout.readline()
        if not l: sys.exit(f"{name} died (its log: {tempfile.gettempdir()}/bench_ab_{name}_{a.dtype}.log)")
        if l.startswith("READY"): break
    print(name, "ready", flush=True)
res = {n: {k: [] for k in a.kinds} for n in a.names}
for rep in range(a.reps):
    for kind in a.kinds:
        order = a.names[rep % len(a.names):] + a.names[:rep % len(a.names)]
        for name in order:
            p = procs[name]
            p.stdin.write(f"{kind} {rep}\n"); p.stdin.flush()
            r = json.loads(p.stdout.readline())
            res[name][kind].append(r)
            print(f"rep {rep} {kind:8s} {name:6s} wall {r['wall']*1e3:8.1f} ms cpu {r['cpu']*1e3:8.1f} ms load {os.getloadavg()[0]:.1f}", flush=True)
print("summary (median over reps; paired ratio of time X/last: >1 = X slower)")
base = a.names[-1]
for kind in a.kinds:
    for m in ("wall", "cpu"):
        y = [r[m] for r in res[base][kind]]
        line = f"{kind:8s} {m:4s}: {base} {statistics.median(y)*1e3:.1f}"
        for n0 in a.names[:-1]:
            x = [r[m] for r in res[n0][kind]]
            ratios = [u / v for u, v in zip(x, y)]
            line += f" | {n0} {statistics.median(x)*1e3:.1f} ratio {statistics.median(ratios):.3f} {[round(r,2) for r in ratios]}"
        print(line)
for p in procs.values(): p.stdin.close(); p.wait()
