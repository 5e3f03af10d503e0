"""Paged KV-cache blocks with automatic prefix caching, as in vLLM V1.

Each block is in exactly one state: in use (ref_cnt > 0, possibly shared read-only), free (holds
nothing reusable), or cached-evictable (ref_cnt 0 but its KV is kept under its hash). New blocks
come from the free pool first, then by evicting the least recently released cached block, which
loses its hash.

A full block is keyed by the chain hash h_i = H(h_{i-1}, tokens_i), so equal hashes mean equal
prefixes, unless the hash collides. Hits are therefore verified exactly: each cached block keeps
its tokens and the `uid` of the cached block it extends (uids are never reused), and a lookup
follows a chain only through those very blocks. A collision costs a miss, never wrong KV.

With a host tier (--kv-offloading-size: jaxllm/engine/kv_offload.py), an evicted cached block
is saved there instead of lost, and a lookup follows the chain through device and host blocks
alike; a host hit takes a device block and the step's plan copies the KV back
(`take_transfers`).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping
from itertools import count
from types import MappingProxyType
from typing import Optional

from jaxllm.engine.kv_offload import HostBlock, HostTier, host_tier
from jaxllm.engine.state_slots import StateSlots
from jaxllm.sequence import KVTransfers, Sequence

_ROOT = 0  # the parent uid of a first block (of a sequence without a LoRA adapter)


def _hash_builtin(parent, tokens: tuple) -> int:
    return hash((parent, tokens))


def _hash_sha256(parent, tokens: tuple) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


def _adapter_key(seq: Sequence) -> Optional[tuple]:
    """A LoRA adapter's identity as a 'block' of ints no real block has (a negative token):
    its name, id and folder, which a reload under the same name changes only if the folder
    does."""
    lora = seq.lora_request
    if lora is None:
        return None
    digest = hashlib.sha256(repr((lora.lora_name, lora.lora_int_id, lora.lora_path)).encode())
    return (-1, int.from_bytes(digest.digest()[:7], "little"))


def _root_uid(seq: Sequence):
    """The parent uid of a sequence's first block: hits are verified through it, so a block
    computed with one adapter (or none) is never another's, hash collisions included."""
    key = _adapter_key(seq)
    return _ROOT if key is None else key


