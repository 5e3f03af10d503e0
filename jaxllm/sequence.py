"""Host types shared by the engine and the worker: one sequence being generated (its tokens,
progress and status, as the scheduler sees it) and the scheduler's plan for one step.

A user's `Request` (jaxllm/engine/engine.py) with `n > 1` becomes n `Sequence`s (the engine fans
out and gathers back), as vLLM's SequenceGroup and Sequence. Plain Python, no JAX: the scheduler,
the sampler's host packing and the runner's input preparation all read these.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from jaxllm.lora.request import LoRARequest
from jaxllm.sampling_params import SamplingParams

# Placeholder output token of a step dispatched but not read yet (async scheduling).
PENDING = -1


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the request's grammar dead-ended (vLLM's FinishReason.ERROR)

    @property
    def finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        return {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length",
                SequenceStatus.FINISHED_ABORTED: "abort",
                SequenceStatus.FINISHED_ERROR: "error"}.get(self)


@dataclass(frozen=True, eq=False)
class ImageInputs:
    """A prompt's images, preprocessed on the host (jaxllm/engine/multimodal.py): what the
    runner's encoder step, the M-RoPE positions and the prefix cache read."""
    pixel_values: tuple       # per image: float32 [patches, patch values]
    grids: tuple              # per image: its (t, h, w) patch grid
    hashes: tuple             # per image: its content hash (hex str)
    starts: tuple             # per image: the prompt index of its first placeholder token
    num_tokens: tuple         # per image: its placeholder tokens (merged patches)
    positions: Any            # int32 [3, prompt length]: the M-RoPE positions of the prompt
    delta: int                # token i past the prompt is at position i + delta (3 axes)
    hash_tokens: tuple        # the prompt, each image's tokens replaced by its key (< 0): what
    # the prefix cache hashes and compares, so a block holding an image is keyed by its content

    def rope_positions(self, start: int, n: int):
        """[3, n] positions of tokens start .. start + n - 1 (the prompt's, then i + delta)."""
        P = self.positions.shape[1]
        out = np.empty((3, n), np.int32)
        k = max(0, min(P - start, n))
        out[:, :k] = self.positions[:, start:start + k]
        out[:, k:] = np.arange(start + k, start + n) + self.delta
        return out


@dataclass
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    seed: int = 0  # per-sequence RNG seed (the user's, or drawn by the engine)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0    # of the prompt, found in the prefix cache at first schedule
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: Union[int, str, None] = None
    num_preemptions: int = 0
    # This sequence computes its request's prompt logprobs (the first of n does).
    computes_prompt_logprobs: bool = False
    # Its structured-output state (a GrammarMatcher), advanced by the engine with every token
    # and read by the sampler's host packing for the next token's mask.
    grammar: Optional[Any] = None
    # Set by the engine for metrics.
    first_token_time: Optional[float] = None
    lora_request: Optional[LoRARequest] = None  # the adapter it runs with (None: the base model)
    mm: Optional[ImageInputs] = None  # its prompt's images (vision-language models)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """all_token_ids[start:start + n] without building the whole list (a step's tokens)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:start - p + n]
        if start + n <= p:
            return self.prompt_token_ids[start:start + n]
        return self.all_token_ids[start:start + n]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt positions must still be computed for their logprobs: once a token is
        sampled, every prompt position has been computed, so a recompute after preemption may
        skip them (and use the prefix cache)."""
        return self.computes_prompt_logprobs and not self.output_token_ids

    @property
    def has_pending(self) -> bool:
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PENDING

    @property
    def resolved_output_token_ids(self) -> list[int]:
        """The output tokens known on the host: the placeholders of steps in flight (a burst's
        are several) are all at the end."""
        out = self.output_token_ids
        n = len(out)
        while n and out[n - 1] == PENDING:
            n -= 1
        return out[:n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished


@dataclass
class ScheduledSequence:
    seq: Sequence
    start: int        # num_computed_tokens before this step: the position of the first token
    num_tokens: int
    block_ids: list[int]  # the KV manager's live block table, valid for this step
    sample: bool      # the step reaches the last known token, so its next token is sampled
    out_index: int = -1  # where advance() put the PENDING placeholder of the sampled token
    # Speculative draft tokens computed after the known ones (the last num_tokens of the
    # step); their positions are verified, and only the accepted ones count as computed.
    spec_token_ids: list[int] = field(default_factory=list)
    lora_slot: int = -1  # the device slot of its LoRA adapter (-1: none)
    state_slot: int = -1  # a hybrid model's linear-attention state slot (-1: none)


@dataclass(frozen=True)
class KVTransfers:
    """KV blocks moving between the device cache and its host tier (--kv-offloading-size),
    done before the step's program runs, in this order: `saves` copy device blocks out (to
    host memory) before the step reuses them, `drops` forget saved copies, `loads` copy saved
    blocks into device blocks (and forget those copies). Saved copies are named by keys."""
    saves: tuple[tuple[int, int], ...] = ()  # (device block id, key)
    drops: tuple[int, ...] = ()              # keys
    loads: tuple[tuple[int, int], ...] = ()  # (key, device block id)

    def __bool__(self) -> bool:
        return bool(self.saves or self.drops or self.loads)


@dataclass
class SchedulerOutput:
    """One step's plan: what the runner computes, in this order."""
    scheduled: list[ScheduledSequence]
    preempted_ids: list[str] = field(default_factory=list)
    kv_transfers: KVTransfers = KVTransfers()

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass
class Stop:
    """A sequence ended outside the scheduler's own rules (a stop string, the grammar's end,
    found by the output processor), for the scheduler to apply: its status and stop_reason,
    and (a stop string inside accepted drafts) the output tokens after it to drop,
    [drop_from, drop_to). override: it ends the sequence even if a later token of the same
    step already did (the earlier stop comes first)."""
    seq: Sequence
    status: SequenceStatus
    reason: Union[int, str, None]
    drop_from: int = 0
    drop_to: int = 0
    override: bool = False
