"""A follower host (`jaxllm serve --headless --node-rank K`): no scheduler and no API, only
rank 0's step programs run on this host's devices, in rank 0's order, with rank 0's inputs.

It builds the same engine parts as rank 0 (same weights, cache and compiled programs), so the
arrays both sides number (jaxllm/parallel/step_channel.py) match. It returns when rank 0 shuts
down cleanly and exits non-zero (HOST_LOST_EXIT) when rank 0 is lost.
"""

from __future__ import annotations

import logging

from jaxllm.config import ConfigError, EngineArgs
from jaxllm.engine.startup import build_engine_parts, join_hosts

logger = logging.getLogger("jaxllm")


def follows_rank_0(args: EngineArgs) -> bool:
    """Join the hosts; whether this process is a follower (a rank but 0: with --headless, or
    any task but the first of a detected launcher, which all run the same command)."""
    topo = join_hosts(args.create_engine_config().parallel)
    if args.headless and topo.is_leader:
        raise ConfigError(f"--headless: this process is rank 0 of {topo.num_processes}, which "
                          f"serves the API")
    return not topo.is_leader


def run_headless(args: EngineArgs) -> int:
    """Replay rank 0's steps until it stops; returns the number of program calls run."""
    parts = build_engine_parts(args.create_engine_config(), headless=True)
    runner, follower = parts.runner, parts.step_follower
    logger.info("Headless: running rank 0's steps")
    calls = 0
    for key, call_args in follower.calls():
        follower.table.add_outputs(runner.replay(key, call_args))
        calls += 1
    logger.info("Rank 0 stopped after %d program calls", calls)
    return calls