class Block:
    __slots__ = ("block_id", "ref_cnt", "hash", "uid", "parent_uid", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.hash = None  # set while the block is in the prefix cache
        self.uid = None
        self.parent_uid = None
        self.token_ids: tuple = ()


class KVCacheManager:
    """hash_fn(parent hash, block tokens) -> hash replaces hash_algo's function (its root, the
    parent of a first block, stays hash_algo's: 0, or b"" for sha256). Hits are verified, so any
    function is correct, only slower where it collides: tests pass colliding ones to prove it."""

    @classmethod
    def for_engine(cls, config, num_blocks: int, runner, model_config) -> "KVCacheManager":
        """The engine's cache manager, from its EngineConfig: a host tier with
        --kv-offloading-size, state slots for a hybrid model's linear layers."""
        cache = config.cache
        return cls(num_blocks, cache.block_size, enable_prefix_caching=cache.enable_prefix_caching,
                   hash_algo=cache.prefix_caching_hash_algo,
                   host_tier=host_tier(cache, runner, num_blocks),
                   state_slots=StateSlots(config.scheduler.max_num_seqs)
                   if model_config.linear_layers else None)

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_algo: str = "builtin",
                 hash_fn: Optional[Callable[[Hashable, tuple], Hashable]] = None,
                 host_tier: Optional[HostTier] = None,
                 state_slots: Optional[StateSlots] = None):
        """state_slots: a hybrid model's per-sequence state slots (jaxllm/engine/
        state_slots.py), taken with a sequence's first blocks and given back with them."""
        if hash_algo not in ("builtin", "sha256"):
            raise ValueError(f"unknown prefix caching hash algorithm {hash_algo!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash = hash_fn or (_hash_sha256 if hash_algo == "sha256" else _hash_builtin)
        self._root_hash = b"" if hash_algo == "sha256" else 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._cached: dict = {}  # hash -> Block
        self._uids = count(1)
        self._seq_blocks: dict[str, list[int]] = {}
        self._seq_uids: dict[str, list] = {}  # uid chain of each sequence's registered blocks
        self._seq_hashes: dict[str, list] = {}  # memo: each block is hashed once per sequence
        self.prefix_cache_queries = 0  # tokens looked up, once per admission
        self.prefix_cache_hits = 0     # of those, tokens found cached (device or host)
        self.host_tier = host_tier
        self._saves: list = []  # this step's KV transfers so far (`take_transfers`)
        self._drops: list = []
        self._loads: list = []
        self.state_slots = state_slots

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free plus cached-evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def counters(self) -> dict:
        """The cache's fields of EngineStats."""
        host = self.host_tier
        return dict(kv_cache_usage=self.usage, prefix_cache_queries=self.prefix_cache_queries,
                    prefix_cache_hits=self.prefix_cache_hits,
                    num_free_blocks=self.num_free_blocks, num_total_blocks=self.num_blocks,
                    kv_offload_saved_blocks=host.saved_blocks if host else 0,
                    kv_offload_hit_blocks=host.hit_blocks if host else 0)

    # Read-only views of the block states, for checks of the accounting (tests, debugging):
    # every block is in use (ref_cnt > 0), in free_block_ids, or in evictable_block_ids.
    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """Blocks holding nothing reusable, in the order allocations take them."""
        return tuple(self._free)

    @property
    def evictable_block_ids(self) -> tuple[int, ...]:
        """Unused blocks whose KV stays cached, least recently released (evicted) first."""
        return tuple(self._evictable)

    @property
    def cached_blocks(self) -> Mapping:
        """The prefix cache, hash -> Block (a live read-only view)."""
        return MappingProxyType(self._cached)

    @property
    def tracked_seq_ids(self) -> frozenset[str]:
        """Sequences the manager keeps any state for (blocks or block hashes): a finished one
        must not be among them, a preempted one keeps only its hashes."""
        return frozenset(self._seq_blocks) | frozenset(self._seq_uids) | frozenset(
            self._seq_hashes)

    def get_block_ids(self, seq_id: str) -> list[int]:
        """The sequence's block table (the live list: it grows as the sequence does)."""
        return self._seq_blocks.get(seq_id, [])

    def state_slot(self, seq_id: str) -> int:
        """The sequence's state slot (a hybrid model's), -1 without one."""
        return -1 if self.state_slots is None else self.state_slots.slot(seq_id)

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Longest verified cached prefix of full blocks, leaving at least one token to compute
        (the model must run on the last token to sample the next). No side effects.
        A sequence still needing its prompt logprobs takes no hits (as vLLM): every prompt
        position must be computed; it still publishes its blocks for others."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return [], 0
        hashes = self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        ids, parent = [], _root_uid(seq)
        for i, h in enumerate(hashes):
            b = self._cached.get(h)
            if b is None and self.host_tier is not None:
                b = self.host_tier.get(h)  # a HostBlock: allocate_slots loads it
            if b is None or b.parent_uid != parent or b.token_ids != self._block_tokens(seq, i):
                break
            ids.append(b if isinstance(b, HostBlock) else b.block_id)
            parent = b.uid
        return ids, len(ids) * self.block_size

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Make room for num_new_tokens after seq.num_computed_tokens plus the computed_blocks
        (a prefix hit, given at admission). All or nothing: False changes nothing."""
        computed = [b if isinstance(b, HostBlock) else self.blocks[b]
                    for b in computed_blocks or ()]
        device = [b for b in computed if isinstance(b, Block)]
        owned = self._seq_blocks.get(seq.seq_id)
        total = seq.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        need = -(-total // self.block_size) - len(device) - len(owned or ())
        revived = sum(b.ref_cnt == 0 for b in device)  # hits leave the evictable pool
        if need > self.num_free_blocks - revived:
            return False
        if owned is None and self.state_slots is not None and not self.state_slots.num_free:
            return False
        if owned is None:
            if self.state_slots is not None:
                self.state_slots.acquire(seq.seq_id)
            owned = self._seq_blocks[seq.seq_id] = []
            self._seq_uids[seq.seq_id] = [b.uid for b in computed]
            if self.enable_prefix_caching and not seq.needs_prompt_logprobs:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += len(computed) * self.block_size
        for b in device:  # first, so that no block taken below evicts one of them
            if b.ref_cnt == 0:
                del self._evictable[b.block_id]
            b.ref_cnt += 1
        for b in computed:
            owned.append(b.block_id if isinstance(b, Block) else self._load(b))
        for _ in range(need - len(computed) + len(device)):
            owned.append(self._take())
        return True

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the sequence's blocks that are full of computed tokens.

        Call after every model step, once num_computed_tokens has advanced: a block's KV is only
        written when the step runs, so caching it at allocation would let another sequence hit a
        block that is still empty.
        """
        if not self.enable_prefix_caching:
            return
        uids = self._seq_uids[seq.seq_id]
        num_full = seq.num_computed_tokens // self.block_size
        if len(uids) >= num_full:
            return
        hashes = self._block_hashes(seq, num_full)
        ids = self._seq_blocks[seq.seq_id]
        for i in range(len(uids), num_full):
            parent = uids[-1] if uids else _root_uid(seq)
            if parent is None:  # the chain broke at a collision: nothing after it is verifiable
                uids.append(None)
                continue
            tokens = self._block_tokens(seq, i)
            other = self._cached.get(hashes[i])
            if other is None:
                b = self.blocks[ids[i]]
                b.hash, b.uid, b.parent_uid = hashes[i], next(self._uids), parent
                b.token_ids = tokens
                self._cached[b.hash] = b
                uids.append(b.uid)
            elif other.parent_uid == parent and other.token_ids == tokens:
                uids.append(other.uid)  # computed twice at once: keep the first, ours stays private
            else:
                uids.append(None)  # a true hash collision: leave ours uncached

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (safe to call twice). Tail blocks are released first so
        they are evicted before the prefix they extend. A preempted (unfinished) sequence keeps
        its block hashes for its return: its tokens only grow."""
        self._seq_uids.pop(seq.seq_id, None)
        if self.state_slots is not None:
            self.state_slots.release(seq.seq_id)
        if seq.is_finished:
            self._seq_hashes.pop(seq.seq_id, None)
        for bid in reversed(self._seq_blocks.pop(seq.seq_id, ())):
            b = self.blocks[bid]
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.hash is None:
                    self._free.append(bid)
                else:
                    self._evictable[bid] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after new weights), the host tier's too. As in
        vLLM, refused (False) while any sequence holds blocks. The hit counters are cumulative
        and not reset."""
        if self._seq_blocks:
            return False
        for b in list(self._cached.values()):
            self._uncache(b)
        self._free.extend(self._evictable)
        self._evictable.clear()
        if self.host_tier is not None:
            self._drops += self.host_tier.clear()
        return True

    def take_transfers(self) -> KVTransfers:
        """The KV copies between the device and the host tier that the allocations since the
        last call need, before the next step runs (the step's plan carries them)."""
        out = KVTransfers(tuple(self._saves), tuple(self._drops), tuple(self._loads))
        self._saves, self._drops, self._loads = [], [], []
        return out

    # --- helpers -------------------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            bid = self._free.popleft()
        else:
            bid, _ = self._evictable.popitem(last=False)
            b = self.blocks[bid]
            if self.host_tier is not None:  # its KV goes to the host tier before the reuse
                self._saves.append((bid, b.uid))
                self._drops += self.host_tier.add(HostBlock(b.hash, b.uid, b.parent_uid,
                                                            b.token_ids))
            self._uncache(b)
        self.blocks[bid].ref_cnt = 1
        return bid

    def _load(self, saved: HostBlock) -> int:
        """A device block for a host hit, cached again under the saved block's identity; its
        KV is copied back before the step."""
        self.host_tier.take(saved.hash)  # first: the eviction below may make room there
        bid = self._take()
        b = self.blocks[bid]
        b.hash, b.uid, b.parent_uid, b.token_ids = saved
        self._cached[b.hash] = b
        self._loads.append((saved.uid, bid))
        return bid

    def _uncache(self, b: Block) -> None:
        del self._cached[b.hash]
        b.hash = b.uid = b.parent_uid = None
        b.token_ids = ()

    def _block_tokens(self, seq: Sequence, i: int) -> tuple:
        s, e = i * self.block_size, (i + 1) * self.block_size
        # images: their tokens as their content's key, so only the same image hits
        p = seq.prompt_token_ids if seq.mm is None else seq.mm.hash_tokens
        tokens = p[s:e]
        if e > len(p):
            tokens = (*tokens, *seq.output_token_ids[max(s - len(p), 0):e - len(p)])
        return tuple(tokens)

    def _seq_root_hash(self, seq: Sequence):
        """The parent hash of a sequence's first block: the root, or with a LoRA adapter the
        root extended by the adapter's identity (its KV differs from the base model's)."""
        key = _adapter_key(seq)
        return self._root_hash if key is None else self._hash(self._root_hash, key)

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list:
        """Chain hashes of the sequence's first num_blocks full blocks (of known tokens)."""
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        while len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else self._seq_root_hash(seq)
            hashes.append(self._hash(parent, self._block_tokens(seq, len(hashes))))
        return hashes
