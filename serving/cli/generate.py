"""`jaxllm generate [MODEL] --prompt TEXT`: offline one-shot generation with `LLM`, no server.

Unset sampling flags take the model's generation-config defaults (`--generation-config auto`,
as vLLM's offline `LLM` and server do), then SamplingParams' own.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from jaxllm.config import EngineArgs
from serving.log_setup import add_log_level_arg, setup_logging

# (flag, type, help); unset flags keep SamplingParams' defaults.
SAMPLING_FLAGS = (
    ("--max-tokens", int, "Most tokens to generate (default: the model's generation config, "
                          "else 16)."),
    ("--temperature", float, "Sampling temperature; 0 = greedy (default: the model's "
                             "generation config, else 1.0)."),
    ("--top-p", float, "Nucleus sampling mass (default: the model's, else 1.0)."),
    ("--top-k", int, "Sample from the k most likely tokens; 0 = off."),
    ("--min-p", float, "Drop tokens below min_p x the top probability."),
    ("--n", int, "Completions to generate (default 1)."),
    ("--repetition-penalty", float, "Repetition penalty (1.0 = off)."),
    ("--presence-penalty", float, "Presence penalty."),
    ("--frequency-penalty", float, "Frequency penalty."),
)
SAMPLING_DESTS = {flag[2:].replace("-", "_") for flag, _, _ in SAMPLING_FLAGS} | {"stop",
                                                                                 "ignore_eos"}


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "generate", help="Generate text for one prompt offline (no server).",
        description="Load the model in this process, generate for --prompt and print the text.",
        usage="jaxllm generate [MODEL] --prompt TEXT [options]")
    sampling = parser.add_argument_group("sampling arguments")
    sampling.add_argument("--prompt", required=True, help="The prompt text.")
    for flag, kind, help_text in SAMPLING_FLAGS:
        sampling.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=help_text)
    sampling.add_argument("--stop", nargs="+", default=argparse.SUPPRESS,
                          help="Stop strings.")
    sampling.add_argument("--ignore-eos", action="store_true", default=argparse.SUPPRESS,
                          help="Keep generating after the end-of-sequence token.")
    add_log_level_arg(parser)
    EngineArgs.add_cli_args(parser, positional_model=True)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from jaxllm import LLM, SamplingParams

    setup_logging(args.log_level)
    engine_args = EngineArgs.from_cli_args(args)  # checked before the slow model load
    flags = {k: v for k, v in vars(args).items() if k in SAMPLING_DESTS}
    try:
        SamplingParams(**flags)  # a bad value fails before the slow model load too
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    given = {k: v for k, v in vars(args).items()
             if k in {f.name for f in dataclasses.fields(EngineArgs)}}
    llm = LLM(**{**given, "model": engine_args.model})
    try:
        params = dataclasses.replace(llm.get_default_sampling_params(), **flags)
    except ValueError as e:  # a flag that clashes with the model's defaults
        raise SystemExit(f"error: {e}") from None
    (output,) = llm.generate([args.prompt], params, use_tqdm=False)
    for i, completion in enumerate(output.outputs):
        if len(output.outputs) > 1:
            print(f"--- completion {i} ---")
        print(completion.text)
    _exit_now()


def _exit_now() -> None:
    """Leave without the interpreter's shutdown: it would wait for the background compile in
    hand (seconds; XLA aborts a process that finalizes under a running compile), for
    programs a one-shot command will never run. Compiled programs already saved stay saved
    (each file is written whole or not at all)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)
