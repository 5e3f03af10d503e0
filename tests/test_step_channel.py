"""The multi-host pieces that need no second process: the flags' checks, launcher detection,
and the step channel over a real loopback socket (its key-value store faked), device arrays
crossing as numbers, a clean stop, and a lost follower reported instead of waited for.
The two-process runs are in tests/test_multihost.py (slow)."""

from __future__ import annotations

import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ConfigError, EngineArgs
from jaxllm.parallel import distributed, step_channel
from jaxllm.parallel.step_channel import ArrayTable, StepFollower, StepLeader


@pytest.mark.parametrize("kw, flag", [
    (dict(nnodes=2, node_rank=2, headless=True), "--node-rank"),
    (dict(nnodes=2, node_rank=1), "--node-rank"),             # a follower without --headless
    (dict(nnodes=2, node_rank=0, headless=True), "--headless"),  # rank 0 serves the API
    (dict(nnodes=0), "--nnodes"),
    (dict(distributed_timeout_seconds=0), "--distributed-timeout-seconds"),
])
def test_multi_host_flags_are_checked_by_name(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        EngineArgs(**kw)


def test_multi_host_flags_accept_a_follower():
    args = EngineArgs(nnodes=4, node_rank=3, headless=True, master_addr="10.0.0.1",
                      master_port=1234)
    assert (args.nnodes, args.node_rank, args.master_port) == (4, 3, 1234)


@pytest.mark.parametrize("env, launcher", [
    ({"SLURM_NTASKS": "4"}, "SLURM"), ({"SLURM_NTASKS": "1"}, None),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "Open MPI"),
    ({"TPU_WORKER_HOSTNAMES": "t-0,t-1"}, "Cloud TPU slice"),
    ({"TPU_WORKER_HOSTNAMES": "t-0"}, None), ({}, None)])
def test_launchers_with_several_tasks_are_detected(monkeypatch, env, launcher):
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert distributed.launcher_with_several_tasks() == launcher


def test_array_table_numbers_outputs_in_order_and_refuses_strangers():
    a, b = jnp.zeros(2), jnp.ones(3)
    table = ArrayTable()
    table.add_outputs((a, None, {"x": b, "n": np.int32(4)}))  # only device arrays are numbered
    assert table.number(a) == 0 and table.number(b) == 1 and table[1] is b
    with pytest.raises(RuntimeError, match="other hosts do not have"):
        table.number(jnp.zeros(2))


class _FakeStore:
    """The distributed runtime's key-value store, in memory."""
    def __init__(self):
        self.values, self.set_event = {}, threading.Event()

    def key_value_set(self, key, value):
        self.values[key] = value
        self.set_event.set()

    def blocking_key_value_get(self, key, timeout_ms):
        assert self.set_event.wait(timeout_ms / 1000)
        return self.values[key]


@pytest.fixture
def channel(monkeypatch):
    """(leader, follower) joined over loopback; host_lost records instead of exiting."""
    store, lost = _FakeStore(), []
    monkeypatch.setattr(step_channel, "host_lost", lost.append)
    monkeypatch.setattr(step_channel, "HEARTBEAT_SECONDS", 0.05)
    weights = ({"w": jnp.ones(4)}, {"w": jnp.ones(2)})  # one tree per pipeline stage
    cache = jnp.zeros(8)
    box = {}
    t = threading.Thread(target=lambda: box.update(
        follower=StepFollower(({"w": jnp.ones(4)}, {"w": jnp.ones(2)}), (jnp.zeros(8),),
                              startup_timeout=10, store=store)))
    t.start()
    leader = StepLeader(1, "127.0.0.1", weights, (cache,), timeout=1.0, store=store)
    t.join(10)
    yield leader, box["follower"], weights, cache, lost
    leader.disconnect()
    box["follower"].disconnect()


def test_calls_cross_with_device_arrays_as_numbers(channel):
    leader, follower, weights, cache, lost = channel
    out = jnp.arange(3)
    leader.send("k1", (weights[0], cache, np.arange(5)))
    leader.track((out, cache))
    leader.send("k2", (weights[1], out))
    leader.close()
    calls = []
    for key, args in follower.calls():
        calls.append((key, args))
        follower.table.add_outputs((jnp.arange(3) + 10, args[1]))  # its own outputs
    assert [k for k, _ in calls] == ["k1", "k2"]
    (_, (w1, c1, host)), (_, (w2, o2)) = calls
    # the weights travel as names: each stage's tree is the follower's own
    assert w1 is follower.weights[0] and w2 is follower.weights[1]
    assert c1 is follower.table[0]                            # the start-up cache, its own
    np.testing.assert_array_equal(host, np.arange(5))         # host arrays by value
    np.testing.assert_array_equal(o2, np.arange(3) + 10)      # output 1 = its own output
    assert leader.calls == 2 and len(leader.call_seconds) == 2 and not lost


def test_a_silent_follower_is_reported_lost(channel):
    leader, follower, _, _, lost = channel
    follower.disconnect()  # its heartbeats stop and its end of the channel closes
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and "follower" in lost[0]


def test_a_hung_follower_is_reported_lost_once_ready(channel, monkeypatch):
    leader, follower, _, _, lost = channel
    monkeypatch.setattr(step_channel, "HEARTBEAT_SECONDS", 100.0)  # its next beat: far off
    time.sleep(0.2)
    follower.send_ready()  # warmed up: silence counts from now (1 s)
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and "no heartbeat" in lost[0]
