"""`jaxllm bench {latency, throughput, serve}` with vLLM's option names where they exist."""

from __future__ import annotations

import argparse
import json
import os
import time

from jaxllm.config import EngineArgs


def seconds_since_process_start() -> float:
    """Wall time since this process started (Linux /proc), so start-up includes imports."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="Benchmark latency, throughput or a server.",
                                  description="Benchmark latency, throughput or a server.")
    modes = bench.add_subparsers(dest="bench_mode", required=True)

    lat = modes.add_parser("latency", help="One batch end to end: prefill, decode, percentiles.")
    lat.add_argument("--batch-size", type=int, default=8)
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters-warmup", type=int, default=2)
    lat.add_argument("--num-iters", type=int, default=10)
    _common(lat)
    EngineArgs.add_cli_args(lat)
    lat.set_defaults(func=_latency)

    thr = modes.add_parser("throughput", help="N requests offline: requests/s and tokens/s.")
    thr.add_argument("--num-prompts", type=int, default=64)
    thr.add_argument("--input-len", type=int, default=128)
    thr.add_argument("--output-len", type=int, default=128)
    thr.add_argument("--random-range-ratio", type=float, default=0.0)
    thr.add_argument("--dataset", "--dataset-path", dest="dataset", default=None,
                     help="JSONL ({'prompt': ...}) or ShareGPT JSON file; default random tokens")
    _common(thr)
    EngineArgs.add_cli_args(thr)
    thr.set_defaults(func=_throughput)

    srv = modes.add_parser("serve", help="Load a running OpenAI-compatible server.")
    srv.add_argument("--base-url", default=None, help="default http://HOST:PORT")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--model", default=None, help="model name (default: first in /v1/models)")
    srv.add_argument("--api-key", default="")
    srv.add_argument("--num-prompts", type=int, default=100)
    srv.add_argument("--random-input-len", type=int, default=128)
    srv.add_argument("--random-output-len", type=int, default=128)
    srv.add_argument("--random-range-ratio", type=float, default=0.0)
    srv.add_argument("--request-rate", type=float, default=float("inf"))
    srv.add_argument("--max-concurrency", type=int, default=None)
    srv.add_argument("--goodput", nargs="*", default=[],
                     help="SLOs as KEY:ms with KEY in ttft, tpot, e2el")
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--vocab-size", type=int, default=1000,
                     help="random prompt ids are drawn below this (any BPE vocab has 1000 ids)")
    _common(srv)
    srv.set_defaults(func=_serve)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-json", default=None, help="write the results here as JSON")


def _report(args, results: dict) -> None:
    print(json.dumps(results, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


def _load(args):
    from jaxllm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**{k: getattr(engine_args, k) for k in EngineArgs.__dataclass_fields__})
    startup = dict(llm.llm_engine.startup_times, since_process_start=seconds_since_process_start())
    llm.llm_engine.wait_for_background_compiles()  # measure the steady state
    return llm, engine_args, startup


def _latency(args) -> None:
    from jaxllm.benchmarks.offline import run_latency, spec_decode_summary

    llm, engine_args, startup = _load(args)
    res = run_latency(llm, args.batch_size, args.input_len, args.output_len, args.num_iters,
                      args.num_iters_warmup, engine_args.seed)
    _report(args, {"startup_s": startup, **res, **spec_decode_summary(llm.llm_engine.stats())})


def _throughput(args) -> None:
    from jaxllm.benchmarks.offline import make_requests, run_throughput, spec_decode_summary

    llm, engine_args, startup = _load(args)
    res = run_throughput(llm, make_requests(llm, args, engine_args.seed))
    _report(args, {"startup_s": startup, **res, **spec_decode_summary(llm.llm_engine.stats())})


def _serve(args) -> None:
    import asyncio

    import httpx

    from jaxllm.benchmarks.datasets import random_requests
    from jaxllm.benchmarks.serve import run_serve_benchmark

    base = args.base_url or f"http://{args.host}:{args.port}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or httpx.get(f"{base}/v1/models", headers=headers).json()["data"][0]["id"]
    reqs = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                           args.vocab_size, args.random_range_ratio, seed=args.seed)
    goodput = {k: float(v) for k, v in (g.split(":") for g in args.goodput)}
    res = asyncio.run(run_serve_benchmark(base, model, reqs, request_rate=args.request_rate,
                                          max_concurrency=args.max_concurrency,
                                          api_key=args.api_key, goodput=goodput, seed=args.seed))
    _report(args, res)
