"""Host types shared by the engine and the worker: one sequence being generated (its tokens,
progress and status, as the scheduler sees it), the scheduler's plan for one step, and the
sampler's rows packed from a batch of sequences.

A user's `Request` (jaxllm/engine/engine.py) with `n > 1` becomes n `Sequence`s (the engine fans
out and gathers back), as vLLM's SequenceGroup and Sequence. The scheduler, the runner's input
preparation and the sampler's host packing read these.

`SamplingTensors.from_seqs` packs every sequence's SamplingParams into the fixed-shape arrays
that `sample` and `sample_rows` (jaxllm/layers/sampler.py) apply on the device; its four static
fields pick the compiled variant (the sampler's docstring lists them). Plain NumPy: nothing here
runs on the device (JAX only registers the arrays as a pytree).
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import jax
import numpy as np

from jaxllm.lora.request import LoRARequest
from jaxllm.sampling_params import SamplingParams
from jaxllm.structured_output.backend import fill_banned_bits

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
    # A prompt given as embeddings (--enable-prompt-embeds) is one "image" over all its
    # tokens whose embeddings are given (pixel_values), with no tower to run.
    given_embeds: bool = False

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


# Room in the sampler's per-row token table beyond the context: logit_bias, stop and EOS ids.
EXTRA_PENALTY_IDS = 512


def _static():
    return field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingTensors:
    temperature: jax.Array         # f32 [S]; 1.0 on greedy and padded rows
    greedy: jax.Array              # bool [S]; padded rows are greedy
    top_k: jax.Array               # int32 [S]; 0 = off (also for k >= V)
    top_p: jax.Array               # f32 [S]; 1.0 = off
    min_p: jax.Array               # f32 [S]; 0.0 = off
    uniforms: jax.Array            # f32 [S] in [0, 1): the row's draw, from (seed, step)
    repetition_penalty: jax.Array  # f32 [S]
    frequency_penalty: jax.Array   # f32 [S]
    presence_penalty: jax.Array    # f32 [S]
    pen_ids: jax.Array             # int32 [S, W]; 1 + unique token ids per row, 0 = empty slot
    pen_counts: jax.Array          # f32 [S, W]; occurrences among the output tokens
    pen_seen: jax.Array            # bool [S, W]; in prompt or output, and repetition_penalty != 1
    pen_bias: jax.Array            # f32 [S, W]; logit_bias, -inf for stop ids under min_tokens
    banned_bits: jax.Array         # uint32 [S, ceil(V/32)]; bit i%32 of word i//32: token i banned
    all_greedy: bool = _static()
    needs_filters: bool = _static()
    needs_processing: bool = _static()
    num_logprobs: Optional[int] = _static()

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], pad_to: int, vocab_size: int, *,
                      max_logprobs: int, penalty_width: int) -> "SamplingTensors":
        """Rows follow `seqs`; rows past them are greedy no-ops. penalty_width is the fixed
        width W of the penalty table (unique prompt+output ids, logit_bias ids and min_tokens
        stop ids of a row); a row needing more raises ValueError."""
        n, S = len(seqs), pad_to
        if n > S:
            raise ValueError(f"{n} sequences do not fit pad_to={S}")
        sps = [r.sampling_params for r in seqs]

        def column(values, fill, dtype, rows=None):
            out = np.full(S, fill, dtype)
            out[:n] = values
            return out if rows is None else np.where(rows, out, fill).astype(dtype)

        greedy = column([sp.greedy for sp in sps], True, bool)
        rand = ~greedy  # greedy and padded rows keep the neutral temperature and filters
        temperature = column([sp.temperature for sp in sps], 1, np.float32, rand)
        top_k = column([sp.top_k if sp.top_k < vocab_size else 0 for sp in sps], 0, np.int32, rand)
        top_p = column([sp.top_p for sp in sps], 1, np.float32, rand)
        min_p = column([sp.min_p for sp in sps], 0, np.float32, rand)
        uniforms = column(draw_uniforms([r.seed for r in seqs],
                                        [len(r.output_token_ids) for r in seqs]), 0, np.float32)
        penalties = [column([getattr(sp, name) for sp in sps], fill, np.float32)
                     for name, fill in (("repetition_penalty", 1), ("frequency_penalty", 0),
                                        ("presence_penalty", 0))]
        processing = [needs_processing(r) for r in seqs]
        width = penalty_width if any(processing) else 0
        table = _penalty_table(seqs, processing, S, width, vocab_size)
        bits = _banned_bits(seqs, S, -(-vocab_size // 32) if any(processing) else 0)
        return cls(temperature, greedy, top_k, top_p, min_p, uniforms, *penalties, *table, bits,
                   all_greedy=bool(greedy.all()),
                   needs_filters=bool(((top_k > 0) | (top_p < 1)).any()),
                   needs_processing=any(processing),
                   num_logprobs=max_logprobs if any(sp.logprobs is not None for sp in sps)
                   else None)


def warmup_tensors(pad_to: int, vocab_size: int, *, max_logprobs: int,
                   penalty_width: int) -> list[tuple[bool, SamplingTensors]]:
    """(plain, SamplingTensors) per compiled variant (the 12 static combinations) for this
    pad_to; plain: greedy or random sampling without penalties, logprobs or filters (vLLM's
    defaults), the variants the runner compiles before it is ready."""
    out = []
    for greedy in (True, False):
        for filters in ((False,) if greedy else (False, True)):
            for penalty in (1.0, 1.1):
                for logprobs in (None, 0):
                    sp = SamplingParams(temperature=0.0 if greedy else 1.0,
                                        top_k=2 if filters else 0, repetition_penalty=penalty,
                                        logprobs=logprobs)
                    out.append((not filters and penalty == 1.0 and logprobs is None,
                                SamplingTensors.from_seqs(
                                    [Sequence("warmup", [0], sp)], pad_to, vocab_size,
                                    max_logprobs=max_logprobs, penalty_width=penalty_width)))
    return out


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def draw_uniforms(seeds: list[int], steps: list[int]) -> np.ndarray:
    """The uniform behind token number `step` of a sequence seeded `seed`: splitmix64 of
    (seed, step), 24 bits, so a seeded sequence draws the same tokens in any batch."""
    z = _splitmix64(np.array([s % (1 << 64) for s in seeds], np.uint64))
    z = _splitmix64(z ^ np.array(steps, np.uint64))
    return ((z >> np.uint64(40)).astype(np.float64) * 2.0 ** -24).astype(np.float32)


def _min_tokens_stop_ids(r: Sequence) -> set[int]:
    """vLLM masks eos and stop_token_ids (even with ignore_eos) until min_tokens outputs."""
    sp = r.sampling_params
    if len(r.output_token_ids) >= sp.min_tokens:
        return set()
    return set(r.eos_token_ids) | set(sp.stop_token_ids)


def needs_processing(r: Sequence) -> bool:
    sp = r.sampling_params
    return bool(sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty
                or sp.logit_bias or sp.allowed_token_ids is not None or _min_tokens_stop_ids(r)
                or sp.bad_words_token_ids or r.grammar is not None)


def _unique(a: np.ndarray):
    """Sorted unique values and their counts, by one sort: np.unique's hash path is much slower
    on these small integer keys (docs/performance.md has the figure)."""
    a = np.sort(a)
    first = np.flatnonzero(np.r_[len(a) > 0, a[1:] != a[:-1]])
    return a[first], np.diff(np.r_[first, len(a)])


def _penalty_table(seqs, processing, S, width, V):
    """The [S, W] penalty table, built for all rows at once on (row * V + token) keys."""
    none = np.zeros(0, np.int64)
    seen, counted, bias = [none], [none], {}
    for i, r in enumerate(seqs):
        if not processing[i]:
            continue
        sp = r.sampling_params
        if sp.repetition_penalty != 1.0:
            seen.append(i * V + np.asarray(r.prompt_token_ids + r.output_token_ids, np.int64))
        if sp.frequency_penalty or sp.presence_penalty:
            counted.append(i * V + np.asarray(r.output_token_ids, np.int64))
        row_bias = dict(sp.logit_bias or {})
        row_bias.update(dict.fromkeys(_min_tokens_stop_ids(r), -np.inf))
        bias.update({i * V + t: b for t, b in row_bias.items() if 0 <= t < V})
    seen = _unique(np.concatenate(seen))[0]
    c_keys, c_num = _unique(np.concatenate(counted))
    biased = np.fromiter(bias, np.int64, len(bias))
    keys = _unique(np.concatenate([seen, c_keys, biased]))[0]
    row = keys // V
    col = np.arange(len(keys)) - np.searchsorted(row, row)
    if len(keys) and col.max() >= width:
        r = seqs[row[col.argmax()]]
        raise ValueError(f"sequence {r.seq_id!r} needs more than penalty_width={width} "
                         f"penalty entries (unique prompt+output ids, logit_bias, stop ids)")
    flat = [keys % V + 1, np.zeros(len(keys), np.float32), np.zeros(len(keys), bool),
            np.zeros(len(keys), np.float32)]
    flat[1][np.searchsorted(keys, c_keys)] = c_num
    flat[2][np.searchsorted(keys, seen)] = True
    flat[3][np.searchsorted(keys, biased)] = np.fromiter(bias.values(), np.float32, len(bias))
    out = [_host_zeros((S, width), dtype) for dtype in (np.int32, np.float32, bool, np.float32)]
    for table, values in zip(out, flat):
        table[row, col] = values
    return out


def _banned_bits(seqs, S, words):
    """Each row's banned tokens: the grammar's mask (written first, whole rows), then tokens
    outside allowed_token_ids and the bad words' last tokens OR-ed in."""
    bits = _host_zeros((S, words), np.uint32)
    if words == 0:
        return bits
    fill_banned_bits([(r.grammar, i) for i, r in enumerate(seqs) if r.grammar is not None], bits)
    for i, r in enumerate(seqs):
        allowed = r.sampling_params.allowed_token_ids
        if allowed is not None:
            bits[i] |= ~_token_bits(allowed, words)
        banned = _bad_word_tokens(r)
        if banned:
            bits[i] |= _token_bits(banned, words)
    return bits


def _token_bits(ids, words):
    a = np.asarray(ids, np.int64)
    out = np.zeros(words, np.uint32)
    np.bitwise_or.at(out, a >> 5, np.uint32(1) << (a & 31).astype(np.uint32))
    return out


def _bad_word_tokens(r: Sequence) -> list[int]:
    """vLLM's bad words: the last token of each bad word whose other tokens end the output."""
    out = r.output_token_ids
    return [w[-1] for w in r.sampling_params.bad_words_token_ids
            if len(w) <= len(out) + 1 and (len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1])]


def _host_zeros(shape, dtype):
    """Zeros whose pages are touched only where written, 64-byte aligned so that jit reads them
    in place rather than copying: a [256, W] table with a few real rows costs what they hold."""
    size = math.prod(shape) * np.dtype(dtype).itemsize
    buf = np.zeros(size + 64, np.uint8)
    start = -buf.ctypes.data % 64
    return buf[start:start + size].view(dtype).reshape(shape)
