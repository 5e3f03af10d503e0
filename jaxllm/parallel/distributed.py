"""Multi-host start-up: one process per host joins JAX's distributed runtime.

jaxllm runs on the runtime JAX already has: `jax.distributed.initialize` connects the processes
(its coordination service on rank 0), after which `jax.devices()` lists every host's devices and
one mesh spans them all; XLA's collectives (ICI/DCN on TPU, NCCL on GPU, gloo on CPU) carry the
tensor-parallel traffic. Rank 0 schedules and serves; the other ranks replay its step programs
(jaxllm/parallel/step_channel.py carries the inputs).

Pipeline stages on different hosts hand their hidden states on with `jax.device_put` too: JAX's
cross-host transfer server (a socket per process, found through the coordination service)
carries them, enabled here before the backend starts (`cross_host_transfers`; see
jaxllm/worker/pipeline_runner.py for why this and not a ppermute).

Flags are vLLM's multi-node ones: --nnodes, --node-rank, --master-addr, --master-port. Without
them, a launcher that starts several tasks (SLURM, Open MPI, a multi-host Cloud TPU slice) is
detected from its environment and jax fills in the coordinator, count and rank itself.
"""

from __future__ import annotations

import logging
import os
import socket
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
# hosts, but processes sharing a few busy cores (tests/test_multihost.py) can take far longer,
# so the bound is generous.
SHUTDOWN_TIMEOUT = 120


def local_address(peer: str | None) -> str:
    """This host's address on the route to `peer` (a UDP connect sends nothing); without a
    peer (a launcher found the coordinator), its host name's."""
    if peer is not None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((peer, 9))
                return s.getsockname()[0]
            except OSError:
                pass
    return socket.gethostbyname(socket.gethostname())


def enable_cross_host_transfers(peer: str | None) -> None:
    """Let `jax.device_put` move arrays between processes' devices: JAX's transfer server
    listens on this host's address towards `peer` (the coordinator). Its port must be given
    (JAX publishes a port 0 as given, not as the port the server bound, and the receiver then
    waits forever); one free now is taken."""
    host = local_address(peer)
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    jax.config.update("jax_cross_host_transfer_socket_address", f"{host}:{port}")
    jax.config.update("jax_cross_host_transport_addresses", f"{host}:0")


def initialize(nnodes: int, node_rank: int, master_addr: str, master_port: int,
               cross_host_transfers: bool = False) -> Topology:
    """Join the distributed runtime once per process (before anything touches a device);
    a second call returns the first one's topology. cross_host_transfers: arrays will move
    between hosts' devices (pipeline stages on several hosts)."""
    global _topology
    if _topology is not None:
        return _topology
    launcher = launcher_with_several_tasks()
    if cross_host_transfers and (nnodes > 1 or launcher is not None):
        enable_cross_host_transfers(master_addr if nnodes > 1 else None)
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
