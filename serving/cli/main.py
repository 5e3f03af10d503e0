"""The `jaxllm` command: serve, chat, complete, bench, collect-env, run-batch, generate,
convert.

Sub-command modules import only argparse-level code at start; JAX, FastAPI and the engine are
imported inside the command that needs them, so `jaxllm --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import jaxllm
from jaxllm.config import ConfigError, EngineArgs
from serving.cli_args import add_chat_output_args


def _register_run_batch(subparsers) -> None:
    parser = subparsers.add_parser(
        "run-batch", help="Run an OpenAI batch file (JSONL) offline.",
        description="Run the requests of an OpenAI batch input file (/v1/completions and "
                    "/v1/chat/completions lines) and write OpenAI batch output lines.",
        usage="jaxllm run-batch -i INPUT.jsonl -o OUTPUT.jsonl [--model MODEL] [options]")
    parser.add_argument("-i", "--input-file", required=True, help="Batch input file (JSONL).")
    parser.add_argument("-o", "--output-file", required=True, help="Where to write results.")
    parser.add_argument("--response-role", default="assistant",
                        help="Role of generated chat messages.")
    parser.add_argument("--chat-template", default=None,
                        help="Chat template file or Jinja string (default: the tokenizer's).")
    add_chat_output_args(parser)
    EngineArgs.add_cli_args(parser)

    def run(args):
        from serving.run_batch import run as run_batch
        return run_batch(args)

    parser.set_defaults(func=run)


def _register_bench(subparsers, load: bool) -> None:
    """`bench` lives in serving.cli.bench; it is imported only when `bench` is the command, and a
    missing or broken module breaks only `bench`."""
    error: Optional[ImportError] = None
    if load:
        try:
            from serving.cli import bench
        except ImportError as e:
            error = e
        else:
            bench.register(subparsers)
            return
    parser = subparsers.add_parser("bench", help="Benchmark latency and throughput.",
                                   description="Benchmark latency and throughput "
                                               "(jaxllm bench --help lists the benchmarks).")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def unavailable(args):
        print(f"error: jaxllm bench is not available: {error}", file=sys.stderr)
        return 1

    parser.set_defaults(func=unavailable)


def make_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, dict]:
    from serving.cli import collect_env, convert, generate, openai_client, serve

    parser = argparse.ArgumentParser(prog="jaxllm",
                                     description="jaxllm: LLM inference and serving on JAX/XLA, "
                                                 "with vLLM's CLI and OpenAI's API.")
    parser.add_argument("-v", "--version", action="version",
                        version=f"jaxllm {jaxllm.__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    serve_parser = serve.register(subparsers)
    openai_client.register(subparsers)
    _register_bench(subparsers, load=argv[:1] == ["bench"])
    collect_env.register(subparsers)
    _register_run_batch(subparsers)
    generate.register(subparsers)
    convert.register(subparsers)
    return parser, {"serve": serve_parser}


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, except that an unknown flag is reported by the sub-command it was given to
    (`jaxllm serve --bogus` shows `serve`'s usage): argparse hands sub-commands' unrecognized
    arguments up to the top-level parser, whose usage lists only the commands."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _selected_parser(parser, argv).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _selected_parser(parser: argparse.ArgumentParser,
                     argv: list[str]) -> argparse.ArgumentParser:
    """The innermost (sub-)parser that argv selects: `bench latency ...` -> bench latency's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for i, arg in enumerate(argv):
                if arg in action.choices:
                    return _selected_parser(action.choices[arg], argv[i + 1:])
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    from serving.cli_args import expand_config_file

    argv = sys.argv[1:] if argv is None else list(argv)
    parser, with_config = make_parser(argv)
    if argv[:1] and argv[0] in with_config:
        argv = [argv[0], *expand_config_file(with_config[argv[0]], argv[1:])]
    args = parse_args(parser, argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    try:
        return args.func(args) or 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
