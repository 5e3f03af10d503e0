"""`jaxllm bench throughput` and `jaxllm bench latency`: the engine in-process, as vLLM's; each
result as a dict (the --output-json file) and as the table printed (`format_*_result`)."""

from __future__ import annotations

import resource
import time

import numpy as np

from jaxllm.benchmarks.datasets import (BenchRequest, Row, file_requests, format_table,
                                        random_requests)
from jaxllm.engine.stats import EngineStats


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def make_requests(llm, args, seed: int = 0) -> list[BenchRequest]:
    mc = llm.llm_engine.model_config
    if getattr(args, "dataset", None):
        return file_requests(args.dataset, llm.get_tokenizer(), args.num_prompts,
                             args.output_len, seed=seed)
    return random_requests(args.num_prompts, args.input_len, args.output_len, mc.vocab_size,
                           args.random_range_ratio, seed=seed,
                           avoid_ids=tuple(llm.llm_engine.eos_token_ids))


def run_throughput(llm, requests: list[BenchRequest], use_tqdm: bool = True) -> dict:
    """All requests at once; fixed output lengths (ignore_eos) so every engine does equal work."""
    from jaxllm import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt} if isinstance(r.prompt, list) else r.prompt
               for r in requests]
    params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.output_len)
              for r in requests]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    return {"elapsed_s": elapsed, "num_requests": len(outs),
            "requests_per_s": len(outs) / elapsed, "output_tokens_per_s": n_out / elapsed,
            "total_tokens_per_s": (n_in + n_out) / elapsed, "prompt_tokens": n_in,
            "output_tokens": n_out, "peak_rss_gib": peak_rss_gib()}


def run_latency(llm, batch_size: int, input_len: int, output_len: int, iters: int,
                warmup: int, seed: int = 0) -> dict:
    """One batch end to end; prefill time from max_tokens=1 runs; decode = the rest per token."""
    from jaxllm import SamplingParams

    reqs = random_requests(batch_size, input_len, output_len, llm.llm_engine.model_config.vocab_size,
                           seed=seed, avoid_ids=tuple(llm.llm_engine.eos_token_ids))
    prompts = [{"prompt_token_ids": r.prompt} for r in reqs]

    def timed(max_tokens: int) -> float:
        p = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        t = time.perf_counter()
        llm.generate(prompts, p, use_tqdm=False)
        return time.perf_counter() - t

    for _ in range(warmup):
        timed(output_len)
    e2e = np.array([timed(output_len) for _ in range(iters)])
    prefill = np.array([timed(1) for _ in range(iters)])
    decode = (np.median(e2e) - np.median(prefill)) / max(output_len - 1, 1)
    pct = {f"p{p}": float(np.percentile(e2e, p)) for p in (10, 25, 50, 75, 90, 99)}
    return {"avg_latency_s": float(e2e.mean()), "latency_percentiles_s": pct,
            "prefill_s_median": float(np.median(prefill)),
            "decode_s_per_token": float(decode),
            "decode_tokens_per_s": batch_size / decode if decode > 0 else float("inf"),
            "peak_rss_gib": peak_rss_gib()}


def spec_decode_summary(stats: EngineStats) -> dict:
    """With --speculative-config, from engine.stats() (the whole run): acceptance rate
    (accepted / draft tokens), mean acceptance length (1 + accepted / drafts, vLLM's), and
    output tokens per step (every request of a step counted). {} without speculation."""
    sd = stats.spec_decode
    if sd is None:
        return {}
    drafts, proposed, accepted = sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens
    return {"spec_decode": {
        "num_drafts": drafts, "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
        "accepted_per_position": list(sd.num_accepted_tokens_per_pos),
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "tokens_per_step": (stats.generation_tokens_total / sd.num_steps
                            if sd.num_steps else 0.0)}}


def format_latency_result(res: dict) -> str:
    """`bench latency`'s dict (run_latency's, plus startup_s and spec_decode) as a table."""
    ms = 1e3  # milliseconds: two decimals of seconds would hide a small model's latency
    rows: list[Row] = [("Avg latency (ms)", res["avg_latency_s"] * ms)]
    rows += [(f"{p.upper()} latency (ms)", v * ms)
             for p, v in res["latency_percentiles_s"].items()]
    rows += [("Prefill, median (ms)", res["prefill_s_median"] * ms),
             ("Decode (ms/token)", res["decode_s_per_token"] * ms),
             ("Decode throughput (tok/s)", float(res["decode_tokens_per_s"]))]
    return format_table("Latency Benchmark Result", rows + _common_rows(res))


def format_throughput_result(res: dict) -> str:
    """`bench throughput`'s dict (run_throughput's, plus startup_s and spec_decode) as a table."""
    rows: list[Row] = [
        ("Successful requests", res["num_requests"]),
        ("Benchmark duration (s)", res["elapsed_s"]),
        ("Total input tokens", res["prompt_tokens"]),
        ("Total generated tokens", res["output_tokens"]),
        ("Request throughput (req/s)", res["requests_per_s"]),
        ("Output token throughput (tok/s)", res["output_tokens_per_s"]),
        ("Total Token throughput (tok/s)", res["total_tokens_per_s"])]
    return format_table("Throughput Benchmark Result", rows + _common_rows(res))


def _common_rows(res: dict) -> list[Row]:
    """Memory, start-up and (with --speculative-config) speculation rows of both tables."""
    rows: list[Row] = [("Peak RSS (GiB)", res["peak_rss_gib"])]
    weights = res.get("weights_gib") or {}
    if weights:
        rows.append(("Weights per device (GiB)", float(sum(weights.values()))))
        rows += [(f"Weights {dtype} (GiB)", float(gib))
                 for dtype, gib in sorted(weights.items(), key=lambda kv: -kv[1])]
    startup = res.get("startup_s") or {}
    if startup:
        rows.append("Start-up")
        rows += [(f"{name.replace('_', ' ').capitalize()} (s)", float(seconds))
                 for name, seconds in startup.items()]
    spec = res.get("spec_decode")
    if spec:
        rows += ["Speculative Decoding",
                 ("Draft acceptance rate", float(spec["acceptance_rate"])),
                 ("Mean acceptance length", float(spec["mean_acceptance_length"])),
                 ("Tokens per step", float(spec["tokens_per_step"]))]
    return rows
