"""A step on the host: its inputs (one scheduled step -> the padded bucket arrays of the jitted
step) and, below, what it is while it runs and after: the tokens a step sampled
(`SampleResult`), a dispatched step whose results are still on the device (`Inflight`), one step
of a burst (`BurstStep`), and what step hooks are shown (`StepEvent`).

Every step program has fixed shapes: T tokens (a power-of-two bucket, which alone picks the
forward program), max_num_seqs rows of attention metadata and the full block-table width. This
file turns a `SchedulerOutput` into those arrays (NumPy only, no device work), and builds the
all-padding inputs that warm-up and background compiles trace with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

from jaxllm.layers.attention import AttentionMetadata
from jaxllm.sequence import PENDING, SamplingTensors, SchedulerOutput, Sequence
from jaxllm.spec_decode.acceptance import draft_views


def pow2_buckets(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


def bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class StepInputs(NamedTuple):
    """The forward program's inputs after the weights and the KV cache, in its order."""
    token_ids: Any        # int32 [T]; a PENDING token is read on the device from prev_tokens
    positions: Any        # int32 [T]
    metadata: AttentionMetadata
    logits_indices: Any   # int32 [num_rows]: the flat rows whose next token is sampled
    prev_tokens: Any      # int32 [num_rows]: the previous step's samples (device array)
    from_prev: Any        # int32 [T]: row of prev_tokens to take the token from, -1 = none
    lora_slots: Any = None  # int32 [T]: each token's LoRA adapter slot, -1 = none (None: no LoRA)
    # A vision-language model's (embeddings [T, E], bool mask [T]): the image tokens' rows
    # (None: a text-only model). Its positions are then M-RoPE's, int32 [3, T].
    mm_embeds: Any = None


@dataclass
class PromptRows:
    """One sequence's prompt positions in a step: flat rows whose hidden states predict the
    prompt tokens first, first + 1, ... (the targets)."""
    seq: Sequence
    first: int
    rows: np.ndarray


@dataclass
class PreparedStep:
    inputs: StepInputs
    # The sequences sampled, in row order; a sequence with drafts has one row per verified
    # position (acceptance.draft_views: itself with the drafts before that position).
    seqs: list[Sequence]
    prompt_rows: list[PromptRows]


