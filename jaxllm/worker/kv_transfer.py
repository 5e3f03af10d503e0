"""The data side of the KV cache's host tier (--kv-offloading-size): a step's `KVTransfers`
applied to the device caches before its program runs.

Saved blocks are gathered from every cache array (one per layer group and K/V, blocks on axis
1) by one program per step and kept by key; on a platform with host memory apart from the
device's (GPU, TPU) they move there (`pinned_host`, asynchronously: the copy overlaps the
steps that follow); on CPU they stay where they are, in host memory already. A load scatters
saved blocks back into the (donated) caches. Both programs take block counts padded to powers
of two, so few shapes compile; padded rows gather block 0 and scatter nowhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.sequence import KVTransfers


def _padded(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@jax.jit
def _gather(caches, ids):
    return jax.tree.map(lambda c: jnp.moveaxis(c[:, ids], 1, 0), caches)


def _scatter(caches, ids, blocks):
    return jax.tree.map(lambda c, b: c.at[:, ids].set(jnp.moveaxis(b, 0, 1), mode="drop"),
                        caches, blocks)


_scatter = jax.jit(_scatter, donate_argnums=0)


class HostKVStore:
    """Saved KV blocks by key: each a pytree like the caches, one block's [L, ...] slices."""

    def __init__(self):
        self._saved: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self._saved)

    def apply(self, caches, transfers: KVTransfers):
        """The caches after `transfers` (saves read them before anything writes them)."""
        if transfers.saves:
            ids, keys = zip(*transfers.saves)
            n = len(ids)
            rows = _gather(caches, np.asarray(ids + (0,) * (_padded(n) - n), np.int32))
            for i, key in enumerate(keys):
                self._saved[key] = _to_host(jax.tree.map(lambda r: r[i], rows))
        for key in transfers.drops:
            self._saved.pop(key, None)
        if transfers.loads:
            keys, ids = zip(*transfers.loads)
            n, pad = len(ids), _padded(len(ids)) - len(ids)
            blocks = [_to_device(self._saved.pop(k)) for k in keys]
            blocks += [blocks[0]] * pad  # rows scattered nowhere (index out of range)
            stacked = jax.tree.map(lambda *b: jnp.stack(b), *blocks)
            num_blocks = jax.tree.leaves(caches)[0].shape[1]
            caches = _scatter(caches, np.asarray(ids + (num_blocks,) * pad, np.int32), stacked)
        return caches


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
