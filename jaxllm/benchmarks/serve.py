"""`jaxllm bench serve`: load an OpenAI-compatible server (ours or any) and measure latencies.

Streams every request and records TTFT, inter-token latencies (ITL), TPOT and end-to-end latency;
requests start at a Poisson rate (or all at once) under an optional concurrency cap. Before
that, `served_model` asks /v1/models, so that a server that cannot be used (unreachable, wrong
or missing API key) is reported once, in a line, instead of as N failed requests.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
import numpy as np
from tqdm.auto import tqdm

from jaxllm.benchmarks.datasets import BenchRequest, format_table

_KEY_HINT = "; pass --api-key or set OPENAI_API_KEY"


class ServerError(RuntimeError):
    """The server cannot be benchmarked (unreachable, refuses the key, serves no model)."""


def http_error(status: int, body: bytes) -> str:
    """'HTTP 401 Unauthorized: <the server's error message>', plus what to do about a refused
    key."""
    try:
        data = json.loads(body)
        error = data.get("error", data.get("detail", data))
        message = error.get("message", error) if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = body.decode("utf-8", "replace")
    message = str(message).strip()[:300]
    if status in (401, 403):
        message = message.rstrip(".") + _KEY_HINT
    return f"HTTP {status} {httpx.codes.get_reason_phrase(status)}: {message}"


def served_model(base_url: str, api_key: str, model: Optional[str] = None,
                 timeout: float = 30.0) -> str:
    """`model`, or the first model the server lists; raises ServerError (one line) when
    /v1/models cannot be read, so a missing API key fails before any request is timed."""
    url = base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise ServerError(f"cannot reach a server at {base_url}: {e}") from None
    if r.status_code != 200:
        raise ServerError(f"GET {url}: {http_error(r.status_code, r.content)}")
    if model:
        return model
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerError(f"GET {url}: no model in the answer {r.text[:200]!r}; "
                          "pass --model") from None


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def _one(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest,
               headers: dict) -> RequestResult:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    res = RequestResult(False, req.prompt_len)
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = http_error(r.status_code, await r.aread())
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - t0
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        res.error = repr(e)
    return res


async def run_serve_benchmark(base_url: str, model: str, requests: list[BenchRequest], *,
                              request_rate: float = float("inf"),
                              max_concurrency: Optional[int] = None, api_key: str = "",
                              goodput: Optional[dict] = None, seed: int = 0) -> dict:
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(max_concurrency or len(requests))
    rng = np.random.default_rng(seed)
    bar = tqdm(total=len(requests), desc="Requests", unit="req", disable=None)
    limits = httpx.Limits(max_connections=max_concurrency or len(requests))
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        async def limited(req):
            async with sem:
                r = await _one(client, url, model, req, headers)
            bar.update(1)
            return r

        tasks = []
        t0 = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(limited(req)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return summarize(results, duration, goodput or {})


def summarize(results: list[RequestResult], duration: float, goodput: dict) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda xs: {"mean": float(np.mean(xs)) * 1e3 if len(xs) else 0.0,  # noqa: E731
                     "median": float(np.median(xs)) * 1e3 if len(xs) else 0.0,
                     "p99": float(np.percentile(xs, 99)) * 1e3 if len(xs) else 0.0}
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)

    def good(r: RequestResult) -> bool:
        t = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        return (r.ttft * 1e3 <= goodput.get("ttft", float("inf"))
                and t * 1e3 <= goodput.get("tpot", float("inf"))
                and r.latency * 1e3 <= goodput.get("e2el", float("inf")))

    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + in_tokens) / duration,
        "goodput": sum(good(r) for r in ok) / duration if goodput else None,
        "ttft_ms": ms([r.ttft for r in ok]), "tpot_ms": ms(tpot), "itl_ms": ms(itl),
        "e2el_ms": ms([r.latency for r in ok]),
    }


def format_serve_result(res: dict, max_concurrency: Optional[int] = None) -> str:
    """`summarize`'s result as vLLM's `bench serve` prints it."""
    rows = [("Successful requests", res["completed"]), ("Failed requests", res["failed"])]
    if max_concurrency:
        rows.append(("Maximum request concurrency", max_concurrency))
    rows += [("Benchmark duration (s)", float(res["duration_s"])),
             ("Total input tokens", res["total_input_tokens"]),
             ("Total generated tokens", res["total_output_tokens"]),
             ("Request throughput (req/s)", float(res["request_throughput"]))]
    if res["goodput"] is not None:
        rows.append(("Request goodput (req/s)", float(res["goodput"])))
    rows += [("Output token throughput (tok/s)", float(res["output_throughput"])),
             ("Total Token throughput (tok/s)", float(res["total_token_throughput"]))]
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"),
                              ("e2el_ms", "End-to-end Latency", "E2EL")):
        rows += [title, (f"Mean {short} (ms)", res[key]["mean"]),
                 (f"Median {short} (ms)", res[key]["median"]),
                 (f"P99 {short} (ms)", res[key]["p99"])]
    return format_table("Serving Benchmark Result", rows)
