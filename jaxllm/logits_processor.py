"""Custom logits processors: vLLM's v1 interface, over NumPy arrays.

A logits processor is written by a user and loaded at start-up (`--logits-processors
module:Class`, or the class itself in `LLM(logits_processors=[...])`). Like vLLM's, it works on
the whole batch: each step it is told how the batch changed (`update_state` with a
`BatchUpdate`: requests removed, added, moved), then transforms the step's logits
(`apply`: float32 [num_requests, vocab_size], one row per sequence, in the batch's order) and
returns them; the sampler then applies the request's own parameters (penalties, temperature,
top-k/p, ...) to what it returns. Requests opt in through `SamplingParams.extra_args`
(`vllm_xargs` over HTTP), which `validate_params` checks when the request arrives (a
ValueError there is the request's 400).

The difference from vLLM: the logits are a NumPy array on the host, not a torch tensor on the
device (jaxllm's step is one XLA program; the processors run between the program that computes
the logits and the one that samples them). So each step with processors reads its logits back
to the host: a cost per step, paid only by an engine started with processors.
"""

from __future__ import annotations

import enum
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from jaxllm.sampling_params import SamplingParams


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # a -> b: b takes a's request, a is left empty
    SWAP = enum.auto()            # a <-> b


# (index, the request's SamplingParams, its prompt token ids, its output token ids). The
# output list is the sequence's own, so a processor that keeps it sees each new token.
AddedRequest = tuple[int, SamplingParams, Optional[list[int]], list[int]]
MovedRequest = tuple[int, int, MoveDirectionality]
RemovedRequest = int


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last step. Apply in this order: removed, added, moved;
    an added or moved request may take the index of one that was removed."""
    batch_size: int  # requests in the batch now
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """vLLM's `vllm.v1.sample.logits_processor.LogitsProcessor`, with NumPy logits."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError for a request whose parameters (its extra_args, mostly) this
        processor cannot take."""

    @abstractmethod
    def __init__(self, config: Any, device: Any, is_pin_memory: bool) -> None:
        """config: the engine's EngineConfig; device: the first JAX device of the engine;
        is_pin_memory: False (vLLM's flag, kept for the signature)."""

    @abstractmethod
    def apply(self, logits: np.ndarray) -> np.ndarray:
        """logits float32 [batch_size, vocab_size] -> the same shape (in place is fine)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes which token has the highest logit (vLLM skips
        such processors for greedy rows; so does jaxllm)."""

    @abstractmethod
    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        """Called before each `apply` (None when the batch did not change)."""


RequestLogitsProcessor = Callable[[list[int], np.ndarray], np.ndarray]


class AdapterLogitsProcessor(LogitsProcessor):
    """vLLM's wrapper for per-request processors: implement `new_req_logits_processor(params)`
    (a function (output_ids, logits row [V]) -> logits row, or None for a request it does not
    touch) and `is_argmax_invariant`; the batch bookkeeping is done here."""

    def __init__(self, config: Any, device: Any, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[RequestLogitsProcessor, list[int]]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams
                                 ) -> Optional[RequestLogitsProcessor]:
        """The request's processor, or None."""

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.rows.pop(i, None)
        for i, params, _, output_ids in batch_update.added:
            fn = self.new_req_logits_processor(params)
            if fn is None:
                self.rows.pop(i, None)
            else:
                self.rows[i] = (fn, output_ids)
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if rb is not None and direction is MoveDirectionality.SWAP:
                self.rows[a] = rb

    def apply(self, logits: np.ndarray) -> np.ndarray:
        for i, (fn, output_ids) in self.rows.items():
            logits[i] = fn(output_ids, logits[i])
        return logits


ProcessorSpec = Union[str, type]


def load_logits_processors(specs: Sequence[ProcessorSpec]) -> tuple[type, ...]:
    """The classes `--logits-processors` names: 'module:Class' or 'module.Class' (importable
    from the server's Python path), or the classes themselves. ValueError naming the spec
    for one that does not import or is not a LogitsProcessor subclass."""
    out = []
    for spec in specs:
        cls = spec
        if isinstance(spec, str):
            module, sep, name = spec.partition(":")
            if not sep:
                module, _, name = spec.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError) as e:
                raise ValueError(f"{spec!r} does not name an importable class "
                                 f"('module:Class' or 'module.Class'): {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"{spec!r} is not a subclass of "
                             f"jaxllm.logits_processor.LogitsProcessor")
        out.append(cls)
    return tuple(out)
