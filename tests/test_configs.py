"""Every configs/*.yaml parses with the real `jaxllm serve` parser and EngineArgs, and --config
behaves like vLLM's: keys are the flags, the command line wins, unknown keys are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from serving.cli.serve import parse_args
from jaxllm.config import EngineArgs, parse_size

CONFIG_DIR = Path(__file__).parent.parent / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))


def test_the_promised_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"cpu-demo.yaml", "tpu-v5e-8-llama3-8b.yaml", "tpu-v6e-8-llama3-8b.yaml",
            "h100-llama3-8b.yaml", "mixtral-8x7b-ep.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_every_key_lands(path):
    text = path.read_text()
    assert text.startswith("#"), "each config says in a comment what it is for"
    args = parse_args(["--config", str(path)])
    engine_args = EngineArgs.from_cli_args(args)  # raises if EngineArgs refuses a value
    for key, value in yaml.safe_load(text).items():
        dest = key.replace("-", "_")
        got = getattr(engine_args if hasattr(engine_args, dest) else args, dest)
        if dest in ("kv_cache_memory_bytes", "max_model_len", "max_num_batched_tokens"):
            value = parse_size(value)
        assert got == value, f"{key}: {got!r} != {value!r}"


def test_parallel_layouts():
    def load(name):
        return EngineArgs.from_cli_args(parse_args(["--config", str(CONFIG_DIR / name)]))

    for name in ("tpu-v5e-8-llama3-8b.yaml", "tpu-v6e-8-llama3-8b.yaml"):
        assert load(name).tensor_parallel_size == 8  # a v5e-8 / v6e-8 host has 8 chips
    assert load("h100-llama3-8b.yaml").tensor_parallel_size == 1
    mixtral = load("mixtral-8x7b-ep.yaml")
    assert mixtral.enable_expert_parallel and mixtral.tensor_parallel_size == 8


def test_command_line_wins_over_config(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 9001\nmax-model-len: 1k\nenable-prefix-caching: false\n"
                   "allowed-origins: ['http://a.example']\nserved-model-name: [a, b]\n")
    args = parse_args(["--config", str(cfg), "--port", "9002", "some/model"])
    assert args.port == 9002
    assert args.allowed_origins == ["http://a.example"]
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.model == "some/model"
    assert engine_args.max_model_len == 1000
    assert engine_args.enable_prefix_caching is False
    assert engine_args.served_model_name == ["a", "b"]
    assert parse_args([f"--config={cfg}", "--enable-prefix-caching"]).enable_prefix_caching


def test_serve_defaults_match_vllm():
    args = parse_args([])
    assert (args.host, args.port, args.uvicorn_log_level) == (None, 8000, "info")
    assert args.allowed_origins == args.allowed_methods == args.allowed_headers == ["*"]
    assert args.response_role == "assistant" and args.api_key is None
    assert EngineArgs.from_cli_args(args).model == EngineArgs().model


@pytest.mark.parametrize("body, message", [
    ("no-such-flag: 1\n", "unknown option 'no-such-flag'"),
    ("port: eighty\n", "invalid int value"),
    ("- a\n- b\n", "expected a mapping"),
    ("dtype: float8\n", "invalid choice"),
])
def test_bad_config_is_refused_with_a_message(tmp_path, capsys, body, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(body)
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(cfg)])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_config_file(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--config", "/nonexistent/x.yaml"])
    assert "/nonexistent/x.yaml" in capsys.readouterr().err


def test_multi_host_layouts():
    """The multi-host configs (docs/multi-host.md): one command per host, follower flags on the
    command line; on a TPU slice every host runs the same command (jax detects the slice)."""
    def load(name, *flags):
        return EngineArgs.from_cli_args(parse_args(["--config", str(CONFIG_DIR / name), *flags]))

    v5e = load("tpu-v5e-16-llama3-70b.yaml")
    assert v5e.tensor_parallel_size == 16 and v5e.nnodes == 1 and not v5e.headless
    assert load("tpu-v6e-16-qwen3-moe.yaml").enable_expert_parallel
    node0 = load("h100-2node-llama3-70b.yaml")
    node1 = load("h100-2node-llama3-70b.yaml", "--node-rank", "1", "--headless")
    assert (node0.nnodes, node0.node_rank, node0.headless) == (2, 0, False)
    assert (node1.nnodes, node1.node_rank, node1.headless) == (2, 1, True)
    assert node0.tensor_parallel_size == 16 and node0.master_addr == node1.master_addr
    text = (CONFIG_DIR / "h100-2node-llama3-70b.yaml").read_text()
    assert "--node-rank 1 --headless" in text
    dp0 = load("h100-2node-llama3-8b-dp16.yaml")
    dp1 = load("h100-2node-llama3-8b-dp16.yaml", "--headless", "--data-parallel-start-rank", "8")
    assert (dp0.data_parallel_size, dp0.data_parallel_local, dp0.headless) == (16, 8, False)
    assert (dp1.data_parallel_start_rank, dp1.data_parallel_local, dp1.headless) == (8, 8, True)
    assert dp0.data_parallel_address == dp1.data_parallel_address and dp0.nnodes == 1
    text = (CONFIG_DIR / "h100-2node-llama3-8b-dp16.yaml").read_text()
    assert "--headless --data-parallel-start-rank 8" in text
