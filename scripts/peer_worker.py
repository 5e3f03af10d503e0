"""One long-lived engine process for scripts/compare_peers.py: load once, then serve timed runs.

    python scripts/peer_worker.py --engine {jaxllm,vllm,hf} --model DIR --dtype float32

Protocol (one line each way, JSON after the keyword):
  worker -> `READY {"import_s": ..., "construct_s": ..., ...}` once the engine is built;
  controller -> `run {"workload": "throughput"|"decode1", "prompts": [[ids]...], "output_len": N}`
                (decode1 also takes "ttft_prompts": [[ids]] for its max_tokens=1 request);
  worker -> `RESULT {...timings, output token ids, peak RSS...}` (or `ERROR {...}`);
  controller -> `quit`.
Runs under the main Python (jaxllm, hf) or /opt/vllm-venv/bin/python (vllm), so it imports
nothing from jaxllm at module level. Everything the libraries print goes to stderr: the real
stdout is kept for protocol lines only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback

_PROTO = sys.stdout  # replaced by protect_stdout() in main()


def protect_stdout() -> None:
    """Keep fd 1 for protocol lines; point fd 1 (inherited by C code and children) at stderr."""
    global _PROTO
    _PROTO = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def send(kind: str, payload: dict) -> None:
    _PROTO.write(f"{kind} {json.dumps(payload)}\n")
    _PROTO.flush()


def seconds_since_process_start() -> float:
    """Wall time since this process started (Linux /proc): interpreter start-up included."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (vLLM runs its engine core in a child process)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _status_kib(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def memory_gib() -> dict:
    """Peak and current RSS summed over the process tree (shared pages count once per process)."""
    tree = process_tree(os.getpid())
    return {"peak_rss_gib": sum(_status_kib(p, "VmHWM") for p in tree) / 2**20,
            "rss_gib": sum(_status_kib(p, "VmRSS") for p in tree) / 2**20,
            "self_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "peak_rss_gib_by_process": {f"{_name(p)}[{p}]": round(_status_kib(p, "VmHWM") / 2**20, 3)
                                        for p in tree}}


# --- engines: each builds itself and offers generate(prompts, max_tokens) -> token id lists ----

def model_len(args, default: int) -> int:
    """--max-model-len, else the engine's default raised to what the runs will ask for: a
    prompt at the model length leaves room for one output token, which no run means to time."""
    return args.max_model_len or max(default, args.min_model_len)


class JaxllmEngine:
    def __init__(self, args):
        t = time.perf_counter()
        import jax  # noqa: F401  (counted as import time, not as engine construction)
        from jaxllm import LLM, SamplingParams
        self.import_s = time.perf_counter() - t
        self.SamplingParams = SamplingParams
        self.temperature = args.temperature
        t = time.perf_counter()
        kw = dict(dtype=args.dtype, max_model_len=model_len(args, 1024),
                  max_num_seqs=args.max_num_seqs, disable_log_stats=True, seed=0)
        self.llm = LLM(args.model, **{**kw, **args.engine_args})
        self.construct_s = time.perf_counter() - t
        self.detail = {k: round(v, 3) for k, v in self.llm.llm_engine.startup_times.items()}
        self.detail["jax_version"] = jax.__version__
        self.llm.llm_engine.runner.wait_for_background_compiles(load_cached=True)  # before any timed run
        compiled = self.llm.llm_engine.runner.compile_manager
        self.detail["programs_from_cache"] = compiled.programs_from_cache

    def generate(self, prompts, max_tokens):
        p = self.SamplingParams(temperature=self.temperature, top_p=1.0, ignore_eos=True,
                                max_tokens=max_tokens)
        outs = self.llm.generate([{"prompt_token_ids": x} for x in prompts], p, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


class VllmEngine:
    def __init__(self, args):
        t = time.perf_counter()
        import vllm
        from vllm import LLM, SamplingParams
        self.import_s = time.perf_counter() - t
        self.SamplingParams = SamplingParams
        self.temperature = args.temperature
        t = time.perf_counter()
        kw = dict(dtype=args.dtype, max_model_len=model_len(args, 2048), seed=0,
                  enforce_eager=args.enforce_eager, disable_log_stats=True)
        self.llm = LLM(model=args.model, **{**kw, **args.engine_args})
        self.construct_s = time.perf_counter() - t
        self.detail = {"vllm_version": vllm.__version__, "enforce_eager": args.enforce_eager,
                       **{k: os.environ.get(k, "") for k in (
                           "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")}}

    def generate(self, prompts, max_tokens):
        p = self.SamplingParams(temperature=self.temperature, top_p=1.0, ignore_eos=True,
                                max_tokens=max_tokens)
        outs = self.llm.generate([{"prompt_token_ids": x} for x in prompts], p, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


class HfEngine:
    def __init__(self, args):
        t = time.perf_counter()
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
        self.import_s = time.perf_counter() - t
        torch.set_num_threads(args.threads)
        self.torch = torch
        t = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype),
                                                          **args.engine_args)
        self.model.eval()
        self.temperature = args.temperature
        gc = self.model.generation_config
        gc.eos_token_id = None  # every row makes exactly max_new_tokens tokens
        gc.pad_token_id = 0
        gc.temperature, gc.top_p, gc.top_k = None, None, None  # silence greedy-vs-sampling warnings
        self.construct_s = time.perf_counter() - t
        self.detail = {"torch_version": torch.__version__,
                       "transformers_version": transformers.__version__,
                       "threads": torch.get_num_threads()}

    def generate(self, prompts, max_tokens):
        if self.temperature:
            raise ValueError("hf worker decodes greedily only (--temperature 0)")
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("hf worker batches prompts of one length only (no padding)")
        ids = self.torch.tensor(prompts, dtype=self.torch.long)
        with self.torch.inference_mode():
            out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids),
                                      max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                      do_sample=False)
        return out[:, ids.shape[1]:].tolist()


