"""Rank 0 hands every step program call to the other ranks, which run the same call on their
devices (multi-controller JAX: each process launches its part of every program).

Why a TCP socket and not the distributed runtime: `multihost_utils.broadcast_one_to_all` is
itself a compiled collective with fixed shapes (a step's inputs change shape with its bucket),
and it costs far more per call than pickling a step's host inputs down a socket
(docs/multi-host.md, 'How steps reach the other hosts', has the numbers). The
socket's address is published through the runtime's key-value store, so no extra flag is needed.

What crosses: the program key and its arguments, pickled, with each device array replaced by a
number (`persistent_id`). Both sides number the device arrays the same way: the KV cache and
the constant inputs made at start-up, then every output of every call in call order, so a
follower finds the array rank 0 meant (the previous step's sampled tokens, this step's hidden
rows, the donated cache) among its own. The weights (one tree per pipeline stage) travel as
names.

A lost host never hangs rank 0: each follower sends a heartbeat every second; when one stops
(the process died: end of stream; or hangs, once warmed up: `timeout` seconds of silence),
rank 0 runs its host-lost hooks (the server fails its requests with an error) and exits with
HOST_LOST_EXIT (its collectives with the dead host would otherwise wait forever). A follower
whose rank 0 is gone exits the same way; one told to stop (rank 0 shut down cleanly) returns.
"""

from __future__ import annotations

import collections
import io
import logging
import os
import pickle
import socket
import threading
import time
from typing import Any, Callable, Optional

import jax

from jaxllm.parallel.distributed import STARTUP_TIMEOUT
from jaxllm.parallel.wire import no_delay, recv_frame, send_frame

logger = logging.getLogger("jaxllm")

HOST_LOST_EXIT = 3
HEARTBEAT_SECONDS = 1.0
KEEP_ARRAYS = 1024  # device arrays remembered by number (a step makes ~10)
_KEY = "jaxllm/step_channel"
_STOP = b"stop"
_READY = b"r"  # follower -> rank 0: warmed up, replaying (heartbeats are b"h")
_host_lost_hooks: list[Callable[[str], None]] = []


def add_host_lost_hook(hook: Callable[[str], None]) -> None:
    """Call hook(reason) when a host of the group is lost, before this process exits."""
    _host_lost_hooks.append(hook)


def host_lost(reason: str, grace: float = 2.0) -> None:
    """Report, let the hooks answer their requests for `grace` seconds, and exit non-zero
    (os._exit: a collective stuck on the dead host cannot be unwound)."""
    logger.error("Host lost: %s; exiting with code %d", reason, HOST_LOST_EXIT)
    for hook in list(_host_lost_hooks):
        try:
            hook(reason)
        except Exception:
            logger.exception("host-lost hook failed")
    time.sleep(grace if _host_lost_hooks else 0.0)
    os._exit(HOST_LOST_EXIT)


class ArrayTable:
    """Device arrays known to every rank by the same number."""

    def __init__(self):
        self._next = 0
        self._arrays: dict[int, Any] = {}
        self._numbers: dict[int, int] = {}  # id(array) -> number

    def add_outputs(self, tree) -> None:
        for leaf in jax.tree.leaves(tree):
            if isinstance(leaf, jax.Array):
                n, self._next = self._next, self._next + 1
                self._arrays[n] = leaf
                self._numbers[id(leaf)] = n
                old = self._arrays.pop(n - KEEP_ARRAYS, None)
                if old is not None and self._numbers.get(id(old)) == n - KEEP_ARRAYS:
                    del self._numbers[id(old)]

    def number(self, array) -> int:
        n = self._numbers.get(id(array))
        if n is None or self._arrays.get(n) is not array:
            raise RuntimeError("a step program was given a device array the other hosts do "
                               "not have (not made at start-up nor by an earlier step)")
        return n

    def __getitem__(self, n: int):
        return self._arrays[n]


def _kv_client():
    from jax._src import distributed  # the runtime's key-value store (no public handle yet)
    return distributed.global_state.client


