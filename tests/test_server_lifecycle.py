"""Health, failure, overload and shutdown (issue 28): the engine loop's health and death with a
fake engine in process, then real `jaxllm serve` processes: an injected step fault (exit 1),
admission (503 + Retry-After), /health under load, and SIGTERM draining in-flight requests
(exit 0)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from jaxllm.engine.async_engine import AsyncLLMEngine
from jaxllm.engine.errors import EngineDeadError
from jaxllm.engine.stats import EngineStats
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import SamplingParams
from server_process import ENGINE_FLAGS, ServerProcess

NAME = "tiny"
RUNNING = int(ENGINE_FLAGS[ENGINE_FLAGS.index("--max-num-seqs") + 1])  # the module server's


class FakeEngine:
    """One token per step; `step_hook` runs before each step (to raise or to stall)."""

    def __init__(self, step_hook=lambda: None):
        self.args = SimpleNamespace()
        self.model_config = SimpleNamespace()
        self.generation_defaults = {}
        self.tokenizer = None
        self.eos_token_ids = frozenset()
        self.step_leader = None  # one host
        self.supported_tasks, self.classifier = ("generate",), None
        self.requests: dict[str, list[int]] = {}
        self.step_hook = step_hook

    def stats(self):
        return EngineStats(num_running=len(self.requests))

    def wait_for_background_compiles(self):
        pass  # nothing compiles

    def has_unfinished_requests(self):
        return bool(self.requests)

    def add_request(self, rid, prompt, params, priority):
        self.requests[rid] = []

    def abort_request(self, rid):
        self.requests.pop(rid, None)

    def step(self):
        self.step_hook()
        outs = []
        for rid, tokens in list(self.requests.items()):
            tokens.append(7)
            done = len(tokens) >= 3
            outs.append(RequestOutput(rid, None, [1], None, [CompletionOutput(
                0, "", list(tokens), None, None, "length" if done else None)], done))
            if done:
                del self.requests[rid]
        return outs


async def _run(engine: AsyncLLMEngine, rid: str):
    return [out async for out in engine.generate([1], SamplingParams(), rid)]


def test_a_failing_step_fails_its_requests_and_the_loop_reports_why():
    def fail():
        raise RuntimeError("device on fire")

    engine = AsyncLLMEngine(FakeEngine(fail))
    try:
        with pytest.raises(EngineDeadError, match="device on fire"):
            asyncio.run(_run(engine, "a"))
        assert not engine.is_running
        assert "device on fire" in engine.health(stall_after=60)
        with pytest.raises(EngineDeadError):  # later requests fail at once, never hang
            asyncio.run(asyncio.wait_for(_run(engine, "b"), 5))
    finally:
        engine.shutdown()


def test_health_reports_a_stalled_loop_then_recovers():
    release = threading.Event()
    engine = AsyncLLMEngine(FakeEngine(lambda: release.wait(10)))
    try:
        assert engine.health(stall_after=0.3) is None
        done = threading.Thread(target=lambda: asyncio.run(_run(engine, "a")))
        done.start()
        time.sleep(0.8)  # the step is stuck in the hook
        assert "has not completed a pass" in engine.health(stall_after=0.3)
        release.set()
        done.join(10)
        time.sleep(0.1)
        assert engine.health(stall_after=0.3) is None
    finally:
        release.set()
        engine.shutdown()


# --- real servers ------------------------------------------------------------------------------

@pytest.mark.slow  # its own server (~30 s); the fake-engine tests above cover the loop's side
def test_injected_step_fault_fails_the_request_and_exits_1(tiny_llama, monkeypatch):
    monkeypatch.setenv("JAXLLM_TEST_FAIL_STEP", "2")
    srv = ServerProcess(tiny_llama, *ENGINE_FLAGS, "--served-model-name", NAME)
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": NAME, "prompt": "Hi", "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["code"] == 500 and "injected fault" in error["message"]
        assert srv.proc.wait(30) == 1
        assert "The engine loop died" in srv.output()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(tiny_llama):
    """The other server tests' engine flags (their compiled programs are in the executable
    cache): max-num-seqs 32 plus at most 4 waiting sequences; no
    --trust-request-chat-template."""
    srv = ServerProcess(tiny_llama, *ENGINE_FLAGS, "--served-model-name", NAME,
                        "--max-waiting-requests", "4", "--shutdown-timeout", "20")
    yield srv
    srv.stop()


def stream_lines(srv, body: dict, started: threading.Event, lines: list) -> None:
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                      json={"model": NAME, "stream": True, "ignore_eos": True, **body}) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                started.set()


def test_request_chat_templates_need_the_operators_trust(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "x"}], "chat_template": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r.json()["error"]["message"]


def test_overload_is_a_503_with_retry_after(server):
    started, lines = threading.Event(), []
    first = threading.Thread(target=stream_lines, args=(
        server, {"prompt": "Hello", "max_tokens": 100, "n": RUNNING + 2}, started, lines))
    first.start()
    assert started.wait(30)
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"model": NAME, "prompt": "Hi", "max_tokens": 2, "n": 3})
    first.join(60)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["code"] == 503 and "overloaded" in r.json()["error"]["message"]
    assert lines[-1] == "data: [DONE]"
    ok = httpx.post(server.url + "/v1/completions", timeout=30, headers={"X-Request-Id": "abc"},
                    json={"model": NAME, "prompt": "Hi", "max_tokens": 2, "n": 3})
    assert ok.status_code == 200
    # without --enable-request-id-headers the client's id is not taken (nor echoed)
    assert ok.json()["id"] != "cmpl-abc" and "x-request-id" not in ok.headers


def test_health_and_metrics_answer_fast_under_load(server):
    # Probes from the first request until the last one ends (a fixed probing window missed
    # the load once the engine finished the 12 requests inside it).
    async def load():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            done = asyncio.Event()

            async def one(i):
                r = await c.post("/v1/completions", json={
                    "model": NAME, "prompt": f"Load {i}", "max_tokens": 100, "ignore_eos": True})
                return r.status_code

            async def probe():
                worst, running = 0.0, 0.0
                while not done.is_set():
                    start = time.monotonic()
                    assert (await c.get("/health")).status_code == 200
                    text = (await c.get("/metrics")).text
                    worst = max(worst, time.monotonic() - start)
                    for line in text.splitlines():
                        if line.startswith("jaxllm:num_requests_running{"):
                            running = max(running, float(line.split()[-1]))
                    await asyncio.sleep(0.05)
                return worst, running

            async def requests():
                codes = await asyncio.gather(*(one(i) for i in range(12)))
                done.set()
                return codes

            return await asyncio.gather(probe(), requests())

    (worst, running), codes = asyncio.run(load())
    assert worst < 1.0 and running > 0
    assert sorted(codes) == [200] * 12


def test_sigterm_drains_in_flight_requests_then_exits_0(server):
    """Last in this module: it stops the module's server."""
    started, lines = threading.Event(), []
    stream = threading.Thread(target=stream_lines, args=(
        server, {"prompt": "Drain me", "max_tokens": 100,
                 "stream_options": {"include_usage": True}}, started, lines))
    stream.start()
    assert started.wait(30)
    server.proc.send_signal(signal.SIGTERM)
    stream.join(60)
    assert server.proc.wait(60) == 0
    assert lines[-1] == "data: [DONE]"  # the stream ran to its end, not cut at the signal
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 100
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=5)