class InputBatcher:
    """Bucket choice and packing for one model runner's fixed shapes."""

    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, block_size: int,
                 max_model_len: int, enforce_eager: bool, decode_programs: bool,
                 num_rows: Optional[int] = None, num_speculative_tokens: int = 0,
                 lora: bool = False, mm: Optional[tuple[int, Any]] = None,
                 state_slots: bool = False, mrope: bool = True, image_spans: bool = False):
        """num_rows: sampled rows per step (max_num_seqs, times 1 + k with k drafts each).
        lora: the model has LoRA slots (each token's slot is an input). mm: a vision-language
        model's (hidden size, dtype) of image embeddings (M-RoPE positions, embedding rows).
        state_slots: a hybrid model's (each sequence's linear-attention state slot is an
        input). mrope: with mm, positions are M-RoPE's [3, T] (Qwen2.5-VL; else 1-D: Gemma 3).
        image_spans: image tokens attend to their whole image (AttentionMetadata.attend_to)."""
        self.max_num_seqs = max_num_seqs
        self.mm = mm
        self.mrope = bool(mm) and mrope
        self.image_spans = image_spans
        self.state_slots = state_slots
        self.lora = lora
        self.num_rows = num_rows or max_num_seqs
        self.block_size = block_size
        self.blocks_per_seq = math.ceil(max_model_len / block_size)
        self.enforce_eager = enforce_eager
        # Decode steps get programs of their own (decode tiling) unless the attention is the
        # same for every step: then a decode step of T tokens runs the token bucket T program.
        self.decode_programs = decode_programs
        # Decode steps (one token per sequence) get buckets from 1 up to max_num_seqs; steps with
        # a prompt chunk start at 16, since tiny prefills gain nothing from their own program.
        self.decode_buckets = pow2_buckets(1, min(max_num_seqs, max_num_batched_tokens))
        self.token_buckets = pow2_buckets(min(16, max_num_batched_tokens), max_num_batched_tokens)
        # Without decode programs every bucket is a general one: a small mixed step (a few
        # decodes with drafts) takes the smallest that fits.
        self.mixed_buckets = (self.token_buckets if decode_programs
                              else sorted({*self.decode_buckets, *self.token_buckets}))
        # Speculation: b decodes with k drafts each are b (1 + k) tokens, which would pad to
        # the smallest token bucket (16): verifying 4 drafts of one request would run 16 rows,
        # about twice the time of the same step padded to 5 (docs/performance.md has the
        # figures). Those small sizes get buckets of their own.
        k1 = 1 + num_speculative_tokens
        self.spec_buckets = sorted({k1 * b for b in self.decode_buckets if k1 > 1
                                    and k1 * b < self.token_buckets[0]} - {*self.mixed_buckets})
        self.mixed_buckets = sorted({*self.mixed_buckets, *self.spec_buckets})

    def forward_shapes(self) -> list[tuple[int, bool]]:
        """(T, decode_only) of every forward program warm-up compiles."""
        return sorted({*((T, False) for T in self.token_buckets + self.spec_buckets),
                       *((T, self.decode_programs) for T in self.decode_buckets)})

    def prepare(self, sched: SchedulerOutput, prev_seqs: list[Sequence],
                prev_tokens, mm_rows: Optional[dict] = None) -> PreparedStep:
        """Flat padded arrays for the scheduled sequences. prev_seqs are the rows of
        prev_tokens: an input token still PENDING (sampled by the step before, not read yet) is
        taken from there on the device. mm_rows: {seq_id: (prompt indices, embeddings)} of the
        image tokens the step computes (jaxllm/worker/encoder.py)."""
        items = sched.scheduled
        num_tokens = sum(it.num_tokens for it in items)
        decode_only = num_tokens == len(items)
        buckets = self.decode_buckets if decode_only else self.mixed_buckets
        T = num_tokens if self.enforce_eager else bucket(num_tokens, buckets)
        S, bs = self.max_num_seqs, self.block_size
        token_ids = np.zeros(T, np.int32)
        positions = np.zeros((3, T) if self.mrope else T, np.int32)
        attend_to = np.zeros(T, np.int32) if self.image_spans else None
        mm_embeds = self._mm_padding(T)
        slots = np.full(T, -1, np.int32)
        kv_lens = np.zeros(S, np.int32)
        tables = np.zeros((S, self.blocks_per_seq), np.int32)
        cu = np.zeros(S + 1, np.int32)
        from_prev = np.full(T, -1, np.int32)
        lora_slots = np.full(T, -1, np.int32) if self.lora else None
        prev_rows = {s.seq_id: i for i, s in enumerate(prev_seqs)}
        rows, prompt_rows, t = [], [], 0
        for i, it in enumerate(items):
            seq, n, start, spec = it.seq, it.num_tokens, it.start, it.spec_token_ids
            if lora_slots is not None:
                lora_slots[t:t + n] = it.lora_slot
            if n == 1 and not spec and start >= seq.num_prompt_tokens:
                # A decode token, in scalars: the general path's dozen small array operations
                # per sequence add up over a large batch, all while the device waits.
                token = seq.output_token_ids[start - seq.num_prompt_tokens]
                token_ids[t] = token
                if token == PENDING:
                    from_prev[t] = prev_rows[seq.seq_id]
                positions[..., t] = start + (seq.mm.delta if seq.mm is not None else 0)
                if attend_to is not None:
                    attend_to[t] = start
                slots[t] = it.block_ids[start // bs] * bs + start % bs
                kv_lens[i] = start + 1
                tables[i, :len(it.block_ids)] = it.block_ids
                t += 1
                cu[i + 1] = t
                if it.sample:
                    rows.append((seq, t - 1))
                continue
            known = n - len(spec)  # the drafts follow the sequence's known tokens
            token_ids[t:t + known] = seq.token_slice(start, known)
            token_ids[t + known:t + n] = spec
            if token_ids[t + known - 1] == PENDING:  # only the last output token is in flight
                from_prev[t + known - 1] = prev_rows[seq.seq_id]
            pos = np.arange(start, start + n, dtype=np.int32)
            positions[..., t:t + n] = (seq.mm.rope_positions(start, n) if self.mrope
                                       and seq.mm is not None else pos)
            if attend_to is not None:
                attend_to[t:t + n] = pos
                for s0, k in zip(*((seq.mm.starts, seq.mm.num_tokens) if seq.mm else ((), ()))):
                    lo, hi = max(start, s0), min(start + n, s0 + k)
                    if lo < hi:  # the image's tokens in this chunk see all of it
                        attend_to[t + lo - start:t + hi - start] = s0 + k - 1
            if mm_rows and seq.seq_id in mm_rows:
                at, emb = mm_rows[seq.seq_id]
                mm_embeds[0][t + at - start] = emb
                mm_embeds[1][t + at - start] = True
            blocks = np.asarray(it.block_ids, np.int32)
            slots[t:t + n] = blocks[pos // bs] * bs + pos % bs
            kv_lens[i] = start + n
            tables[i, :len(blocks)] = blocks
            # Position p predicts token p + 1: a prompt logprob while p + 1 is in the prompt.
            end = min(start + n, seq.num_prompt_tokens - 1)
            if seq.needs_prompt_logprobs and end > start:
                prompt_rows.append(PromptRows(seq, start + 1, np.arange(t, t + end - start)))
            t += n
            cu[i + 1] = t
            if it.sample:
                views = draft_views(seq, spec) if spec else (seq,)
                rows += [(view, t - len(spec) - 1 + j) for j, view in enumerate(views)]
        cu[len(items) + 1:] = t
        state_slots = None
        if self.state_slots:
            state_slots = np.full(S, -1, np.int32)
            state_slots[:len(items)] = [it.state_slot for it in items]
        md = AttentionMetadata(slots, kv_lens, tables, cu, np.array([len(items)], np.int32),
                               decode_only=decode_only and self.decode_programs,
                               state_slots=state_slots, attend_to=attend_to)
        logits_indices = np.zeros(self.num_rows, np.int32)
        logits_indices[:len(rows)] = [r[1] for r in rows]
        inputs = StepInputs(token_ids, positions, md, logits_indices, prev_tokens, from_prev,
                            lora_slots, mm_embeds)
        return PreparedStep(inputs, [r[0] for r in rows], prompt_rows)

    def _mm_padding(self, T: int):
        """No image rows: zero embeddings, an all-False mask (None: a text-only model)."""
        if self.mm is None:
            return None
        return np.zeros((T, self.mm[0]), self.mm[1]), np.zeros(T, bool)

    def padding(self, T: int, decode_only: bool, prev_tokens) -> StepInputs:
        """All-padding inputs of T tokens (nothing is written): what programs are traced with."""
        S, z = self.max_num_seqs, np.zeros(T, np.int32)
        md = AttentionMetadata(np.full(T, -1, np.int32), np.zeros(S, np.int32),
                               np.zeros((S, self.blocks_per_seq), np.int32),
                               np.zeros(S + 1, np.int32), np.zeros(1, np.int32),
                               decode_only=decode_only,
                               state_slots=np.full(S, -1, np.int32) if self.state_slots
                               else None, attend_to=z if self.image_spans else None)
        return StepInputs(z, np.zeros((3, T), np.int32) if self.mrope else z, md,
                          np.zeros(self.num_rows, np.int32), prev_tokens, z,
                          np.full(T, -1, np.int32) if self.lora else None, self._mm_padding(T))


def prompt_logprob_targets(T: int, prompt_rows: list[PromptRows]):
    """(row_idx [T], target_ids [T], n): one entry per target prompt token (at most T of them,
    the step's tokens), padded to T."""
    row_idx, target_ids = np.zeros(T, np.int32), np.zeros(T, np.int32)
    n = 0
    for pr in prompt_rows:
        k = len(pr.rows)
        row_idx[n:n + k] = pr.rows
        target_ids[n:n + k] = pr.seq.prompt_token_ids[pr.first:pr.first + k]
        n += k
    return row_idx, target_ids, np.int32(n)


# --- a step while it runs and after ------------------------------------------------------------

@dataclass
class SampleResult:
    token: int
    logprob: Optional[float] = None
    rank: Optional[int] = None
    top: tuple = ()  # ((token_id, logprob), ...) best first


@dataclass
class Inflight:
    """A dispatched step whose results are still on the device."""
    sched: SchedulerOutput
    seqs: list[Sequence]  # the sequences sampled, in row order
    out: Any              # SamplerOutput (device arrays) or None
    prompt_rows: list[PromptRows]
    prompt: Any           # prompt-logprobs results (device arrays) or None
    expert_load: Any = None  # int32 [MoE layers, experts] on the device, when counted
    hidden: Optional["StepHidden"] = None  # kept for an MTP drafter (ModelRunner keep_hidden)


@dataclass
class StepHidden:
    """A step's final (normed) hidden states, every token's row [T, E] on the device, with the
    step's positions and attention metadata (host arrays) that place each row: what an MTP
    drafter continues from (jaxllm/spec_decode/mtp.py)."""
    hidden: Any
    positions: Any
    metadata: Any


@dataclass
class BurstStep:
    """One step of a burst: its Inflight (tokens filled in by dispatch_burst), host arrays."""
    inflight: Inflight
    inputs: StepInputs
    tensors: SamplingTensors


@dataclass
class StepEvent:
    """What a step hook (`ModelRunner.add_step_hook`) is shown: tests and profilers observe or
    delay steps through it, and inject faults by raising (the step fails as on a device error).
    kind: 'dispatch' (one step launched), 'burst' (several launched as one program) or
    'collect' (one step read back)."""
    kind: str
    steps: list[Inflight]
    chained: bool = False  # launched before the step it follows was read (async scheduling)
    sampled: Optional[dict] = None          # collect: seq_id -> [SampleResult, ...]
    prompt_logprobs: Optional[dict] = None  # collect: seq_id -> (first, [SampleResult, ...])


def sample_result(out, i: int, seq: Sequence) -> SampleResult:
    """Row i of the sampler's host output, as the sequence asked for it (logprobs or not)."""
    k = seq.sampling_params.logprobs
    if k is None:
        return SampleResult(int(out.token_ids[i]))
    top = tuple(zip(out.top_token_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist()))
    return SampleResult(int(out.token_ids[i]), float(out.logprobs[i]), int(out.ranks[i]), top)


def prompt_results(out, prompt_rows: list[PromptRows]) -> dict[str, tuple]:
    """The prompt-logprobs program's host output, split per sequence, top-k cut to its k."""
    logprobs, ranks, top_logprobs, top_ids = out
    results, n = {}, 0
    for pr in prompt_rows:
        seq, m = pr.seq, len(pr.rows)
        k = seq.sampling_params.prompt_logprobs
        targets = seq.prompt_token_ids[pr.first:pr.first + m]
        rows = zip(targets, logprobs[n:n + m].tolist(), ranks[n:n + m].tolist(),
                   top_ids[n:n + m, :k].tolist(), top_logprobs[n:n + m, :k].tolist())
        results[seq.seq_id] = (pr.first, [SampleResult(t, lp, r, tuple(zip(ids, lps)))
                                              for t, lp, r, ids, lps in rows])
        n += m
    return results
