"""The per-sequence state slots of a hybrid model's linear-attention layers (Qwen3-Next: each
slot holds every such layer's conv and recurrent state, jaxllm/models/qwen3_next.py).

A fixed number of slots (max_num_seqs: every running sequence holds one) sits on the device
beside the paged KV cache. The KV cache manager takes a slot when it admits a sequence and
gives it back when it frees the sequence (finished or preempted: a preempted sequence is
recomputed from its first token, which starts its state from zero again).
"""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first
        self._owner: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, seq_id: str) -> int:
        """The sequence's slot, taking a free one the first time; raises when none is free
        (the scheduler runs at most num_slots sequences)."""
        if seq_id not in self._owner:
            if not self._free:
                raise RuntimeError(f"no free state slot for {seq_id} ({self.num_slots} held)")
            self._owner[seq_id] = self._free.pop()
        return self._owner[seq_id]

    def slot(self, seq_id: str) -> int:
        """The sequence's slot, -1 if it holds none."""
        return self._owner.get(seq_id, -1)

    def release(self, seq_id: str) -> None:
        """Give the sequence's slot back (safe to call twice)."""
        slot = self._owner.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def holders(self) -> frozenset[str]:
        return frozenset(self._owner)
