"""Run the same workloads through jaxllm, vLLM-CPU and transformers, alternating, and compare.

    python scripts/compare_peers.py --models smollm2 llama124m --dtypes bfloat16 float32 \
        --workloads throughput decode1 --engines jaxllm vllm hf --reps 3 --output-json out.json

Each engine lives in its own worker process (scripts/peer_worker.py) that loads once. Only one
engine works at a time: idle workers are SIGSTOPped, so the OpenMP threads of an idle engine
cannot spin on the two cores of the engine being measured. Every repetition runs each workload
on each engine once, in an order that rotates, so slow minutes of a noisy machine spread over
all engines; best-of and median are reported. Prompts are seeded random token ids, identical
for every engine; decoding is greedy with ignore_eos and a fixed output length, or, with
--temperature T > 0, sampled at T with top_p 1.0 (as `vllm bench throughput` samples: T 1.0;
jaxllm and vLLM only, and the outputs are then not compared).
Install the peers first with `bash scripts/install_peers.sh`.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_bench_models import DEFAULT_CACHE, DEFAULT_MODELS, MODELS, ensure_models  # noqa: E402
from peer_worker import process_tree  # noqa: E402
from bench_env import (VLLM_PYTHON, log, machine_info, read_bandwidth_gbs,  # noqa: E402
                       vllm_env, weight_bytes_per_token)
from compare_report import METRICS, markdown, summarize  # noqa: E402

ENGINES = ("jaxllm", "vllm", "vllm-eager", "hf", "jaxllm-base")
LIVE_WORKERS: list = []  # closed by main() on any exit: workers run in their own sessions
DEFAULT_SHAPES = {"throughput": (64, 128, 128), "decode1": (1, 128, 128)}  # prompts, in, out


# --- workers ----------------------------------------------------------------------------------

class Worker:
    """A peer_worker.py subprocess: send one command line, wait for one protocol line."""

    def __init__(self, engine: str, model: str, dtype: str, log_path: str, args):
        kind = "vllm" if engine.startswith("vllm") else engine.split("-")[0]
        python = VLLM_PYTHON if kind == "vllm" else sys.executable
        root = args.jaxllm_base if engine == "jaxllm-base" else os.path.dirname(HERE)
        script = os.path.join(root, "scripts", "peer_worker.py")
        cmd = [python, script, "--engine", kind, "--model", model, "--dtype", dtype,
               "--temperature", str(args.temperature)]
        with open(script) as f:  # (a --jaxllm-base checkout's worker may predate the flag)
            if "--min-model-len" in f.read():
                cmd += ["--min-model-len",
                        str(max(i + o for _, i, o in workload_shapes(args).values()))]
        env = dict(os.environ)
        if engine == "jaxllm-base":  # that checkout's jaxllm ahead of the installed one
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
        if kind == "vllm":
            env = vllm_env()
            cmd += ["--engine-args", json.dumps(args.vllm_args)]
            if engine == "vllm-eager":
                cmd.append("--enforce-eager")
        elif kind == "hf":
            cmd += ["--threads", str(args.hf_threads)]
        elif kind == "jaxllm":
            cmd += ["--engine-args", json.dumps(args.jaxllm_args)]
            if args.jaxllm_no_compile_cache:
                env["JAXLLM_CACHE_DIR"] = ""
        env["PYTHONUNBUFFERED"] = "1"
        self.engine, self.log_path, self.stopped = engine, log_path, False
        self.t_spawn = time.perf_counter()
        self.log_file = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log_file, text=True, env=env,
                                     start_new_session=True, cwd=root)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        LIVE_WORKERS.append(self)

    def _read(self) -> None:
        for line in self.proc.stdout:
            kind, _, rest = line.strip().partition(" ")
            if kind in ("READY", "RESULT", "ERROR"):
                self.lines.put((kind, json.loads(rest)))
        self.lines.put(("EXIT", {}))

    def wait(self, timeout: float) -> tuple[str, dict]:
        """The next protocol line; ('ERROR', ...) on exit or timeout."""
        try:
            kind, payload = self.lines.get(timeout=timeout)
        except queue.Empty:
            return "ERROR", {"error": f"no answer within {timeout:.0f} s"}
        if kind == "EXIT":
            return "ERROR", {"error": f"worker exited (code {self.proc.wait()}); see {self.log_path}"}
        return kind, payload

    def signal(self, sig: int) -> None:
        """SIGSTOP/SIGCONT the whole tree: vLLM's engine core and workers are child processes."""
        for pid in process_tree(self.proc.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        self.stopped = sig == signal.SIGSTOP

    def run(self, workload: str, prompts: dict, output_len: int, timeout: float) -> tuple[str, dict]:
        """prompts: {"prompts": [...], "ttft_prompts": [...]} (the latter for decode1 only)."""
        if self.stopped:
            self.signal(signal.SIGCONT)
        self.proc.stdin.write("run " + json.dumps({"workload": workload, **prompts,
                                                   "output_len": output_len}) + "\n")
        self.proc.stdin.flush()
        return self.wait(timeout)

    def close(self) -> None:
        """Ask politely, then kill the worker's process group (vLLM leaves children otherwise)."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.log_file.close()
        if self in LIVE_WORKERS:
            LIVE_WORKERS.remove(self)


def log_tail(path: str, n: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


# --- benchmark ----------------------------------------------------------------------------------

def make_prompts(n: int, length: int, vocab: int, seed: list[int]) -> list[list[int]]:
    """Seeded random ids in [100, min(vocab, 32000)): no special tokens, valid for every model."""
    rng = np.random.default_rng(seed)
    return rng.integers(100, min(vocab, 32000), size=(n, length)).tolist()


def call_prompts(args, vocab: int, shapes: dict, wl: str, rep: int) -> dict:
    """Fresh prompts for every call, the same for every engine. vLLM and jaxllm cache prompt
    prefixes by default, so a repeated prompt would skip its prefill; rep -1 is the warm-up."""
    n, length, _ = shapes[wl]
    k = list(METRICS).index(wl)
    out = {"prompts": make_prompts(n, length, vocab, [args.seed, k, rep + 1, 0])}
    if wl == "decode1":  # TTFT's max_tokens=1 request must not prefill the timed prompt's cache
        out["ttft_prompts"] = make_prompts(1, length, vocab, [args.seed, k, rep + 1, 1])
    return out


def workload_shapes(args) -> dict:
    """(num prompts, input len, output len) per workload, after the CLI overrides."""
    shapes = {}
    for w in args.workloads:
        n, i, o = DEFAULT_SHAPES[w]
        if w == "throughput" and args.num_prompts:
            n = args.num_prompts
        shapes[w] = (n, args.input_len or i, args.output_len or o)
    return shapes


def start_engines(model: str, path: str, dtype: str, args, warm: dict) -> tuple[dict, list]:
    """Start workers one at a time (start-up timed alone), warm each up, then SIGSTOP it."""
    workers, startups = {}, []
    for engine in args.engines:
        log(f"{model} {dtype}: starting {engine}")
        w = Worker(engine, path, dtype, os.path.join(args.log_dir, f"{model}-{dtype}-{engine}.log"),
                   args)
        kind, info = w.wait(args.startup_timeout)
        if kind != "READY":
            log(f"{engine} failed to start: {info.get('error')}\n{log_tail(w.log_path)}")
            startups.append({"model": model, "dtype": dtype, "engine": engine, **info})
            w.close()
            continue
        info["spawn_to_ready_s"] = time.perf_counter() - w.t_spawn
        log(f"{engine} ready: import {info['import_s']:.1f} s, construct {info['construct_s']:.1f} s")
        for wl, (prompts, out_len) in warm.items():
            t = time.perf_counter()
            kind, res = w.run(wl, prompts, out_len, args.run_timeout)
            info.setdefault("warmup_s", {})[wl] = time.perf_counter() - t
            if kind != "RESULT":
                log(f"{engine} warm-up {wl} failed: {res.get('error')}")
        if warm:
            log(f"{engine} warm-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in info["warmup_s"].items()))
        startups.append({"model": model, "dtype": dtype, **info, "engine": engine})
        w.signal(signal.SIGSTOP)
        workers[engine] = w
    return workers, startups


def measure_eager_startup(model: str, path: str, dtype: str, args) -> dict:
    """Start-up only of vLLM with enforce_eager=True (it skips torch.compile)."""
    log(f"{model} {dtype}: starting vllm-eager for its start-up time only")
    w = Worker("vllm-eager", path, dtype, os.path.join(args.log_dir, f"{model}-{dtype}-vllm-eager-startup.log"),
               args)
    kind, info = w.wait(args.startup_timeout)
    if kind == "READY":
        info["spawn_to_ready_s"] = time.perf_counter() - w.t_spawn
    w.close()
    return {"model": model, "dtype": dtype, **info, "engine": "vllm-eager (start-up only)"}


def bench_model_dtype(model: str, path: str, dtype: str, args) -> tuple[list, list, dict]:
    """All reps of all workloads for one model and dtype; returns (startups, runs, tokens)."""
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    shapes = workload_shapes(args)
    warm = {w: (call_prompts(args, vocab, shapes, w, -1), min(args.warmup_tokens, shapes[w][2]))
            for w in shapes}
    startups = []
    if args.vllm_eager and "vllm-eager" not in args.engines:
        startups.append(measure_eager_startup(model, path, dtype, args))
    workers, started = start_engines(model, path, dtype, args, warm if args.warmup_tokens else {})
    startups += started
    runs, tokens = [], {}
    names = list(workers)
    try:
        for rep in range(args.reps):
            for k, wl in enumerate(shapes):
                prompts = call_prompts(args, vocab, shapes, wl, rep)
                shift = (rep * len(shapes) + k) % max(len(names), 1)
                for pos, engine in enumerate(names[shift:] + names[:shift]):
                    w = workers[engine]
                    if w.proc.poll() is not None:
                        continue
                    bw = read_bandwidth_gbs() if wl == "decode1" else None  # all engines stopped
                    t = time.perf_counter()
                    kind, res = w.run(wl, prompts, shapes[wl][2], args.run_timeout)
                    w.signal(signal.SIGSTOP)
                    rec = {"model": model, "dtype": dtype, "workload": wl, "engine": engine,
                           "rep": rep, "position": pos, "wall_s": time.perf_counter() - t}
                    if kind != "RESULT":
                        log(f"{engine} {wl} rep {rep} failed: {res.get('error')}")
                        runs.append({**rec, "error": res.get("error")})
                        continue
                    toks = res.pop("tokens")
                    if bw:
                        res["bandwidth_gbs"] = bw
                        res["bound_fraction"] = (res["decode_tokens_per_s"]
                                                 * weight_bytes_per_token(path, dtype) / (bw * 1e9))
                    tokens[(wl, rep, engine)] = toks
                    if not res["lengths_ok"]:
                        log(f"WARNING: {engine} {wl} did not produce {shapes[wl][2]} tokens per "
                            f"prompt (lengths {sorted({len(x) for x in toks})})")
                    runs.append({**rec, **res})
                    brief = ", ".join(f"{label} {res[key]:.1f}" for key, label, _ in METRICS[wl])
                    log(f"rep {rep} {wl:10s} {engine:10s} {brief}")
        for engine, w in workers.items():  # final peak RSS: the last answer has the process peak
            last = [r for r in runs if r["engine"] == engine and "peak_rss_gib" in r]
            for s in startups:
                if s.get("engine") == engine and last:
                    s["final_peak_rss_gib"] = max(r["peak_rss_gib"] for r in last)
                    s["final_peak_rss_gib_by_process"] = last[-1].get("peak_rss_gib_by_process")
    finally:
        for w in workers.values():
            w.close()
    return startups, runs, tokens


def agreement(tokens: dict, model: str, dtype: str) -> list[dict]:
    """Each engine's greedy tokens against transformers' (or vLLM's when hf is not run), over
    every rep both ran (reps differ in prompts). tokens: {(workload, rep, engine): ids}."""
    out = []
    engines = {k[2] for k in tokens}
    ref = "hf" if "hf" in engines else "vllm" if "vllm" in engines else None
    for wl in sorted({k[0] for k in tokens}):
        for engine in sorted(engines - {ref} if ref else set()):
            reps = sorted(r for (w, r, e) in tokens if w == wl and e == engine
                          and (wl, r, ref) in tokens)
            pairs = [(x, y, r, i) for r in reps for i, (x, y) in
                     enumerate(zip(tokens[(wl, r, engine)], tokens[(wl, r, ref)]))]
            if not pairs:
                continue
            prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                      for x, y, _, _ in pairs]
            bad = [(r, i, p) for (x, y, r, i), p in zip(pairs, prefix) if x != y]
            row = {"model": model, "dtype": dtype, "workload": wl, "engine": engine, "reference": ref,
                   "identical_sequences": len(pairs) - len(bad), "sequences": len(pairs),
                   "mean_common_prefix": float(np.mean(prefix)),
                   "first_mismatch": dict(zip(("rep", "sequence", "position"), bad[0])) if bad else None}
            if bad and dtype == "float32" and engine == "jaxllm":
                log(f"WARNING: jaxllm greedy tokens differ from {ref}'s in float32 ({model} {wl}): "
                    f"{row['identical_sequences']}/{len(pairs)} sequences identical; first mismatch "
                    f"rep {bad[0][0]} sequence {bad[0][1]} at token {bad[0][2]}")
            out.append(row)
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(DEFAULT_MODELS))
    p.add_argument("--dtypes", nargs="+", choices=("bfloat16", "float32"), default=["bfloat16", "float32"])
    p.add_argument("--workloads", nargs="+", choices=tuple(METRICS), default=list(METRICS))
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=["jaxllm", "vllm", "hf"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=None, help="throughput prompts (default 64)")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens (default 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature, top_p 1.0 (default 0: greedy, outputs compared)")
    p.add_argument("--warmup-tokens", type=int, default=8,
                   help="after start-up, run each workload once with this many output tokens "
                        "(untimed; 0 = no warm-up)")
    p.add_argument("--vllm-eager", action="store_true",
                   help="also time the start-up of vLLM with enforce_eager=True (engine "
                        "'vllm-eager' in --engines benchmarks it fully)")
    p.add_argument("--jaxllm-args", type=json.loads, default={},
                   help='extra jaxllm LLM(...) kwargs as JSON, e.g. \'{"max_num_batched_tokens": 512}\'')
    p.add_argument("--vllm-args", type=json.loads, default={}, help="extra vllm LLM(...) kwargs as JSON")
    p.add_argument("--jaxllm-base", default=None,
                   help="engine jaxllm-base runs jaxllm from this checkout (a before/after ratio)")
    p.add_argument("--hf-threads", type=int, default=2, help="torch.set_num_threads for transformers")
    p.add_argument("--jaxllm-no-compile-cache", action="store_true",
                   help="cold jaxllm start-up: disable its executable cache (JAXLLM_CACHE_DIR='')")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE, help="where the model folders are built")
    p.add_argument("--log-dir", default=None, help="worker logs (default /tmp/compare_peers/<time>)")
    p.add_argument("--startup-timeout", type=float, default=1800)
    p.add_argument("--run-timeout", type=float, default=1800)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    args.log_dir = args.log_dir or os.path.join("/tmp", "compare_peers", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(args.log_dir, exist_ok=True)
    return args


def main() -> None:
    """Close every worker however the run ends (Ctrl-C and SIGTERM included): they live in their
    own sessions, so a terminal's Ctrl-C would not reach them and vLLM would linger."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        compare()
    finally:
        for w in list(LIVE_WORKERS):
            w.close()


def compare() -> None:
    args = parse_args()
    if ("jaxllm-base" in args.engines) != bool(args.jaxllm_base):
        sys.exit("engine jaxllm-base and --jaxllm-base DIR go together")
    if args.temperature and "hf" in args.engines:
        sys.exit("--temperature > 0: the hf worker decodes greedily only; drop engine hf")
    machine = machine_info()
    log(f"machine: {machine}")
    log(f"worker logs in {args.log_dir}")
    if machine["loadavg_start"][0] > 0.5 * machine["usable_cores"]:
        log(f"WARNING: load average {machine['loadavg_start'][0]:.1f} on {machine['usable_cores']} "
            "cores: other processes share the CPU, so timings (OpenMP engines most) will be noisy")
    paths = ensure_models(args.models, args.cache_dir)
    startups, runs, agree = [], [], []
    for model in args.models:
        for dtype in args.dtypes:
            s, r, tokens = bench_model_dtype(model, paths[model], dtype, args)
            startups += s
            runs += r
            if not args.temperature:  # sampled outputs are not expected to agree
                agree += agreement(tokens, model, dtype)
    machine["loadavg_end"] = os.getloadavg()
    machine["bandwidth_gbs"] = [round(r["bandwidth_gbs"], 1) for r in runs if "bandwidth_gbs" in r]
    rows = summarize(runs, args.engines)
    table = markdown(machine, args, startups, rows, agree, workload_shapes(args))
    print(table)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"machine": machine, "args": vars(args), "shapes": workload_shapes(args),
                       "startup": startups, "runs": runs, "summary": rows, "agreement": agree,
                       "markdown": table}, f, indent=2)
        log(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