ENGINES = {"jaxllm": JaxllmEngine, "vllm": VllmEngine, "hf": HfEngine}


# --- workloads --------------------------------------------------------------------------------

def timed(engine, prompts, max_tokens):
    t = time.perf_counter()
    tokens = engine.generate(prompts, max_tokens)
    return time.perf_counter() - t, tokens


def run_throughput(engine, w: dict) -> dict:
    """All prompts at once: output and total tokens per second."""
    elapsed, tokens = timed(engine, w["prompts"], w["output_len"])
    n_out = sum(len(t) for t in tokens)
    n_in = sum(len(p) for p in w["prompts"])
    return {"elapsed_s": elapsed, "output_tokens": n_out, "prompt_tokens": n_in,
            "output_tokens_per_s": n_out / elapsed, "total_tokens_per_s": (n_in + n_out) / elapsed,
            "tokens": tokens}


def run_decode1(engine, w: dict) -> dict:
    """Batch 1: TTFT = a max_tokens=1 request; TPOT = (t(N) - t(1)) / (N - 1). The max_tokens=1
    request uses its own prompt of the same length, so its prefill is not prefix-cached for t(N)."""
    prompts, n = w["prompts"][:1], w["output_len"]
    t1, _ = timed(engine, w.get("ttft_prompts", prompts)[:1], 1)
    tn, tokens = timed(engine, prompts, n)
    tpot = (tn - t1) / max(n - 1, 1)
    return {"ttft_ms": t1 * 1e3, "e2e_s": tn, "tpot_ms": tpot * 1e3,
            "decode_tokens_per_s": 1.0 / tpot if tpot > 0 else float("inf"),
            "output_tokens": sum(len(t) for t in tokens), "tokens": tokens}


WORKLOADS = {"throughput": run_throughput, "decode1": run_decode1}


def serve(engine) -> None:
    for line in sys.stdin:
        cmd, _, rest = line.strip().partition(" ")
        if cmd == "quit":
            return
        if cmd != "run":
            send("ERROR", {"error": f"unknown command {cmd!r}"})
            continue
        try:
            w = json.loads(rest)
            res = WORKLOADS[w["workload"]](engine, w)
            res["lengths_ok"] = all(len(t) == w["output_len"] for t in res["tokens"])
            send("RESULT", {"workload": w["workload"], **res, **memory_gib()})
        except Exception as e:  # report and keep serving: one failed run should not end the process
            traceback.print_exc()
            send("ERROR", {"error": f"{type(e).__name__}: {e}"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=sorted(ENGINES), required=True)
    parser.add_argument("--model", required=True, help="HF safetensors folder with a tokenizer")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default 1024 for jaxllm, 2048 for vllm (or --min-model-len)")
    parser.add_argument("--min-model-len", type=int, default=0,
                        help="the longest prompt + output of the runs to come")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="jaxllm only")
    parser.add_argument("--enforce-eager", action="store_true", help="vllm only")
    parser.add_argument("--threads", type=int, default=2, help="hf only: torch threads")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (top_p 1.0); 0: greedy (hf: greedy only)")
    parser.add_argument("--engine-args", type=json.loads, default={},
                        help="JSON object of extra keyword arguments for the engine constructor")
    args = parser.parse_args()
    protect_stdout()
    try:
        engine = ENGINES[args.engine](args)
    except Exception as e:
        traceback.print_exc()
        send("ERROR", {"error": f"start-up failed: {type(e).__name__}: {e}"})
        sys.exit(1)
    send("READY", {"engine": args.engine, "import_s": engine.import_s,
                   "construct_s": engine.construct_s,
                   "process_start_to_ready_s": seconds_since_process_start(),
                   "detail": engine.detail, **memory_gib()})
    serve(engine)


if __name__ == "__main__":
    main()
