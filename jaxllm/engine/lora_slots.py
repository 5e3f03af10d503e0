"""The LoRA adapters an engine knows, read on the host and placed in the device slots.

Three tiers, as vLLM's LoRA managers: the registered adapters (name -> LoRARequest, unbounded),
the adapters read into host memory (LRU, at most --max-cpu-loras: re-read from their folder
when evicted), and the --max-loras device slots. The scheduler asks for a sequence's slot when
it admits it (`acquire`) and gives it back when the sequence leaves the running set
(`release`); a slot in use by running sequences is never rewritten, so a sequence whose adapter
finds every slot busy waits. A free slot is refilled least recently used first, between steps
(the runner's `write_lora_slot`).
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Optional

from jaxllm.engine.stats import LoraStats
from jaxllm.engine_config import LoRAConfig
from jaxllm.loader.lora import Adapter, read_adapter
from jaxllm.lora.request import LoRARequest

logger = logging.getLogger("jaxllm")


class LoRASlots:
    def __init__(self, config: LoRAConfig, model_config,
                 write: Callable[[int, dict], None]):
        """write(slot, weights): put an adapter's weights (`Adapter.weights`) in a device
        slot (the runner's write_lora_slot)."""
        self.config = config
        self._model_config = model_config
        self._write = write
        self._registered: dict[str, LoRARequest] = {}  # by name
        self._host: collections.OrderedDict[str, Adapter] = collections.OrderedDict()
        # The adapter in each slot, and the running sequences per adapter, by `_key`: an
        # adapter removed and registered again from another folder is another adapter.
        self._slots: list[Optional[tuple]] = [None] * config.max_loras
        self._users = collections.Counter()
        self._recency: collections.OrderedDict[int, None] = collections.OrderedDict(
            (i, None) for i in range(config.max_loras))  # slots, least recently used first
        self.num_writes = 0  # adapters written into a device slot since start-up

    # --- registry ------------------------------------------------------------------------------
    def add(self, req: LoRARequest) -> bool:
        """Register and read an adapter (errors name it: jaxllm.loader.lora.AdapterError).
        False if the same adapter is registered already; a different adapter under its name
        or id is an error."""
        known = self._registered.get(req.lora_name)
        if known is not None and (known.lora_int_id, known.lora_path) == (req.lora_int_id,
                                                                          req.lora_path):
            return False
        for other in self._registered.values():
            if other.lora_name == req.lora_name or other.lora_int_id == req.lora_int_id:
                raise ValueError(f"LoRA adapter {req.lora_name!r} (id {req.lora_int_id}, "
                                 f"{req.lora_path}): {other.lora_name!r} (id "
                                 f"{other.lora_int_id}, {other.lora_path}) is registered under "
                                 f"the same name or id; remove it first")
        self._read(req)
        self._registered[req.lora_name] = req
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (False if unknown). Its slot is reused once no running sequence
        holds it; sequences already running with it finish with it."""
        req = next((r for r in self._registered.values() if r.lora_int_id == lora_int_id), None)
        if req is None:
            return False
        del self._registered[req.lora_name]
        self._host.pop(req.lora_name, None)
        return True

    def list(self) -> set[int]:
        return {r.lora_int_id for r in self._registered.values()}

    # --- slots ---------------------------------------------------------------------------------
    def can_acquire(self, req: LoRARequest) -> bool:
        """Whether `acquire` would give `req` a slot now."""
        return _key(req) in self._slots or any(self._users[k] == 0 for k in self._slots)

    def acquire(self, req: LoRARequest) -> Optional[int]:
        """The slot of a sequence being admitted with adapter `req`, filled if needed; None
        when every slot holds an adapter of running sequences (the sequence waits)."""
        key = _key(req)
        if key in self._slots:
            slot = self._slots.index(key)
        else:
            free = [s for s in self._recency if self._users[self._slots[s]] == 0]
            if not free:
                return None
            slot = next((s for s in free if self._slots[s] is None), free[0])
            self._write(slot, self._read(req).weights)
            self.num_writes += 1
            self._slots[slot] = key
        self._users[key] += 1
        self._recency.move_to_end(slot)
        return slot

    def release(self, req: LoRARequest) -> None:
        """A sequence holding `req`'s slot left the running set (finished or preempted)."""
        key = _key(req)
        self._users[key] -= 1
        if self._users[key] <= 0:
            del self._users[key]

    def forget_slots(self) -> None:
        """The device slots were emptied (new weights replaced the model's state): adapters are
        written again as sequences are admitted. Only while no sequence holds a slot."""
        if self._users:
            raise RuntimeError("LoRA slots are held by running sequences")
        self._slots = [None] * self.config.max_loras

    def slot(self, req: LoRARequest) -> int:
        """The slot of an adapter its running sequences hold."""
        return self._slots.index(_key(req))

    def running(self) -> tuple[str, ...]:
        """Adapters of running sequences, by name."""
        return tuple(sorted({name for name, _, _ in self._users}))

    def stats(self, waiting) -> LoraStats:
        """The adapters of running sequences and of the `waiting` ones, by name."""
        return LoraStats(self.running(), tuple(sorted(
            {s.lora_request.lora_name for s in waiting if s.lora_request is not None})),
            self.config.max_loras)

    def _read(self, req: LoRARequest) -> Adapter:
        """The adapter from the host cache, or read from its folder (evicting the least
        recently used beyond --max-cpu-loras)."""
        adapter = self._host.get(req.lora_name)
        if adapter is not None and _key(adapter.request) == _key(req):
            self._host.move_to_end(req.lora_name)
            return adapter
        adapter = read_adapter(req, self._model_config)
        self._host[req.lora_name] = adapter
        while len(self._host) > self.config.max_cpu_loras:
            self._host.popitem(last=False)
        logger.info("Read LoRA adapter %r (rank %d, %.1f MiB) from %s", req.lora_name,
                    adapter.rank, adapter.nbytes / 2**20, req.lora_path)
        return adapter


def _key(req: LoRARequest) -> tuple:
    return req.lora_name, req.lora_int_id, req.lora_path
