"""The runner's device memory beyond a step: the weights and the KV cache released and taken
back (sleep mode, jaxllm/engine/sleep_mode.py) and the KV cache's host tier
(--kv-offloading-size, jaxllm/worker/kv_transfer.py). A part of `ModelRunner`, kept apart
because no step uses it."""

from __future__ import annotations

from jaxllm.layers.attention import empty_kv_caches
from jaxllm.worker import device_memory


class MemoryTiers:
    """Needs the runner's state, kv_cache, kv_store, _offloaded, _relayout, _kv_layout,
    model_config and enforce_eager."""

    def device_bytes(self) -> int:
        """Device memory the weights and the KV cache hold now (all shards)."""
        return device_memory.device_bytes((self.state, self.kv_cache))

    @property
    def weights_at(self) -> str:
        """Where the weights are: 'device', 'host' (released with a copy kept) or 'none'."""
        return "device" if self.state is not None else "host" if self._offloaded else "none"

    def release_weights(self, keep: bool) -> None:
        """Free the weights' device memory (between steps), keeping a host copy or not."""
        if self.state is not None and keep:
            self._offloaded = device_memory.offload(self.state)
        elif not keep and self._offloaded is not None:
            device_memory.delete(self._offloaded[0])
            self._offloaded = None
        device_memory.delete(self.state)
        self.state = None

    def restore_weights(self, state=None) -> None:
        """The weights on the devices again: the host copy, or `state` (the loader's layout)."""
        if state is None:
            self.state = device_memory.restore(*self._offloaded)
        else:
            device_memory.delete((self.state, self._offloaded and self._offloaded[0]))
            self.state = self._relayout(state, self.model_config)
        self._offloaded = None

    def release_kv_cache(self) -> None:
        """Free the KV cache (its contents are forgotten: no sequence may hold blocks)."""
        device_memory.delete(self.kv_cache)
        self.kv_cache = None

    def restore_kv_cache(self) -> None:
        self.kv_cache = empty_kv_caches(*self._kv_layout)

    def warm_kv_transfers(self) -> None:
        """Compile the host tier's copy programs now (--kv-offloading-size), not in a step."""
        if not self.enforce_eager:
            self.kv_cache = self.kv_store.warm(self.kv_cache)
