"""Multi-host start-up: one process per host joins JAX's distributed runtime.

jaxllm runs on the runtime JAX already has: `jax.distributed.initialize` connects the processes
(its coordination service on rank 0), after which `jax.devices()` lists every host's devices and
one mesh spans them all; XLA's collectives (ICI/DCN on TPU, NCCL on GPU, gloo on CPU) carry the
tensor-parallel traffic. Rank 0 schedules and serves; the other ranks replay its step programs
(jaxllm/parallel/step_channel.py carries the inputs).

Flags are vLLM's multi-node ones: --nnodes, --node-rank, --master-addr, --master-port. Without
them, a launcher that starts several tasks (SLURM, Open MPI, a multi-host Cloud TPU slice) is
detected from its environment and jax fills in the coordinator, count and rank itself.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import jax

logger = logging.getLogger("jaxllm")


@dataclass(frozen=True)
class Topology:
    """Where this process stands: its rank among num_processes, and rank 0's address (where
    the step channel listens; None when jax found the coordinator itself)."""
    rank: int = 0
    num_processes: int = 1
    leader_host: str | None = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def multi_host(self) -> bool:
        return self.num_processes > 1


_topology: Topology | None = None


def launcher_with_several_tasks() -> str | None:
    """The launcher, if this process is one of several tasks it started (read from its
    environment: nothing is queried over the network)."""
    env = os.environ
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return "SLURM"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "Open MPI"
    if "," in env.get("TPU_WORKER_HOSTNAMES", ""):
        return "Cloud TPU slice"
    return None


STARTUP_TIMEOUT = 600  # seconds for every host to reach the same point of start-up
# At exit every process waits for the others at a shutdown barrier; after a failed start-up
# they never come, so the wait is bounded. A clean stop reaches it within seconds on idle
# hosts, but 4 processes sharing 2 busy cores missed 30 s (tests/test_multihost.py).
SHUTDOWN_TIMEOUT = 120


def initialize(nnodes: int, node_rank: int, master_addr: str, master_port: int) -> Topology:
    """Join the distributed runtime once per process (before anything touches a device);
    a second call returns the first one's topology."""
    global _topology
    if _topology is not None:
        return _topology
    launcher = launcher_with_several_tasks()
    if nnodes > 1:
        logger.info("Joining %d processes as rank %d (coordinator %s:%d)", nnodes, node_rank,
                    master_addr, master_port)
        jax.distributed.initialize(f"{master_addr}:{master_port}", num_processes=nnodes,
                                   process_id=node_rank, initialization_timeout=STARTUP_TIMEOUT,
                                   shutdown_timeout_seconds=SHUTDOWN_TIMEOUT)
        _topology = Topology(node_rank, nnodes, master_addr)
    elif launcher is not None:
        logger.info("Started by %s with several tasks: jax.distributed detects the rest", launcher)
        jax.distributed.initialize(initialization_timeout=STARTUP_TIMEOUT,
                                   shutdown_timeout_seconds=SHUTDOWN_TIMEOUT)
        _topology = Topology(jax.process_index(), jax.process_count(), None)
    else:
        _topology = Topology()
    if _topology.multi_host:
        logger.info("Process %d of %d: %d local of %d devices", _topology.rank,
                    _topology.num_processes, jax.local_device_count(), jax.device_count())
    return _topology