@pytest.mark.slow  # its own server (~25 s); the drain test above shares the module's
def test_sigterm_cancels_what_outlives_the_shutdown_timeout_then_exits_0(tiny_llama,
                                                                         monkeypatch):
    """A stream and a plain request still running when --shutdown-timeout runs out end with
    an error (in-band for the stream, a 503 for the other), and the process exits 0."""
    monkeypatch.setenv("JAXLLM_TEST_STEP_DELAY", "0.05")  # 200 tokens: ~10 s per request
    srv = ServerProcess(tiny_llama, *ENGINE_FLAGS, "--served-model-name", NAME,
                        "--shutdown-timeout", "1")
    try:
        started, lines, plain = threading.Event(), [], {}
        stream = threading.Thread(target=stream_lines, args=(
            srv, {"prompt": "Cancel me", "max_tokens": 120}, started, lines))

        def post():
            plain["r"] = httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "model": NAME, "prompt": "Me too", "max_tokens": 120, "ignore_eos": True})

        other = threading.Thread(target=post)
        stream.start()
        other.start()
        assert started.wait(30)
        time.sleep(0.3)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        stream.join(30)
        other.join(30)
        assert srv.proc.wait(30) == 0
        assert time.monotonic() - t0 < 15  # 1 s of grace, not the requests' ~6 s
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert error["code"] == 503 and "--shutdown-timeout" in error["message"]
        r = plain["r"]
        assert r.status_code == 503 and "--shutdown-timeout" in r.json()["error"]["message"]
    finally:
        srv.stop()
