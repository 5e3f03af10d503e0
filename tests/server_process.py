"""A `jaxllm serve` process for the server tests: started on a free loopback port, ready once
/health answers 200, stopped with SIGINT; and the clients and metrics readers they share."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key"
NAME = "tiny"
# float32 so that batched and single-sequence greedy runs pick the same tokens.
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-batched-tokens", "128",
                "--kv-cache-memory-bytes", "4M", "--max-num-seqs", "32", "--disable-log-stats"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`jaxllm serve MODEL --port P` in a subprocess; ready once /health answers 200."""

    def __init__(self, model: str, *flags: str, timeout: float = 600):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="jaxllm-serve-", suffix=".log",
                                               delete=False)
        cmd = [sys.executable, "-m", "serving.cli.main", "serve", model, "--host", "127.0.0.1",
               "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.output()}")

    def output(self, tail: int = 6000) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-tail:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)


def serve_tiny(tiny_llama):
    """The tiny model served with an API key (a module fixture's body: yields, then stops)."""
    # The random model pads JSON with whitespace forever unless told not to (a real model does
    # not need it); the flag is vLLM's --structured-outputs-config.
    srv = ServerProcess(tiny_llama, *ENGINE_FLAGS, "--served-model-name", NAME, "--api-key",
                        API_KEY, "--enable-request-id-headers", "--trust-request-chat-template",
                        "--structured-outputs-config",
                        '{"backend": "auto", "disable_any_whitespace": true}')
    yield srv
    srv.stop()


def openai_client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def http_client(server):
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def metrics(http) -> dict[str, float]:
    """Prometheus samples as {'name{label=value,...}': value} (model_name label left out)."""
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(http, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        idle = (m["jaxllm:num_requests_running"] == 0 and m["jaxllm:num_requests_waiting"] == 0
                and m["jaxllm:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)
