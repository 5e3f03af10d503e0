"""Sleep mode (--enable-sleep-mode): an idle engine gives its device memory back and takes it
again, as vLLM's `sleep(level)` / `wake_up(tags)`; and new weights put in place (RL loops).

Level 1 moves the weights to host memory and frees the KV cache; level 2 frees both, and
waking the weights reads the checkpoint again unless new weights were given meanwhile
(`update_weights`). The KV cache's contents are forgotten either way, and so is the prefix
cache that indexes them. An engine sleeps only with no request in it: the caller aborts them
or waits for them first (`mode`); requests that arrive while it sleeps are refused
(`EngineSleepingError`), not queued. Waking takes tags, as vLLM's: "weights" and "kv_cache"
(both by default), so new weights can be put in place before the KV cache is allocated.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Optional

import numpy as np

from jaxllm.engine.errors import EngineSleepingError

logger = logging.getLogger("jaxllm")

TAGS = ("weights", "kv_cache")
LEVELS = (1, 2)


class SleepMode:
    def __init__(self, enabled: bool, runner, kv_cache_manager,
                 read_weights: Callable[[Optional[Iterable]], object],
                 on_new_weights: Callable[[], None]):
        """read_weights(tensors): the model's weights in the loader's layout, from (HF name,
        array) pairs, or (None) from its checkpoint. on_new_weights: called when the model's
        state was replaced (its LoRA slots emptied)."""
        self.enabled = enabled
        self._runner = runner
        self._kv = kv_cache_manager
        self._read_weights = read_weights
        self._on_new_weights = on_new_weights
        self.level = 0  # the last sleep's level while anything sleeps, else 0

    @property
    def is_sleeping(self) -> bool:
        return self.level > 0

    def sleeping_error(self) -> EngineSleepingError:
        """What work gets while anything sleeps (the engine reads `level` first: a request on
        an awake engine does not enter this module)."""
        return EngineSleepingError(f"the engine is sleeping (level {self.level}); wake it up "
                                   "first (LLM.wake_up(), POST /wake_up)")

    @staticmethod
    def check_idle(what: str, mode: str, unfinished: int) -> None:
        """Whether `what` may go on with `unfinished` requests in the engine: mode 'abort'
        (they are aborted), 'wait' (refused while there are any) or, for sleep, 'keep' (they
        are preempted and resume after waking)."""
        modes = ("abort", "wait", "keep") if what == "sleep" else ("abort", "wait")
        if mode not in modes:
            raise ValueError(f"{what} mode {mode!r}: must be " + " or ".join(map(repr, modes)))
        if unfinished and mode == "wait":
            raise ValueError(f"{what}: {unfinished} request(s) unfinished; abort them or wait "
                             "for them first")

    def _check_enabled(self, what: str) -> None:
        if not self.enabled:
            raise ValueError(f"{what}: sleep mode is off; start the engine with "
                             "--enable-sleep-mode (enable_sleep_mode=True)")

    def sleep(self, level: int) -> dict:
        """Release device memory at `level` (the engine holds no request); what it freed."""
        self._check_enabled("sleep")
        if level not in LEVELS:
            raise ValueError(f"sleep level {level!r}: must be 1 (weights to host memory) or "
                             "2 (weights freed)")
        t0, held = time.perf_counter(), self._runner.device_bytes()
        if self._runner.kv_cache is not None:
            if not self._kv.reset_prefix_cache():
                raise RuntimeError("sleep: sequences still hold KV cache blocks")
            self._runner.release_kv_cache()
        self._runner.release_weights(keep=level == 1)
        self.level = max(self.level, level)
        freed = held - self._runner.device_bytes()
        logger.info("Sleeping at level %d: %.3f GiB of device memory freed in %.2f s", level,
                    freed / 2**30, time.perf_counter() - t0)
        return {"level": self.level, "freed_bytes": freed}

    def wake_up(self, tags: Optional[Iterable[str]] = None) -> None:
        """Take back what `tags` name (default: everything): weights from host memory, or
        read again after level 2; an empty KV cache."""
        self._check_enabled("wake_up")
        tags = list(TAGS if tags is None else tags)
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            raise ValueError(f"wake_up tags {unknown}: the tags are {', '.join(TAGS)}")
        t0 = time.perf_counter()
        if "weights" in tags and self._runner.weights_at != "device":
            if self._runner.weights_at == "host":
                self._runner.restore_weights()
            else:
                self._put_weights(self._read_weights(None))
        if "kv_cache" in tags and self._runner.kv_cache is None:
            self._runner.restore_kv_cache()
        if self._runner.weights_at == "device" and self._runner.kv_cache is not None:
            self.level = 0
        logger.info("Woke up %s in %.2f s", " and ".join(tags), time.perf_counter() - t0)

    def update_weights(self, tensors: Iterable) -> None:
        """Put new weights in place: a whole checkpoint's (HF name, array) pairs, as the
        model's checkpoint names and shapes them (the engine holds no request). Asleep or
        not; the prefix cache is forgotten (its blocks were computed with the old ones)."""
        if self._runner.kv_cache is not None and not self._kv.reset_prefix_cache():
            raise RuntimeError("update_weights: sequences still hold KV cache blocks")
        self._put_weights(self._read_weights((name, host_array(x)) for name, x in tensors))

    def _put_weights(self, state) -> None:
        self._runner.restore_weights(state)
        self._on_new_weights()


def host_array(x) -> np.ndarray:
    """A NumPy array of a NumPy, JAX or torch tensor (torch's bfloat16 has no NumPy form: it
    goes through float32, exact; the loader casts to the model's dtype)."""
    if hasattr(x, "detach"):  # torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)
