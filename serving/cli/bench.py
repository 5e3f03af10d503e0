"""`jaxllm bench {latency, throughput, serve}` with vLLM's option names where they exist.

Each prints vLLM's human-readable result table; the JSON goes to a file, as vLLM's: --output-json
for latency and throughput, --save-result [--result-dir D] [--result-filename F] for serve
(where --output-json PATH works too).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from datetime import datetime

from jaxllm.config import EngineArgs


# --- options -----------------------------------------------------------------------------------

@functools.cache
def engine_defaults() -> dict:
    return {f.name: f.default for f in dataclasses.fields(EngineArgs)
            if f.default is not dataclasses.MISSING}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, the engine flags' too: those parse to SUPPRESS (so that
    EngineArgs keeps its own defaults), so theirs is read from EngineArgs. A help text that
    already names its default, or a None default (decided at run time), is left as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is argparse.SUPPRESS:
            default = engine_defaults().get(action.dest)
        if default is None or "default" in text.lower() or not action.option_strings:
            return text
        return f"{text} (default: {str(default).replace('%', '%%')})"


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="Benchmark latency, throughput or a server.",
                                  description="Benchmark latency, throughput or a server.")
    modes = bench.add_subparsers(dest="bench_mode", required=True)
    _register_latency(modes)
    _register_throughput(modes)
    _register_serve(modes)


def _mode(modes, name: str, text: str) -> argparse.ArgumentParser:
    return modes.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)


def _register_latency(modes) -> None:
    lat = _mode(modes, "latency", "One batch end to end: prefill, decode, percentiles.")
    lat.add_argument("--batch-size", type=int, default=8, help="Prompts run as one batch.")
    lat.add_argument("--input-len", type=int, default=32,
                     help="Prompt length in tokens (random token ids).")
    lat.add_argument("--output-len", type=int, default=128,
                     help="Tokens generated per prompt (EOS ignored).")
    lat.add_argument("--num-iters-warmup", type=int, default=2,
                     help="Untimed runs of the batch before the timed ones.")
    lat.add_argument("--num-iters", type=int, default=10,
                     help="Timed runs of the batch (and as many prefill-only runs).")
    _output_json(lat)
    EngineArgs.add_cli_args(lat)
    lat.set_defaults(func=_latency)


def _register_throughput(modes) -> None:
    thr = _mode(modes, "throughput", "N requests offline: requests/s and tokens/s.")
    thr.add_argument("--num-prompts", type=int, default=64,
                     help="Requests, all submitted at once.")
    thr.add_argument("--input-len", type=int, default=128,
                     help="Prompt length in tokens of the random prompts (not with --dataset).")
    thr.add_argument("--output-len", type=int, default=128,
                     help="Tokens generated per request (EOS ignored).")
    _range_ratio(thr)
    thr.add_argument("--dataset", "--dataset-path", dest="dataset", default=None,
                     help="JSONL ({'prompt': ...}) or ShareGPT JSON file (default: random "
                          "token prompts).")
    _output_json(thr)
    EngineArgs.add_cli_args(thr)
    thr.set_defaults(func=_throughput)


def _register_serve(modes) -> None:
    srv = _mode(modes, "serve", "Load a running OpenAI-compatible server.")
    srv.add_argument("--base-url", default=None,
                     help="Server URL (default: http://HOST:PORT of --host and --port).")
    srv.add_argument("--host", default="127.0.0.1", help="Server host, without --base-url.")
    srv.add_argument("--port", type=int, default=8000, help="Server port, without --base-url.")
    srv.add_argument("--model", default=None,
                     help="Model name to request (default: the first in /v1/models).")
    srv.add_argument("--api-key", default=None,
                     help="API key of a server started with --api-key (default: "
                          "$OPENAI_API_KEY, else none).")
    srv.add_argument("--num-prompts", type=int, default=100, help="Requests to send.")
    srv.add_argument("--random-input-len", type=int, default=128,
                     help="Prompt length in tokens (random token ids).")
    srv.add_argument("--random-output-len", type=int, default=128,
                     help="Tokens generated per request (EOS ignored).")
    _range_ratio(srv)
    srv.add_argument("--request-rate", type=float, default=float("inf"),
                     help="Requests per second, started as a Poisson process; inf starts them "
                          "all at once.")
    srv.add_argument("--max-concurrency", type=int, default=None,
                     help="Most requests in flight at once (default: no limit).")
    srv.add_argument("--goodput", nargs="*", type=_slo, default=[],
                     help="Service-level objectives as KEY:MS, KEY in ttft, tpot, e2el; goodput "
                          "is the requests per second meeting all of them (default: not "
                          "measured).")
    srv.add_argument("--seed", type=int, default=0,
                     help="Seed of the random prompts and of the request arrivals.")
    srv.add_argument("--vocab-size", type=int, default=1000,
                     help="Random prompt ids are drawn below this (any BPE vocab has 1000 ids).")
    srv.add_argument("--save-result", action="store_true",
                     help="Write the result as JSON to --result-dir/--result-filename.")
    srv.add_argument("--result-dir", default=None,
                     help="Folder of --save-result's file (default: the current folder).")
    srv.add_argument("--result-filename", default=None,
                     help="File name of --save-result's file (default, as vLLM's: "
                          "jaxllm-RATEqps[-concurrencyN]-MODEL-YYYYmmdd-HHMMSS.json).")
    _output_json(srv)
    srv.set_defaults(func=_serve)


def _range_ratio(p: argparse.ArgumentParser) -> None:
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Lengths are drawn uniformly from [LEN*(1-R), LEN*(1+R)].")


def _output_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-json", default=None,
                   help="Write the results to this file as JSON (default: only the table is "
                        "printed).")


def _slo(text: str) -> tuple[str, float]:
    """One --goodput objective, KEY:MS; a malformed one is an argparse error naming it."""
    key, sep, ms = text.partition(":")
    try:
        if sep and key in ("ttft", "tpot", "e2el"):
            return key, float(ms)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: expected KEY:MS with KEY ttft, tpot or e2el")


# --- running -----------------------------------------------------------------------------------

def _write_json(path: str, results: dict) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"Results written to {path}")


def _load(args):
    from jaxllm import LLM
    from jaxllm.engine.startup import process_age

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**{k: getattr(engine_args, k) for k in EngineArgs.__dataclass_fields__})
    startup = dict(llm.llm_engine.startup_times, since_process_start=process_age())
    llm.llm_engine.wait_for_background_compiles(load_cached=True)  # the steady state
    return llm, engine_args, startup


def _weights(llm) -> dict:
    """The resident weights by dtype, GiB on the first device (quantized ones under their
    own dtype)."""
    return {"weights_gib": {k: v / 2**30 for k, v in llm.llm_engine.weight_bytes.items()}}


def _latency(args) -> None:
    from jaxllm.benchmarks.offline import format_latency_result, run_latency, spec_decode_summary

    llm, engine_args, startup = _load(args)
    res = run_latency(llm, args.batch_size, args.input_len, args.output_len, args.num_iters,
                      args.num_iters_warmup, engine_args.seed)
    res = {"startup_s": startup, **res, **_weights(llm),
           **spec_decode_summary(llm.llm_engine.stats())}
    print(format_latency_result(res))
    if args.output_json:
        _write_json(args.output_json, res)


def _throughput(args) -> None:
    from jaxllm.benchmarks.offline import (format_throughput_result, make_requests,
                                           run_throughput, spec_decode_summary)

    llm, engine_args, startup = _load(args)
    res = run_throughput(llm, make_requests(llm, args, engine_args.seed))
    res = {"startup_s": startup, **res, **_weights(llm),
           **spec_decode_summary(llm.llm_engine.stats())}
    print(format_throughput_result(res))
    if args.output_json:
        _write_json(args.output_json, res)


def _serve(args) -> int:
    """Exit status 1, with the reason in one line, when the server cannot be used (e.g. it
    wants an API key) or no request succeeded."""
    import asyncio

    from jaxllm.benchmarks.datasets import random_requests
    from jaxllm.benchmarks.serve import (ServerError, format_serve_result, run_serve_benchmark,
                                         served_model)

    base = args.base_url or f"http://{args.host}:{args.port}"
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY", "")
    try:
        model = served_model(base, api_key, args.model)
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    reqs = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                           args.vocab_size, args.random_range_ratio, seed=args.seed)
    started = datetime.now()
    res = asyncio.run(run_serve_benchmark(base, model, reqs, request_rate=args.request_rate,
                                          max_concurrency=args.max_concurrency,
                                          api_key=api_key, goodput=dict(args.goodput),
                                          seed=args.seed))
    print(format_serve_result(res, args.max_concurrency))
    for path in _serve_result_paths(args, model, started):
        _write_json(path, _serve_record(args, base, model, started, res))
    if res["failed"]:
        print(f"error: {res['failed']} of {len(reqs)} requests failed: "
              + "; ".join(res["errors"]), file=sys.stderr)
    return 0 if res["completed"] else 1


def _serve_result_paths(args, model: str, started: datetime) -> list[str]:
    """Where the JSON goes: --output-json, and with --save-result vLLM's dir/file name."""
    paths = [args.output_json] if args.output_json else []
    if args.save_result:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        name = args.result_filename or (f"jaxllm-{args.request_rate}qps{concurrency}-"
                                        f"{model.rstrip('/').split('/')[-1]}-"
                                        f"{started:%Y%m%d-%H%M%S}.json")
        if args.result_dir:
            os.makedirs(args.result_dir, exist_ok=True)
        paths.append(os.path.join(args.result_dir or ".", name))
    return paths


def _serve_record(args, base: str, model: str, started: datetime, res: dict) -> dict:
    """The result with the run's settings, as vLLM's saved result has them."""
    rate = args.request_rate if args.request_rate != float("inf") else "inf"  # valid JSON
    return {"date": f"{started:%Y%m%d-%H%M%S}", "base_url": base, "model_id": model,
            "num_prompts": args.num_prompts, "request_rate": rate,
            "max_concurrency": args.max_concurrency, **res}
