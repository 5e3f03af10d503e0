"""A node of a multi-node data-parallel deployment that serves no API (`jaxllm serve --headless
--data-parallel-size N --data-parallel-size-local L --data-parallel-start-rank S`): it runs
replicas S .. S+L-1, each a whole LLMEngine on its own --tensor-parallel-size local devices,
and takes the API node's engine calls for each over its own connection
(jaxllm/deploy/remote_replica.py is the other end).

Each replica registers only once it is loaded and compiled, and answers in its own thread, so
the node's replicas step at once. The node returns when the API node stops cleanly, and exits
with HOST_LOST_EXIT when the API node is gone (it holds no request anyone can still read).
"""

from __future__ import annotations

import logging
import pickle
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import jax

from jaxllm.config import ConfigError, EngineArgs
from jaxllm.deploy.remote_replica import STOP, node_fingerprint
from jaxllm.engine.engine import LLMEngine
from jaxllm.parallel.distributed import STARTUP_TIMEOUT
from jaxllm.parallel.mesh import device_groups
from jaxllm.parallel.step_channel import host_lost
from jaxllm.parallel.wire import no_delay, recv_frame, send_frame

logger = logging.getLogger("jaxllm")

CALLS = ("add_request", "abort_request", "step", "encode", "add_lora", "remove_lora",
         "list_loras")


def local_replicas(args: EngineArgs) -> list[LLMEngine]:
    """This node's replicas, replica i on local devices i*TP .. (i+1)*TP-1, built in turn."""
    groups = device_groups("--data-parallel-size-local", args.data_parallel_local, "replicas",
                           args.tensor_parallel_size, jax.local_devices())
    return [LLMEngine(args, devices=g) for g in groups]


def connect(args: EngineArgs, rank: int, engine: LLMEngine,
            timeout: float = STARTUP_TIMEOUT) -> socket.socket:
    """Register `engine` as `rank` with the API node, retrying until it listens."""
    address = (args.data_parallel_address, args.data_parallel_rpc_port)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = no_delay(socket.create_connection(address, timeout=timeout))
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConfigError(f"--data-parallel-address {address[0]} --data-parallel-rpc-"
                                  f"port {address[1]}: no API node there ({e})") from None
            time.sleep(0.5)
    hello = {"rank": rank, "args": node_fingerprint(args), "stats": engine.stats(),
             "clock": time.monotonic()}
    send_frame(sock, pickle.dumps(hello))
    answer = pickle.loads(recv_frame(sock))
    if answer["error"]:
        raise ConfigError(f"the API node refused data-parallel rank {rank}: {answer['error']}")
    sock.settimeout(None)  # idle for as long as the API node has no request for it
    return sock


def serve(sock: socket.socket, engine: LLMEngine, rank: int) -> None:
    """Answer the API node's calls until it says stop; exits if it is lost."""
    while True:
        try:
            data = recv_frame(sock)
        except OSError as e:
            host_lost(f"the API node's connection to data-parallel rank {rank} failed: {e}")
        if data == STOP:
            return
        method, args = pickle.loads(data)
        t = time.monotonic()
        reply = {"kind": "ok", "result": None, "error": None}
        try:
            if method not in CALLS:
                raise RuntimeError(f"unknown call {method!r}")
            reply["result"] = getattr(engine, method)(*args)
        except ValueError as e:  # an invalid request: its caller is told, the replica serves on
            reply.update(kind="invalid", error=str(e))
        except Exception as e:
            logger.exception("data-parallel rank %d: %s failed", rank, method)
            reply.update(kind="failed", error=repr(e))
        reply.update(seconds=time.monotonic() - t, stats=engine.stats(),
                     unfinished=engine.get_num_unfinished_requests(), clock=time.monotonic())
        send_frame(sock, pickle.dumps(reply))


def run_dp_node(args: EngineArgs) -> int:
    """Load, compile and register this node's replicas, then serve them; returns the number
    of replicas served."""
    engines = local_replicas(args)
    for e in engines:
        e.wait_for_background_compiles()
    ranks = range(args.data_parallel_start_rank, args.data_parallel_start_rank + len(engines))
    socks = [connect(args, rank, e) for rank, e in zip(ranks, engines)]
    logger.info("Headless: data-parallel ranks %s serving the API node at %s:%d", list(ranks),
                args.data_parallel_address, args.data_parallel_rpc_port)
    with ThreadPoolExecutor(len(engines), thread_name_prefix="jaxllm-dp-node") as pool:
        list(pool.map(serve, socks, engines, ranks))
    logger.info("The API node stopped; data-parallel ranks %s done", list(ranks))
    return len(engines)

