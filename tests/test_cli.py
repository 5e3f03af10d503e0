"""The `jaxllm` command: every sub-command's --help (fast, without JAX), an unknown flag
reported by its sub-command, collect-env, chat, complete and bench serve against a real server,
a busy --port, a missing model path, run-batch on a mixed file, generate and the offline
benches."""

from __future__ import annotations

import glob
import json
import re
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

from serving.cli.main import main
from server_process import ENGINE_FLAGS, ServerProcess, metrics

COMMANDS = ["serve", "chat", "complete", "bench", "collect-env", "run-batch", "generate"]
API_KEY = "cli-key"
NAME = "tiny"


def jaxllm(*args: str, stdin: str = "", timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serving.cli.main", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"] if command is None else [command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:")
    if command is None:
        assert all(c in out for c in COMMANDS)


def test_help_is_fast_and_does_not_import_jax():
    code = ("import sys, time\n"
            "t = time.time()\n"
            "from serving.cli.main import main\n"
            f"for c in {COMMANDS!r}:\n"
            "    try:\n"
            "        main([c, '--help'])\n"
            "    except BaseException:  # a failing --help is test_help's business\n"
            "        pass\n"
            "print('jax' in sys.modules, 'fastapi' in sys.modules, time.time() - t)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120).stdout.splitlines()[-1].split()
    assert out[:2] == ["False", "False"]
    assert float(out[2]) < 10


def test_serve_help_has_vllms_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--chat-template",
                 "--response-role", "--allowed-origins", "--allowed-methods", "--allowed-headers",
                 "--allow-credentials", "--root-path", "--uvicorn-log-level",
                 "--disable-log-requests", "--max-log-len", "--disable-fastapi-docs",
                 "--enable-request-id-headers", "--ssl-keyfile", "--ssl-certfile", "--config",
                 "--tensor-parallel-size", "--max-model-len", "--enable-auto-tool-choice",
                 "--tool-call-parser", "--tool-parser-plugin", "--reasoning-parser",
                 "--chat-template-content-format", "--exclude-tools-when-tool-choice-none"):
        assert flag in out, flag


def test_version(capsys):
    import jaxllm as pkg
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"jaxllm {pkg.__version__}"


def test_collect_env():
    r = jaxllm("collect-env", timeout=120)
    assert r.returncode == 0, r.stderr
    for line in ("jaxllm: ", "jax: ", "jaxlib: ", "flax: ", "transformers: ", "torch: ",
                 "Python: 3.", "Platform: ", "backend: cpu", "devices: ",
                 "attention backend (auto, one device): cpu", "native CPU matmul: built"):
        assert line in r.stdout, line


def test_busy_port_fails_fast_with_a_clear_message():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t = time.monotonic()
        r = jaxllm("serve", "--host", "127.0.0.1", "--port", str(port), timeout=120)
    assert r.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr
    assert time.monotonic() - t < 30  # refused before any model is loaded


def test_bad_engine_flag_is_one_line():
    r = jaxllm("serve", "--port", "0", "--pipeline-parallel-size", "2", "-dp", "2",
               timeout=120)
    assert r.returncode != 0
    assert "--pipeline-parallel-size" in r.stderr and "Traceback" not in r.stderr


def test_serve_reads_config_files(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("prot: 8000\n")  # a typo
    r = jaxllm("serve", "--config", str(cfg), timeout=120)
    assert r.returncode == 2 and "unknown option 'prot'" in r.stderr


@pytest.mark.parametrize("argv, prog", [
    (["serve", "--bogus-flag"], "jaxllm serve"),
    (["bench", "latency", "--bogus-flag"], "jaxllm bench latency"),
    (["chat", "-q", "hi", "--bogus-flag"], "jaxllm chat"),
    (["collect-env", "--bogus-flag"], "jaxllm collect-env"),
    (["--bogus-flag"], "jaxllm"),
])
def test_unknown_flag_shows_its_commands_usage(argv, prog, capsys):
    """argparse reports a sub-command's unknown flag with the top-level usage unless told."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {prog} "), err
    assert f"\n{prog}: error: unrecognized arguments: --bogus-flag" in err


def test_missing_model_path_is_named():
    r = jaxllm("serve", "./no/such/model", "--port", "0", timeout=120)
    assert r.returncode != 0
    assert "no such file or folder: ./no/such/model" in r.stderr
    assert "Repo id" not in r.stderr and "Traceback" not in r.stderr


def test_client_without_server_says_so():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    r = jaxllm("chat", "--url", f"http://127.0.0.1:{port}/v1", "-q", "hi", timeout=120)
    assert r.returncode == 1 and "cannot reach a server" in r.stderr


# --- against a running server ------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess(tiny_llama, *ENGINE_FLAGS, "--served-model-name", NAME, "--api-key",
                        API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def _requests_done(http) -> float:
    return sum(v for k, v in metrics(http).items()
               if k.startswith("jaxllm:request_success_total"))


@pytest.mark.slow  # the module's server (~40 s to start)
@pytest.mark.parametrize("command", ["chat", "complete"])
def test_quick(server, http, command):
    before = _requests_done(http)
    r = jaxllm(command, "--url", server.url + "/v1", "--api-key", API_KEY, "--max-tokens", "4",
               "-q", "Hello there")
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n") and "error" not in r.stderr
    assert _requests_done(http) == before + 1


@pytest.mark.slow  # the module's server (~40 s to start)
def test_interactive_chat_keeps_the_conversation(server, http):
    before = metrics(http)["jaxllm:prompt_tokens_total"]
    r = jaxllm("chat", "--url", server.url + "/v1", "--api-key", API_KEY, "--model-name", NAME,
               "--system-prompt", "Be brief.", "--max-tokens", "3", stdin="Hi\n\nAgain\n")
    assert r.returncode == 0, r.stderr
    first = http.post("/tokenize", json={"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}).json()
    # Two turns; the second prompt holds the first turn, so it is longer than the first.
    assert metrics(http)["jaxllm:prompt_tokens_total"] - before > 2 * first["count"]


@pytest.mark.slow  # the module's server (~40 s to start)
def test_interactive_complete_reads_lines(server, http):
    before = _requests_done(http)
    r = jaxllm("complete", "--url", server.url + "/v1", "--api-key", API_KEY, "--max-tokens",
               "3", stdin="one\ntwo\nthree\n")
    assert r.returncode == 0, r.stderr
    assert _requests_done(http) == before + 3


@pytest.mark.slow  # the module's server (~40 s to start)
def test_wrong_key_is_reported(server):
    r = jaxllm("complete", "--url", server.url + "/v1", "--api-key", "wrong", "-q", "x")
    assert r.returncode == 1 and "401" in r.stderr


@pytest.mark.slow  # the module's server (~40 s to start)
def test_bench_serve_without_the_key_says_so(server, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    r = jaxllm("bench", "serve", "--base-url", server.url, "--num-prompts", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert (f"error: GET {server.url}/v1/models: HTTP 401 Unauthorized: Invalid or missing "
            "API key; pass --api-key or set OPENAI_API_KEY\n") in r.stderr
    assert "Benchmark Result" not in r.stdout


@pytest.mark.slow  # the module's server (~40 s to start)
def test_bench_serve_prints_vllms_table_and_saves_the_result(server, http, tmp_path):
    before = _requests_done(http)
    results = tmp_path / "results"
    r = jaxllm("bench", "serve", "--base-url", server.url, "--api-key", API_KEY,
               "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "4",
               "--vocab-size", "256", "--max-concurrency", "2", "--save-result",
               "--result-dir", str(results))
    assert r.returncode == 0, r.stderr
    assert _requests_done(http) == before + 3
    out = r.stdout
    assert "============ Serving Benchmark Result ============" in out
    assert re.search(r"^Successful requests: +3$", out, re.M)
    assert re.search(r"^Total generated tokens: +12$", out, re.M)
    for label in ("Benchmark duration (s)", "Total input tokens", "Request throughput (req/s)",
                  "Output token throughput (tok/s)", "Mean TTFT (ms)", "Median TTFT (ms)",
                  "P99 TTFT (ms)", "Mean TPOT (ms)", "Mean ITL (ms)", "P99 E2EL (ms)"):
        assert re.search(rf"^{re.escape(label)}: +\d+(\.\d\d)?$", out, re.M), label
    [saved] = glob.glob(str(results / "jaxllm-infqps-concurrency2-tiny-*.json"))
    assert f"Results written to {saved}" in out
    res = json.loads(open(saved).read())
    assert res["completed"] == 3 and res["failed"] == 0 and res["total_output_tokens"] == 12
    assert res["model_id"] == NAME and res["request_rate"] == "inf"
    assert res["max_concurrency"] == 2 and res["ttft_ms"]["mean"] > 0


# --- offline commands (each loads the model in its own process) -------------------------------

@pytest.mark.slow  # its own model load (~25 s)
def test_run_batch_mixed_file(tmp_path, tiny_llama, server, http):
    greedy = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
    lines = [
        {"custom_id": "ok-completion", "method": "POST", "url": "/v1/completions",
         "body": {"model": NAME, "prompt": "Hello", **greedy}},
        "this line is not JSON",
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": NAME, "input": "x"}},
        {"custom_id": "bad-max-tokens", "method": "POST", "url": "/v1/completions",
         "body": {"model": NAME, "prompt": "Hello", "max_tokens": -1}},
        {"custom_id": "ok-chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hi"}], **greedy}},
        {"custom_id": "bad-model", "method": "POST", "url": "/v1/completions",
         "body": {"model": "gpt-4", "prompt": "Hello"}},
        {"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
         "body": {"model": NAME, "prompt": "hello " * 200}},
        {"custom_id": "no-body", "method": "POST", "url": "/v1/completions"},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    r = jaxllm("run-batch", "-i", str(src), "-o", str(dst), "--model", tiny_llama,
               "--served-model-name", NAME, *ENGINE_FLAGS)
    assert r.returncode == 0, r.stderr
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["ok-completion", None, "bad-url", "bad-max-tokens",
                                            "ok-chat", "bad-model", "too-long", "no-body"]
    ok = {o["custom_id"]: o for o in out if o["error"] is None}
    assert set(ok) == {"ok-completion", "ok-chat"}
    for o in out:
        assert set(o) == {"id", "custom_id", "response", "error"}
        if o["error"] is not None:
            assert o["response"] is None
            assert set(o["error"]) == {"message", "type", "param", "code"}
    errors = {o["custom_id"]: o["error"] for o in out if o["error"]}
    assert errors["bad-model"]["code"] == 404 and errors["bad-url"]["param"] == "url"
    assert "128" in errors["too-long"]["message"]
    completion = ok["ok-completion"]["response"]
    assert completion["status_code"] == 200
    assert completion["body"]["usage"]["completion_tokens"] == 4
    assert ok["ok-chat"]["response"]["body"]["object"] == "chat.completion"
    # Same engine settings, same greedy text as the server gives.
    served = http.post("/v1/completions", json={"model": NAME, "prompt": "Hello",
                                                **greedy}).json()
    assert completion["body"]["choices"][0]["text"] == served["choices"][0]["text"]
    assert "2 succeeded, 6 failed" in r.stderr


@pytest.mark.slow  # the module's server (~40 s to start)
def test_generate_matches_the_server(tiny_llama, http):
    r = jaxllm("generate", tiny_llama, "--prompt", "Hello", "--max-tokens", "4",
               "--temperature", "0", "--ignore-eos", *ENGINE_FLAGS)
    assert r.returncode == 0, r.stderr
    served = http.post("/v1/completions", json={"model": NAME, "prompt": "Hello",
                                                "max_tokens": 4, "temperature": 0,
                                                "ignore_eos": True}).json()
    assert r.stdout == served["choices"][0]["text"] + "\n"


# (a cold jaxllm process each, ~25 s: the bench's arithmetic is tested in test_bench_cli.py)
@pytest.mark.parametrize("mode", [
    pytest.param(["latency", "--batch-size", "2", "--num-iters", "2", "--num-iters-warmup", "1",
                  "--seed", "3"], marks=pytest.mark.slow),
    pytest.param(["throughput", "--num-prompts", "5"], marks=pytest.mark.slow)])
def test_offline_bench_runs_and_reports(tiny_llama, tmp_path, mode):
    """`jaxllm bench latency|throughput` end to end, with and without engine flags given."""
    out = tmp_path / "bench.json"
    r = jaxllm("bench", *mode, "--model", tiny_llama, "--input-len", "8", "--output-len", "4",
               "--output-json", str(out), *ENGINE_FLAGS)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["startup_s"]["since_process_start"] > 0
    # the tiny model's weights, resident by dtype (a quantized model's under its own dtype)
    assert 0 < sum(res["weights_gib"].values()) < 0.01, res["weights_gib"]
    assert re.search(r"^Weights per device \(GiB\): +0\.\d\d$", r.stdout, re.M), r.stdout
    if mode[0] == "latency":
        assert 0 < res["prefill_s_median"] < res["avg_latency_s"]
        assert res["decode_tokens_per_s"] > 0
        avg_ms = f"{res['avg_latency_s'] * 1e3:.2f}"
        table = ("Latency Benchmark Result", rf"^Avg latency \(ms\): +{avg_ms}$")
    else:
        assert res["output_tokens_per_s"] > 0 and res["num_requests"] == 5
        table = ("Throughput Benchmark Result", r"^Successful requests: +5$")
    assert f" {table[0]} " in r.stdout and re.search(table[1], r.stdout, re.M), r.stdout
    assert re.search(r"^Since process start \(s\): +\d+\.\d\d$", r.stdout, re.M)
    assert f"Results written to {out}" in r.stdout and not r.stdout.lstrip().startswith("{")


@pytest.mark.slow  # the module's server (~40 s to start)
def test_generate_takes_the_models_generation_config_and_logs_only_its_own_lines(
        tiny_llama, tmp_path, http):
    """Unset sampling flags come from generation_config.json (vLLM's `--generation-config
    auto`): greedy and 3 tokens here, as the server's request says explicitly. stderr holds
    jaxllm's log lines only (no progress bar, no other library's notice)."""
    model = tmp_path / "with_generation_config"
    shutil.copytree(tiny_llama, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 3}))
    r = jaxllm("generate", str(model), "--prompt", "Hello", "--ignore-eos", *ENGINE_FLAGS)
    assert r.returncode == 0, r.stderr
    served = http.post("/v1/completions", json={"model": NAME, "prompt": "Hello",
                                                "max_tokens": 3, "temperature": 0,
                                                "ignore_eos": True}).json()
    assert r.stdout == served["choices"][0]["text"] + "\n"
    log_line = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) [\d-]+ [\d:]+ \[jaxllm")
    assert r.stderr.strip() and all(log_line.match(line) for line in r.stderr.splitlines())
