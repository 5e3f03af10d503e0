"""Which data-parallel replica takes a request: the one already holding the longest cached
prefix of its prompt, unless that replica is busier than the least-loaded one by more than
`slack` waiting requests; otherwise the least loaded (fewest waiting, then least KV cache in
use, then fewest running).

Prefix affinity is what makes data parallelism keep the prefix cache's gains: requests sharing
a system prompt all land where its KV blocks are. The router remembers, per full block of a
prompt, the chain hash of the prefix ending there and the replica it went to (bounded LRU):
no replica is asked, so routing costs a few dictionary look-ups per block.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional, Sequence

from jaxllm.engine.stats import EngineStats


class PrefixAffinityRouter:
    def __init__(self, block_size: int, slack: int = 4, capacity: int = 1 << 16):
        self.block_size = block_size
        self.slack = slack
        self.capacity = capacity
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix chain hash -> replica
        self.affinity_hits = 0  # requests sent to the replica holding their prefix

    @property
    def num_remembered_prefixes(self) -> int:
        """Prefixes (one per full prompt block) whose replica is remembered: at most
        `capacity`, so the router's memory is bounded."""
        return len(self._owner)

    def _prefix_hashes(self, token_ids: Sequence[int], root: Hashable = None) -> list[int]:
        out, h, bs = [], 0 if root is None else hash(root), self.block_size
        for i in range(len(token_ids) // bs):
            h = hash((h, tuple(token_ids[i * bs:(i + 1) * bs])))
            out.append(h)
        return out

    def choose(self, token_ids: Sequence[int], loads: Sequence[EngineStats],
               alive: Optional[Sequence[bool]] = None, root: Hashable = None) -> int:
        """The replica for a prompt, given each replica's `stats()` and which are alive (a
        lost remote one is never chosen, its prefixes go elsewhere); remembers the choice.
        root: what the replicas' prefix caches root the prompt's blocks at besides the tokens
        (a LoRA adapter: the same tokens under another adapter share no cached block)."""
        def load(i):
            s = loads[i]
            return s.num_waiting, s.kv_cache_usage, s.num_running

        live = [i for i in range(len(loads)) if alive is None or alive[i]]
        least = min(live, key=load)
        hashes = self._prefix_hashes(token_ids, root)
        owner = next((self._owner[h] for h in reversed(hashes) if h in self._owner), None)
        if owner in live and (loads[owner].num_waiting
                                  <= loads[least].num_waiting + self.slack):
            choice = owner
            self.affinity_hits += 1
        else:
            choice = least
        for h in hashes:
            self._owner[h] = choice
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
        return choice
