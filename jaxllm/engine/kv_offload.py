"""The host tier of the prefix cache (--kv-offloading-size, vLLM's native KV offloading): full
blocks evicted from the device cache keep their KV in host memory, and a later prefix hit
copies them back instead of computing them again.

This file keeps the tier's bookkeeping (which blocks it holds, least recently used first);
the KV cache manager decides what moves, and the runner moves the data (a step's
`KVTransfers`, jaxllm/worker/kv_transfer.py). A saved block keeps the hash, uid, parent uid
and tokens it had on the device, so hits through the host tier are verified exactly as
device hits are.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import NamedTuple, Optional

from jaxllm.engine_config import ConfigError
from jaxllm.worker.device_memory import device_bytes

logger = logging.getLogger("jaxllm")


def host_tier(cache, runner, num_blocks: int) -> Optional["HostTier"]:
    """The host tier --kv-offloading-size asks for (cache: the CacheConfig), in blocks of the
    runner's KV cache (None when off)."""
    if cache.kv_offloading_size is None:
        return None
    block_bytes = device_bytes(runner.kv_cache) // num_blocks  # all devices' shares
    capacity = int(cache.kv_offloading_size * 2**30 // block_bytes)
    if capacity < 1:
        raise ConfigError(f"--kv-offloading-size={cache.kv_offloading_size}: less than one KV "
                          f"block ({block_bytes / 2**20:.2f} MiB)")
    t = time.perf_counter()
    runner.warm_kv_transfers()
    logger.info("KV offloading: %d blocks (%.2f GiB) of host memory; copy programs ready in "
                "%.1f s", capacity, capacity * block_bytes / 2**30, time.perf_counter() - t)
    return HostTier(capacity)


class HostBlock(NamedTuple):
    """A full block's identity in the prefix cache; its uid names its saved KV."""
    hash: object
    uid: int
    parent_uid: object
    token_ids: tuple


class HostTier:
    def __init__(self, capacity_blocks: int):
        if capacity_blocks < 1:
            raise ValueError("the host KV tier must hold at least one block")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[object, HostBlock] = OrderedDict()  # by hash, LRU first
        self.saved_blocks = 0  # blocks copied out, in all
        self.hit_blocks = 0    # blocks copied back for a prefix hit, in all

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, block_hash) -> Optional[HostBlock]:
        return self._blocks.get(block_hash)

    def add(self, block: HostBlock) -> list[int]:
        """Hold a block being saved; the uids of those it forgets: an older copy under the
        same hash (the prefix was computed again meanwhile), and the least recently used
        beyond the capacity."""
        old = self._blocks.pop(block.hash, None)
        dropped = [] if old is None else [old.uid]
        self._blocks[block.hash] = block
        self.saved_blocks += 1
        while len(self._blocks) > self.capacity_blocks:
            dropped.append(self._blocks.popitem(last=False)[1].uid)
        return dropped

    def take(self, block_hash) -> HostBlock:
        """A block going back to the device (it leaves the tier: its copy is loaded)."""
        self.hit_blocks += 1
        return self._blocks.pop(block_hash)

    def clear(self) -> list[int]:
        """Forget every block (new weights, sleep); their uids."""
        uids = [b.uid for b in self._blocks.values()]
        self._blocks.clear()
        return uids
