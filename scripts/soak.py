"""Soak test (not in CI): keep a running `jaxllm serve` saturated for N minutes and watch it leak.

    jaxllm serve --port 8011 &                      # the server under test
    python scripts/soak.py --url http://127.0.0.1:8011 --minutes 30 --pid $!

`--concurrency` clients send streaming completions back to back (random prompts and lengths);
a third of the streams are cut mid-way (the client closes the connection after a few chunks),
the rest run to the end. Every `--round-minutes` the clients pause until the server is idle and
the script checks that running/waiting requests and KV-cache usage went back to 0 (from
/metrics). The server's RSS (from /proc/PID) is sampled every few seconds.

Reports (text, and JSON with --json FILE): requests completed/cut/failed, p50/p99 latency of
completed requests, errors by kind, RSS start/peak/end, and each idle check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

import httpx

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly debate "
         "the price of tea in distant harbours under grey skies").split()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def find_server_pid(port: int) -> int:
    """The `jaxllm serve` process started with --port PORT (when --pid is not given)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "serve" in argv and "--port" in argv and argv[argv.index("--port") + 1] == str(port):
            return int(pid)
    raise SystemExit(f"no `serve --port {port}` process found; pass --pid")


async def gauges(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    out = {}
    for line in text.splitlines():
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            if line.startswith(f"jaxllm:{name}"):
                out[name] = float(line.split()[-1])
    return out


class Soak:
    def __init__(self, args):
        self.args = args
        self.latencies: list[float] = []
        self.counts = {"completed": 0, "cut": 0, "failed": 0}
        self.errors: dict[str, int] = {}
        self.rss: list[float] = []
        self.idle_checks: list[dict] = []
        self.paused = asyncio.Event()
        self.in_flight = 0
        self.server_gone: str = ""

    def _error(self, kind: str) -> None:
        self.counts["failed"] += 1
        self.errors[kind] = self.errors.get(kind, 0) + 1

    async def one(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        prompt = " ".join(rng.choice(WORDS)
                          for _ in range(rng.randint(5, self.args.max_prompt_words)))
        body = {"model": self.args.model, "prompt": prompt, "stream": True,
                "max_tokens": rng.randint(8, self.args.max_tokens), "temperature": 0.8}
        cut_after = rng.randint(1, 8) if rng.random() < 1 / 3 else None
        start, chunks = time.monotonic(), 0
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return self._error(f"HTTP {r.status_code}")
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"error"' in line[:20]:
                        return self._error("in-band error")
                    if line.startswith("data: "):
                        chunks += 1
                    if cut_after is not None and chunks >= cut_after:
                        self.counts["cut"] += 1
                        return  # leaving the block closes the connection mid-stream
            self.latencies.append(time.monotonic() - start)
            self.counts["completed"] += 1
        except httpx.HTTPError as e:
            self._error(type(e).__name__)

    async def worker(self, client: httpx.AsyncClient, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline and not self.server_gone:
            if self.paused.is_set():
                await asyncio.sleep(0.2)
                continue
            self.in_flight += 1
            try:
                await self.one(client, rng)
            finally:
                self.in_flight -= 1

    async def sample_rss(self, pid: int, deadline: float) -> None:
        """RSS every 5 s; stops the soak if the server process is gone (reported as such)."""
        while time.monotonic() < deadline and not self.server_gone:
            try:
                self.rss.append(rss_mib(pid))
            except OSError:
                self.server_gone = f"the server process {pid} exited (see dmesg for OOM kills)"
            await asyncio.sleep(5)

    async def idle_check(self, client: httpx.AsyncClient, when: str) -> None:
        """Pause the clients, wait for the server to be idle, record how long it took."""
        self.paused.set()
        while self.in_flight:
            await asyncio.sleep(0.1)
        start, g = time.monotonic(), {}
        while time.monotonic() - start < 30 and not self.server_gone:
            try:
                g = await gauges(client)
            except httpx.HTTPError as e:
                self.server_gone = self.server_gone or f"/metrics failed: {e!r}"
                break
            if not any(g.values()):
                break
            await asyncio.sleep(0.2)
        self.idle_checks.append({"at": when, "idle": not any(g.values()), **g,
                                 "seconds_to_idle": round(time.monotonic() - start, 2),
                                 "rss_mib": round(self.rss[-1], 1) if self.rss else None})
        self.paused.clear()

    async def run(self) -> dict:
        a = self.args
        pid = a.pid or find_server_pid(httpx.URL(a.url).port)
        limits = httpx.Limits(max_connections=a.concurrency + 4)
        async with httpx.AsyncClient(base_url=a.url, timeout=a.timeout, limits=limits) as client:
            rss_start = rss_mib(pid)
            t0 = time.monotonic()
            deadline = t0 + a.minutes * 60
            tasks = [asyncio.ensure_future(self.worker(client, i, deadline))
                     for i in range(a.concurrency)]
            tasks.append(asyncio.ensure_future(self.sample_rss(pid, deadline)))
            next_round = t0 + a.round_minutes * 60
            while time.monotonic() < deadline and not self.server_gone:
                await asyncio.sleep(1)
                if time.monotonic() >= next_round and time.monotonic() < deadline - 30:
                    await self.idle_check(client, f"{(time.monotonic() - t0) / 60:.1f} min")
                    next_round += a.round_minutes * 60
            await asyncio.gather(*tasks)
            if not self.server_gone:
                await self.idle_check(client, "end")
            elapsed = time.monotonic() - t0
        lat = sorted(self.latencies)
        pct = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 2) if lat else None)
        return {"minutes": round(elapsed / 60, 1), "concurrency": a.concurrency, **self.counts,
                "errors": self.errors, "requests_per_s": round(sum(self.counts.values())
                                                               / elapsed, 2),
                "latency_p50_s": pct(0.50), "latency_p99_s": pct(0.99),
                "rss_mib_start": round(rss_start, 1),
                "rss_mib_peak": round(max(self.rss, default=rss_start), 1),
                "rss_mib_end": round(self.rss[-1], 1) if self.rss else None,
                "server_gone": self.server_gone or None, "idle_checks": self.idle_checks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--round-minutes", type=float, default=5,
                   help="pause every this many minutes and check the server goes idle")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-prompt-words", type=int, default=200,
                   help="prompts are 5 to this many words (keep prompt + max tokens in context)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--pid", type=int, default=None, help="server pid (default: found by port)")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args()
    if args.model is None:
        args.model = httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
    report = asyncio.run(Soak(args).run())
    for key, value in report.items():
        if key != "idle_checks":
            print(f"{key}: {value}")
    for check in report["idle_checks"]:
        print("idle check:", json.dumps(check))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
