"""`jaxllm bench` without a model or server: every option has a help text and shows its
default, malformed --goodput is an argparse error, and the result tables have vLLM's layout.
(The benches themselves run in tests/test_cli.py, against its server and tiny model.)"""

from __future__ import annotations

import argparse
import re

import pytest

from jaxllm.benchmarks.offline import format_latency_result, format_throughput_result
from jaxllm.benchmarks.serve import http_error
from serving.cli.bench import HelpFormatter, engine_defaults
from serving.cli.main import main, make_parser

MODES = ("latency", "throughput", "serve")


def bench_parsers() -> dict[str, argparse.ArgumentParser]:
    parser, _ = make_parser(["bench"])
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    modes = next(a for a in commands.choices["bench"]._actions
                 if isinstance(a, argparse._SubParsersAction))
    return dict(modes.choices)


@pytest.mark.parametrize("mode", MODES)
def test_every_option_has_a_help_and_its_default(mode):
    parser = bench_parsers()[mode]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = HelpFormatter("x")._get_help_string(action)
        assert text and text != argparse.SUPPRESS, f"{mode} {action.option_strings}: no help"
        default = action.default
        if default is argparse.SUPPRESS:
            default = engine_defaults().get(action.dest)
        if default is not None:
            assert "default" in text.lower(), f"{mode} {action.option_strings}: {text!r}"


@pytest.mark.parametrize("mode, shown", [
    ("latency", [r"--batch-size BATCH_SIZE\s+Prompts run as one batch\. \(default: 8\)",
                 r"--max-num-seqs MAX_NUM_SEQS\s+Most sequences in one step\. \(default: 256\)"]),
    ("throughput", [r"--num-prompts NUM_PROMPTS\s+Requests, all submitted at once\. "
                    r"\(default: 64\)"]),
    ("serve", [r"--request-rate REQUEST_RATE\s+Requests per second.*\(default: inf\)",
               r"--save-result\s+Write the result as JSON", r"--result-dir RESULT_DIR",
               r"--result-filename RESULT_FILENAME"]),
])
def test_help_shows_defaults(mode, shown, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", mode, "--help"])
    assert e.value.code == 0
    out = re.sub(r"\s+", " ", capsys.readouterr().out)
    for pattern in shown:
        assert re.search(pattern, out), pattern


def test_malformed_goodput_names_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--goodput", "ttft=5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "jaxllm bench serve: error: argument --goodput" in err and "KEY:MS" in err


def test_http_error_gives_the_servers_message():
    body = b'{"error": {"message": "Invalid or missing API key.", "code": 401}}'
    assert http_error(401, body) == ("HTTP 401 Unauthorized: Invalid or missing API key; "
                                     "pass --api-key or set OPENAI_API_KEY")
    assert http_error(404, b'{"detail": "Not Found"}') == "HTTP 404 Not Found: Not Found"
    assert http_error(502, b"<html>down</html>") == "HTTP 502 Bad Gateway: <html>down</html>"


def rows(table: str) -> dict[str, str]:
    return dict(re.findall(r"^([^:\n]+): +(\S+)$", table, re.M))


def test_throughput_table():
    res = {"num_requests": 5, "elapsed_s": 2.0, "prompt_tokens": 40, "output_tokens": 20,
           "requests_per_s": 2.5, "output_tokens_per_s": 10.0, "total_tokens_per_s": 30.0,
           "peak_rss_gib": 1.234, "startup_s": {"load": 1.5, "since_process_start": 4.25},
           "spec_decode": {"acceptance_rate": 0.5, "mean_acceptance_length": 2.0,
                           "tokens_per_step": 1.75}}
    table = format_throughput_result(res)
    lines = table.splitlines()
    assert lines[0] == "========== Throughput Benchmark Result ==========="
    assert lines[-1] == "=" * 50 and all(len(line) <= 51 for line in lines)
    assert rows(table) == {
        "Successful requests": "5", "Benchmark duration (s)": "2.00",
        "Total input tokens": "40", "Total generated tokens": "20",
        "Request throughput (req/s)": "2.50", "Output token throughput (tok/s)": "10.00",
        "Total Token throughput (tok/s)": "30.00", "Peak RSS (GiB)": "1.23",
        "Load (s)": "1.50", "Since process start (s)": "4.25",
        "Draft acceptance rate": "0.50", "Mean acceptance length": "2.00",
        "Tokens per step": "1.75"}


def test_weights_rows_list_each_dtype_largest_first():
    res = {"avg_latency_s": 0.5, "latency_percentiles_s": {}, "prefill_s_median": 0.1,
           "decode_s_per_token": 0.002, "decode_tokens_per_s": 4000, "peak_rss_gib": 1.0,
           "weights_gib": {"bfloat16": 0.5, "int4": 3.4}}
    table = format_latency_result(res)
    got = rows(table)
    assert got["Weights per device (GiB)"] == "3.90"
    assert got["Weights int4 (GiB)"] == "3.40" and got["Weights bfloat16 (GiB)"] == "0.50"
    assert table.index("Weights int4") < table.index("Weights bfloat16")


def test_latency_table_without_speculation():
    res = {"avg_latency_s": 0.5, "latency_percentiles_s": {"p10": 0.4, "p99": 0.7},
           "prefill_s_median": 0.1, "decode_s_per_token": 0.002, "decode_tokens_per_s": 4000,
           "peak_rss_gib": 1.0, "startup_s": {"total": 3.0}}
    table = format_latency_result(res)
    assert " Latency Benchmark Result " in table and "Speculative" not in table
    assert rows(table) == {"Avg latency (ms)": "500.00", "P10 latency (ms)": "400.00",
                           "P99 latency (ms)": "700.00", "Prefill, median (ms)": "100.00",
                           "Decode (ms/token)": "2.00", "Decode throughput (tok/s)": "4000.00",
                           "Peak RSS (GiB)": "1.00", "Total (s)": "3.00"}
