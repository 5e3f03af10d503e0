"""What /v1/responses adds to a request's latency over the same chat completion (issue 51's bar:
at most 5 %), streamed and not.

    PYTHONPATH=. python scripts/bench_responses.py [--model M] [--reps 20] [--max-tokens 32]
                                                   [--port P] [-- SERVE FLAGS]

Starts `jaxllm serve M` on 127.0.0.1 (a process of its own), then sends the same conversation
alternately as a chat completion and as a Responses request (greedy, so both decode the same
tokens: the Responses path renders its input through the chat machinery), one at a time,
streamed and not; after one warm-up pair per mode, `--reps` pairs each. Prints per mode the
median latency of each API (streamed: until the last event), the median of the paired ratios
responses / chat, and the generated token counts (equal, or the comparison is void).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

MESSAGE = "Write a short list of five European capitals and one fact about each."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, port: int, flags: list[str]) -> subprocess.Popen:
    log = tempfile.NamedTemporaryFile(prefix="bench-responses-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "serving.cli.main", "serve", model, "--host",
                             "127.0.0.1", "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}; log: {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    sys.exit(f"server not ready after 30 min; log: {log.name}")


def chat(c: httpx.Client, model: str, n: int, stream: bool) -> tuple[float, int]:
    body = {"model": model, "messages": [{"role": "user", "content": MESSAGE}],
            "max_tokens": n, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return _timed(c, "/v1/chat/completions", body, stream,
                  lambda d: (d.get("usage") or {}).get("completion_tokens"))


def responses(c: httpx.Client, model: str, n: int, stream: bool) -> tuple[float, int]:
    body = {"model": model, "input": MESSAGE, "max_output_tokens": n, "temperature": 0,
            "stream": stream, "store": False}
    return _timed(c, "/v1/responses", body, stream,
                  lambda d: ((d.get("response") or d).get("usage") or {}).get("output_tokens"))


def _timed(c: httpx.Client, path: str, body: dict, stream: bool, tokens_of) -> tuple[float, int]:
    t = time.perf_counter()
    if not stream:
        r = c.post(path, json=body)
        r.raise_for_status()
        return time.perf_counter() - t, tokens_of(r.json())
    n = None
    with c.stream("POST", path, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                got = tokens_of(json.loads(line[6:]))
                n = got if got is not None else n
    return time.perf_counter() - t, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the figures here too")
    ap.add_argument("serve_flags", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    flags = a.serve_flags[1:] if a.serve_flags[:1] == ["--"] else a.serve_flags
    port = a.port or free_port()
    proc = serve(a.model, port, flags)
    out = {"model": a.model, "max_tokens": a.max_tokens, "reps": a.reps,
           "load_avg": os.getloadavg()[0]}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
            for stream in (False, True):
                mode = "streamed" if stream else "whole"
                chat(c, a.model, a.max_tokens, stream)  # warm-up pair
                responses(c, a.model, a.max_tokens, stream)
                pairs = []
                for i in range(a.reps):  # alternating which goes first
                    calls = [chat, responses] if i % 2 == 0 else [responses, chat]
                    got = {f.__name__: f(c, a.model, a.max_tokens, stream) for f in calls}
                    pairs.append((got["chat"], got["responses"]))
                tc = [p[0][0] for p in pairs]
                tr = [p[1][0] for p in pairs]
                out[mode] = {
                    "chat_ms": round(1e3 * statistics.median(tc), 2),
                    "responses_ms": round(1e3 * statistics.median(tr), 2),
                    "ratio": round(statistics.median(r / c_ for c_, r in zip(tc, tr)), 4),
                    "tokens": sorted({(p[0][1], p[1][1]) for p in pairs})}
                print(f"{mode:9s} chat {out[mode]['chat_ms']:8.1f} ms  responses "
                      f"{out[mode]['responses_ms']:8.1f} ms  ratio {out[mode]['ratio']:.3f}  "
                      f"tokens (chat, responses) {out[mode]['tokens']}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
