"""`jaxllm serve [MODEL] [options]`: the OpenAI-compatible server, flags as `vllm serve`."""

from __future__ import annotations

import argparse

from jaxllm.config import EngineArgs
from serving.cli_args import add_server_args, expand_config_file
from serving.log_setup import add_log_level_arg, setup_logging
from serving.vllm_flags import add_vllm_flags


def make_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_server_args(parser)
    add_log_level_arg(parser)
    EngineArgs.add_cli_args(parser, positional_model=True)
    add_vllm_flags(parser)  # the rest of vLLM's flags: refused by name at start-up
    return parser


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve", help="Start the OpenAI-compatible API server.",
        description="Start the OpenAI-compatible API server (same flags as `vllm serve`).",
        usage="jaxllm serve [MODEL] [options]")
    make_parser(parser)
    parser.set_defaults(func=run)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse `serve` flags, `--config FILE.yaml` included (what the CLI and tests both use)."""
    parser = make_parser(argparse.ArgumentParser(prog="jaxllm serve"))
    return parser.parse_args(expand_config_file(parser, argv))


def run(args: argparse.Namespace) -> None:
    from jaxllm.config import ConfigError
    from jaxllm.deploy.replica_node import run_dp_node
    from jaxllm.deploy.follower import follows_rank_0, run_headless
    setup_logging(args.log_level)
    try:
        engine_args = EngineArgs.from_cli_args(args)
        if engine_args.headless and engine_args.data_parallel_size > 1:
            run_dp_node(engine_args)  # replicas for the API node of a multi-node DP group
            return
        follower = follows_rank_0(engine_args)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    if follower:  # a multi-host follower: rank 0 serves the API
        run_headless(engine_args)
        return
    from serving.api_server import run_server  # FastAPI and the engine load only when serving
    run_server(args)
