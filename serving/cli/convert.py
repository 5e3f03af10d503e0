"""`jaxllm convert MODEL OUT`: load a model as `jaxllm serve` would (quantized, dequantized
from GGUF, sharded over --tensor-parallel-size devices) and save the loaded weights with
orbax-checkpoint, for `--load-format sharded_state` (jaxllm/loader/sharded_state.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time

from jaxllm.config import EngineArgs
from serving.log_setup import add_log_level_arg, setup_logging

logger = logging.getLogger("jaxllm")


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "convert", help="Save a model's loaded weights for --load-format sharded_state.",
        description="Load MODEL (with the engine flags given: --tensor-parallel-size, --dtype, "
                    "--quantization, ...) and write its weights, config and tokenizer to OUT "
                    "as an orbax checkpoint that `jaxllm serve OUT` restores onto any mesh.",
        usage="jaxllm convert MODEL OUT [options]")
    add_log_level_arg(parser)
    EngineArgs.add_cli_args(parser, positional_model=True)
    parser.add_argument("out", help="The folder to write (must not hold a checkpoint).")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from jaxllm.loader.default_model import resolve_model
    from jaxllm.loader import sharded_state
    from jaxllm.loader.loader import hf_config, load_model
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.tokenizer import get_tokenizer

    setup_logging(args.log_level)
    config = EngineArgs.from_cli_args(args).create_engine_config()
    path = resolve_model(config.load.model)
    load = dataclasses.replace(config.load, model=path)
    t = time.perf_counter()
    mesh = make_mesh(config.parallel.tensor_parallel_size)
    model, cfg = load_model(load, config.model, mesh)
    loaded = time.perf_counter() - t
    tokenizer = None if load.skip_tokenizer_init else get_tokenizer(load)
    t = time.perf_counter()
    sharded_state.save(model, cfg, config.model, hf_config(path), args.out, tokenizer,
                       source=path)
    logger.info("Loaded %s in %.1f s; wrote %s in %.1f s (serve it with `jaxllm serve %s`)",
                path, loaded, args.out, time.perf_counter() - t, args.out)
    return 0
