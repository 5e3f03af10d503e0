"""Moving a runner's trees of device arrays out of device memory and back (sleep mode).

Offloaded arrays go to the platform's pinned host memory where it has one apart from the
device's own (GPU, TPU: `jax.device_put` to the sharding's `pinned_host` memory kind, still
sharded); on a platform whose device memory is host memory (CPU) they become NumPy arrays.
Either way the device buffers are deleted at once, not left to the garbage collector, so the
memory is free when the call returns.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def device_bytes(tree: Any) -> int:
    """Bytes the tree's live device arrays hold on their devices (all shards)."""
    return sum(sum(s.data.nbytes for s in x.addressable_shards)
               for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not x.is_deleted())


def delete(tree: Any) -> None:
    """Free the tree's device buffers now."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def _pinned_host(x: jax.Array):
    """x's sharding in pinned host memory, or None where the platform has no such memory
    apart from the device's."""
    device = next(iter(x.sharding.device_set))
    kinds = {m.kind for m in device.addressable_memories()}
    if device.platform == "cpu" or "pinned_host" not in kinds:  # a CPU's memory kinds are
        return None                                              # all the same host memory
    return x.sharding.with_memory_kind("pinned_host")


def offload(tree: Any) -> tuple[Any, Any]:
    """(a host copy of the tree, its arrays' shardings); the device buffers are freed."""
    shardings = jax.tree.map(lambda x: x.sharding, tree)

    def to_host(x):
        host = _pinned_host(x)
        return np.asarray(jax.device_get(x)) if host is None else jax.device_put(x, host)

    host = jax.tree.map(to_host, tree)
    jax.block_until_ready([x for x in jax.tree.leaves(host) if isinstance(x, jax.Array)])
    delete(tree)
    return host, shardings


def restore(host: Any, shardings: Any) -> Any:
    """The tree back on its devices, placed as before (`offload`'s result)."""
    tree = jax.tree.map(lambda x, s: jax.device_put(x, s), host, shardings)
    delete(host)  # pinned host buffers (NumPy copies are freed with `host`)
    return jax.block_until_ready(tree)