class StepLeader:
    """Rank 0's end: accepts the followers, sends each call, watches their heartbeats."""

    def __init__(self, num_followers: int, host: Optional[str], weights, initial_arrays,
                 timeout: float, startup_timeout: float = STARTUP_TIMEOUT, store=None):
        """store: where the channel's address is published (`key_value_set`); by default the
        distributed runtime's key-value store (a test passes one in memory)."""
        self.weights = weights
        self.table = ArrayTable()
        self.table.add_outputs(initial_arrays)
        # The last calls' host time to encode and send (what multi-host adds to a step on
        # rank 0): wall clock, and CPU time of the sending thread (the wall clock also counts
        # waits for the cores the devices' previous step is using).
        self.call_seconds: collections.deque = collections.deque(maxlen=4096)
        self.call_cpu_seconds: collections.deque = collections.deque(maxlen=4096)
        self.calls = 0
        self._lock = threading.Lock()
        server = socket.create_server(("", 0))
        host = host or socket.gethostbyname(socket.gethostname())
        store = _kv_client() if store is None else store
        store.key_value_set(_KEY, f"{host}:{server.getsockname()[1]}")
        server.settimeout(startup_timeout)
        self._socks = []
        for _ in range(num_followers):
            sock, _ = server.accept()
            self._socks.append(no_delay(sock))
        server.close()
        self._closing = False
        for rank, sock in enumerate(self._socks, start=1):
            threading.Thread(target=self._watch, args=(sock, timeout), daemon=True,
                             name=f"jaxllm-heartbeat-{rank}").start()

    def send(self, key, args: tuple) -> None:
        t, cpu = time.perf_counter(), time.thread_time()
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = self._persistent_id
        pickler.dump((key, args))
        data = buf.getvalue()
        with self._lock:
            for sock in self._socks:
                send_frame(sock, data)
        self.call_seconds.append(time.perf_counter() - t)
        self.call_cpu_seconds.append(time.thread_time() - cpu)
        self.calls += 1

    def track(self, outputs) -> None:
        self.table.add_outputs(outputs)

    def _persistent_id(self, obj):
        for i, tree in enumerate(self.weights):
            if obj is tree:
                return f"weights{i}"
        if isinstance(obj, jax.Array):
            return self.table.number(obj)
        return None

    def close(self) -> None:
        """Tell the followers to stop (a clean shutdown)."""
        self._closing = True
        with self._lock:
            for sock in self._socks:
                try:
                    send_frame(sock, _STOP)
                except OSError:
                    pass

    def disconnect(self) -> None:
        """close(), then close the sockets: this process is done with the channel, and the
        heartbeat watchers end without reporting a lost host."""
        self.close()
        for sock in self._socks:
            sock.close()

    def _watch(self, sock: socket.socket, timeout: float) -> None:
        """Until the follower is ready (its warm-up can starve its heartbeat thread of the
        GIL for long stretches on a loaded host), only its death counts; then its silence."""
        sock.settimeout(STARTUP_TIMEOUT)
        try:
            while data := sock.recv(64):
                if _READY in data:
                    sock.settimeout(timeout)
            reason = "a follower host closed its step channel (the process ended)"
        except socket.timeout:
            reason = f"no heartbeat from a follower host for {timeout:.0f} s"
        except OSError as e:
            reason = f"the step channel to a follower host failed: {e}"
        if not self._closing:
            host_lost(reason)


class StepFollower:
    """A follower's end: connects to rank 0, yields its calls, sends heartbeats."""

    def __init__(self, weights, initial_arrays, startup_timeout: float = STARTUP_TIMEOUT,
                 store=None):
        """store: where rank 0 published the channel's address (`blocking_key_value_get`);
        by default the distributed runtime's key-value store."""
        self.weights = weights
        self.table = ArrayTable()
        self.table.add_outputs(initial_arrays)
        store = _kv_client() if store is None else store
        address = store.blocking_key_value_get(_KEY, int(startup_timeout * 1000))
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)), timeout=startup_timeout)
        self._sock.settimeout(None)
        no_delay(self._sock)
        self._stopped = False
        threading.Thread(target=self._heartbeat, daemon=True, name="jaxllm-heartbeat").start()

    def calls(self):
        """(key, args) of each call rank 0 makes, until it says stop."""
        self.send_ready()
        while True:
            try:
                data = recv_frame(self._sock)
            except OSError as e:
                host_lost(f"rank 0's step channel failed: {e}")
            if data == _STOP:
                self._stopped = True
                return
            unpickler = pickle.Unpickler(io.BytesIO(data))
            unpickler.persistent_load = self._persistent_load
            yield unpickler.load()

    def send_ready(self) -> None:
        """Tell rank 0 this host is warmed up: from now on, `timeout` seconds without a
        heartbeat count as a hung host. calls() sends it before its first call."""
        self._sock.sendall(_READY)

    def disconnect(self) -> None:
        """Leave the channel without reporting rank 0 lost (heartbeats stop): to rank 0 this
        host is gone, as when its process ends."""
        self._stopped = True
        self._sock.close()

    def _persistent_load(self, pid):
        if isinstance(pid, str):
            return self.weights[int(pid.removeprefix("weights"))]
        return self.table[pid]

    def _heartbeat(self) -> None:
        while True:
            try:
                self._sock.sendall(b"h")
            except OSError as e:
                if not self._stopped:
                    host_lost(f"rank 0's step channel failed: {e}")
                return
            time.sleep(HEARTBEAT_SECONDS)
