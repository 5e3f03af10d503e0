"""Every flag of `vllm serve` (vLLM 0.32, serving/vllm_flags.py) is known to `jaxllm serve`: it
is implemented, or refused at start-up with an error naming it, or (vLLM's own no-ops) accepted
with vLLM's deprecation warning. Nothing a vLLM command line says is silently misread."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from jaxllm.config import ConfigError, EngineArgs
from serving.cli.serve import parse_args
from serving.vllm_flags import (ALREADY_SO, DEPRECATED_NOOPS, ENGINE_FLAGS, FRONTEND_FLAGS,
                                check_vllm_flags)

ALL_FLAGS = sorted(set(ENGINE_FLAGS + FRONTEND_FLAGS + list(DEPRECATED_NOOPS)))


def _parser() -> argparse.ArgumentParser:
    from serving.cli.serve import make_parser
    return make_parser(argparse.ArgumentParser(prog="jaxllm serve"))


def test_the_lists_hold_vllms_whole_surface():
    # Spot checks against vLLM 0.32's parser (scripts/list_vllm_flags.py), and no duplicates.
    assert len(ENGINE_FLAGS) > 250 and len(FRONTEND_FLAGS) > 60
    assert len(set(ENGINE_FLAGS + FRONTEND_FLAGS)) == len(ENGINE_FLAGS + FRONTEND_FLAGS)
    for flag in ("--runner", "--convert", "--pooler-config", "--optimization-level", "-tp",
                 "-asc", "--headless", "--middleware", "--return-tokens-as-token-ids",
                 "--kv-offloading-size", "--speculative-config", "--enable-lora"):
        assert flag in ENGINE_FLAGS + FRONTEND_FLAGS


@pytest.mark.parametrize("flag", ALL_FLAGS)
def test_every_vllm_flag_is_implemented_or_refused_by_name(flag, caplog):
    parser = _parser()
    action = parser._option_string_actions.get(flag)
    assert action is not None, f"{flag} is unknown to jaxllm serve"
    if action.dest != "vllm_flags_given":
        return  # implemented: a jaxllm flag of the same name (its own tests cover it)
    args = parser.parse_args([flag] if action.nargs == 0 else [flag, "1"])
    assert args.vllm_flags_given == [flag]
    if flag in DEPRECATED_NOOPS or flag in ALREADY_SO:
        with caplog.at_level(logging.INFO, logger="jaxllm.serving"):
            check_vllm_flags(args)
        assert flag in caplog.text
    else:
        with pytest.raises(ConfigError, match=f"^{flag} is a vLLM 0.32.0 flag"):
            check_vllm_flags(args)


def test_implemented_flags_reach_engine_or_server_args():
    """A flag jaxllm defines lands in an EngineArgs field or a server option that is read."""
    parser = _parser()
    engine = {f.name for f in dataclasses.fields(EngineArgs)}
    implemented = {parser._option_string_actions[f].dest for f in ALL_FLAGS
                   if parser._option_string_actions[f].dest != "vllm_flags_given"}
    server = {"host", "port", "api_key", "config"}  # a sample of serving/cli_args.py's
    assert len(implemented) > 60
    assert implemented & engine and server <= implemented


@pytest.mark.parametrize("argv, level, eager", [
    (["-O0"], 0, True), (["-O", "0"], 0, True), (["-O=3"], 3, False), (["-O1"], 1, False),
    ([], 2, False), (["--optimization-level", "0"], 0, True),
])
def test_optimization_level(argv, level, eager):
    args = EngineArgs.from_cli_args(parse_args(["m", *argv]))
    assert (args.optimization_level, args.enforce_eager) == (level, eager)


def test_optimization_level_out_of_range_is_refused():
    with pytest.raises(SystemExit):
        parse_args(["m", "-O4"])
    with pytest.raises(ConfigError, match="--optimization-level"):
        EngineArgs(optimization_level=7)


def test_noop_boolean_does_not_swallow_the_model():
    args = parse_args(["--disable-cascade-attn", "my/model"])
    assert args.model_tag == "my/model" and args.vllm_flags_given == ["--disable-cascade-attn"]


def test_serve_refuses_an_unimplemented_flag_before_loading(capsys):
    from serving.cli.main import main
    with pytest.raises(SystemExit) as e:
        main(["serve", "m", "--cpu-offload-gb", "4"])
    assert "--cpu-offload-gb" in str(e.value.code)
