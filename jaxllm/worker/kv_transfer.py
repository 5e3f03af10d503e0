"""The data side of the KV cache's host tier (--kv-offloading-size): a step's `KVTransfers`
applied to the device caches before its program runs.

Saved blocks are gathered from every cache array (one per layer group and K/V, blocks on axis
1) by one program per step and kept by key; on a platform with host memory apart from the
device's (GPU, TPU) they move there (`pinned_host`, asynchronously: the copy overlaps the
steps that follow); on CPU they stay where they are, in host memory already. A load scatters
saved blocks back into the (donated) caches. Both programs take block counts padded to powers
of two, at most `MAX_BLOCKS_PER_CALL` blocks a call (a step moving more makes several
calls), so few shapes compile: `warm` compiles them all at start-up, where a step would
otherwise pay for the compile when it first moves blocks. Padded rows gather block 0 and
scatter nowhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.sequence import KVTransfers


MAX_BLOCKS_PER_CALL = 64


def _padded(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _chunks(items: tuple) -> list[tuple]:
    return [items[i:i + MAX_BLOCKS_PER_CALL] for i in range(0, len(items),
                                                             MAX_BLOCKS_PER_CALL)]


@jax.jit
def _gather(caches, ids):
    """Blocks `ids` of every cache array (blocks on axis 1): one pytree of [L, ...] slices per
    id, split here so that the host does no per-block slicing."""
    return [jax.tree.map(lambda c: c[:, i], caches) for i in ids]


def _scatter(caches, ids, blocks):
    """The caches with blocks[j] written at block ids[j] (an id out of range writes nothing)."""
    stacked = jax.tree.map(lambda *b: jnp.stack(b, axis=1), *blocks)
    return jax.tree.map(lambda c, b: c.at[:, ids].set(b, mode="drop"), caches, stacked)


_scatter = jax.jit(_scatter, donate_argnums=0)


class HostKVStore:
    """Saved KV blocks by key: each a pytree like the caches, one block's [L, ...] slices."""

    def __init__(self):
        self._saved: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self._saved)

    def apply(self, caches, transfers: KVTransfers):
        """The caches after `transfers` (saves read them before anything writes them)."""
        for saves in _chunks(transfers.saves):
            ids, keys = zip(*saves)
            for key, block in zip(keys, self._gather(caches, ids)):
                self._saved[key] = _to_host(block)
        for key in transfers.drops:
            self._saved.pop(key, None)
        for loads in _chunks(transfers.loads):
            keys, ids = zip(*loads)
            caches = self._scatter(caches, ids, [_to_device(self._saved.pop(k)) for k in keys])
        return caches

    def warm(self, caches):
        """Run every gather and scatter program once (gathering block 0, scattering nowhere),
        so each is compiled before a step needs it; returns the caches (donated, unchanged)."""
        n = 1
        while n <= MAX_BLOCKS_PER_CALL:
            blocks = [_to_device(_to_host(b)) for b in self._gather(caches, (0,) * n)]
            num_blocks = jax.tree.leaves(caches)[0].shape[1]
            caches = self._scatter(caches, (num_blocks,) * n, blocks)
            n *= 2
        return caches

    @staticmethod
    def _gather(caches, ids: tuple) -> list:
        """Blocks `ids` of every cache array, one pytree per block."""
        n = len(ids)
        return _gather(caches, np.asarray(ids + (0,) * (_padded(n) - n), np.int32))[:n]

    @staticmethod
    def _scatter(caches, ids: tuple, blocks: list):
        """The caches with `blocks` written at `ids` (an id out of range writes nothing)."""
        pad = _padded(len(ids)) - len(ids)
        num_blocks = jax.tree.leaves(caches)[0].shape[1]
        return _scatter(caches, np.asarray(ids + (num_blocks,) * pad, np.int32),
                        blocks + [blocks[0]] * pad)  # padded rows: scattered nowhere


def _host_sharding(x: jax.Array):
    device = next(iter(x.sharding.device_set))
    if device.platform == "cpu" or "pinned_host" not in {
            m.kind for m in device.addressable_memories()}:
        return None
    return x.sharding.with_memory_kind("pinned_host")


def _to_host(block):
    return jax.tree.map(lambda x: x if _host_sharding(x) is None
                        else jax.device_put(x, _host_sharding(x)), block)


def _to_device(block):
    """A saved block back in device memory (where it was gathered, if it moved)."""
    return jax.tree.map(lambda x: x if x.sharding.memory_kind in (None, "device")
                        else jax.device_put(x, x.sharding.with_memory_kind("device")), block)
