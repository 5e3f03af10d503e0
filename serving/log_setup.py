"""`--log-level` and the log's set-up for the `jaxllm` commands that run an engine.

jaxllm's own loggers (`jaxllm.*`) log at the chosen level. Other libraries log warnings and
errors only, and their info lines at debug (their debug lines would bury jaxllm's): at info,
jax announces on every start that it found no TPU ("Unable to initialize backend 'tpu'"),
which a user reads as a failure.
"""

from __future__ import annotations

import argparse
import logging

LEVELS = ("debug", "info", "warning", "error", "critical")


def add_log_level_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=LEVELS,
                        help="Level of jaxllm's log (default: info); debug adds where the "
                             "start-up time goes, and other libraries' info lines.")


def setup_logging(level: str = "info") -> None:
    """Configure the root handler (unless the process already has one) and the levels."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING,
                            format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
                            datefmt="%m-%d %H:%M:%S")
    numeric = getattr(logging, level.upper())
    logging.getLogger().setLevel(logging.INFO if level == "debug" else logging.WARNING)
    logging.getLogger("jaxllm").setLevel(numeric)
