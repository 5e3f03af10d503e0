"""The MTP proposer (vLLM's "deepseek_mtp" method): the target checkpoint's own
multi-token-prediction layer (jaxllm/models/mtp.py) drafts k tokens per sequence.

The MTP row of position p is (token t_{p+1}, the target's hidden state h_p) and predicts
t_{p+2}. Two programs, both pure functions of the MTP layer's weights, the target's (for the
shared embedding and LM head), the MTP layer's KV cache and per-sequence buffers:

  feed   when a target step is collected (`observe`, from Speculator.record): the MTP layer
         runs over the step's tokens with the step's own hidden states, positions and
         attention metadata (`StepHidden`), each row's input token being the sequence's next
         one (the following input token, or the token the step sampled; rejected drafts' rows
         get a dummy token: they are rewritten before any valid row reads them). So the MTP
         cache fills in step with the target's, prompt chunks included. At each sequence's
         last confirmed row (the one whose next token was just sampled) it also keeps the
         layer's first draft and output in the sequence's buffer slot.
  draft  at `propose`: the first draft from the buffer, then k - 1 decode steps of the layer,
         each fed the previous draft and the previous output x as the hidden state (vLLM's
         reuse of one MTP layer for k > 1), in one `lax.scan`.

The MTP cache is paged by the target's block tables (a block holds the same tokens in both
caches, so prefix caching and preemption need nothing of their own): it has the target's
blocks, plus per buffer slot ceil((k - 1) / block_size) scratch blocks for the draft steps'
positions past the target's table. Drafts write only at positions >= the sequence's confirmed
length (in blocks no other sequence shares); the next feed rewrites them.
Where a row's inputs are missing (the last position of a prefix found in the prefix cache,
KV blocks that went to the host tier and back) the MTP cache keeps what an earlier sequence
wrote there: drafts may then be rejected more often, never accepted wrongly (the target
verifies every draft: acceptance.py).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxllm.engine_config import EngineConfig
from jaxllm.layers.attention import AttentionMetadata, empty_kv_caches, kv_cache_shardings
from jaxllm.loader.mtp_weights import load_mtp, mtp_source
from jaxllm.models.model_config import ModelConfig
from jaxllm.sequence import SchedulerOutput, Sequence, SequenceStatus
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.worker.compile_manager import CompileManager, ProgramKey
from jaxllm.worker.executable_cache import ExecutableCache
from jaxllm.worker.input_batch import bucket


class MtpProposer:
    """propose / may_propose / observe / free (the Proposer protocol). `runner` is the
    target's ModelRunner, built with keep_hidden=True: its mesh, backend, weights (the shared
    embedding and head), decode buckets and KV cache dtype are the MTP layer's too;
    num_blocks is the target cache's size."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, target: ModelConfig,
                 runner, num_blocks: int, kv_dtype, executable_dir: Optional[str] = None):
        self.k = spec.num_speculative_tokens
        self.runner = runner
        src = mtp_source(config.load, target, spec.method)
        model, self.cfg = load_mtp(src, target, runner.backend, runner.mesh, config.model.seed)
        self.graphdef, state = nnx.split(model)
        self.state = runner.backend.relayout(state, self.cfg)
        self.block_size = B = config.cache.block_size
        self.max_len = target.max_model_len
        self.slots = config.scheduler.max_num_seqs  # buffer slots: sequences in one step
        self.scratch = math.ceil((self.k - 1) / B)  # draft blocks per slot past the table
        self.first_scratch = num_blocks
        shapes = model.kv_cache_shapes(num_blocks + self.slots * self.scratch, B)
        kv_sharding = kv_cache_shardings(shapes, runner.mesh)
        self.kv = empty_kv_caches(shapes, kv_dtype, kv_sharding)
        rep = NamedSharding(runner.mesh, P())  # the buffers and drafts: replicated
        self.decode_only = runner.backend.decode_programs(kv_dtype)
        self.width = math.ceil((self.max_len + self.k) / B)  # block-table width of drafts
        self.buckets = runner.input_batch.decode_buckets
        self.buf_tokens = jax.device_put(np.zeros(self.slots, np.int32), rep)
        self.buf_hidden = jax.device_put(
            np.zeros((self.slots, target.hidden_size), self.cfg.jnp_dtype), rep)
        self._slot: OrderedDict[str, int] = OrderedDict()  # seq_id -> slot, least recent first
        self._blocks: dict[str, list[int]] = {}  # seq_id -> its (live) target block table
        self._feed = jax.jit(self._feed_fn, donate_argnums=(2, 3, 4),
                             out_shardings=(kv_sharding, rep, rep))
        self._draft = jax.jit(self._draft_fn, donate_argnums=(2,),
                              out_shardings=(kv_sharding, rep))
        # Each program compiles when first needed (one per target step shape, one per decode
        # bucket), kept in the executable cache as the runner's are.
        self._programs = CompileManager(executable_cache=None if executable_dir is None else
                                        ExecutableCache(
            os.path.join(executable_dir, "jaxllm-executables"), runner.mesh.devices.flat,
            context=repr(("mtp", self.graphdef, runner.graphdef, self.k))))

    # --- the jitted functions ----------------------------------------------------------------
    def _models(self, state, target_state):
        return nnx.merge(self.graphdef, state), nnx.merge(self.runner.graphdef, target_state)

    def _feed_fn(self, state, target_state, kv, buf_tokens, buf_hidden, hidden, next_tokens,
                 positions, md, rows, slots):
        mtp, target = self._models(state, target_state)
        x, kv = mtp.hidden_states(kv, next_tokens, hidden, positions, md, target)
        x = x[rows]
        tokens = mtp.greedy(x, target)
        return (kv, buf_tokens.at[slots].set(tokens, mode="drop"),
                buf_hidden.at[slots].set(x.astype(buf_hidden.dtype), mode="drop"))

    def _draft_fn(self, state, target_state, kv, buf_tokens, buf_hidden, slots, positions, md):
        """The drafts [rows, k] of the sequences in buffer `slots`; positions [k - 1, rows]
        and md (stacked on a leading k - 1 axis) place the draft steps."""
        mtp, target = self._models(state, target_state)
        first, x = buf_tokens[slots], buf_hidden[slots]
        if self.k == 1:
            return kv, first[:, None]

        def step(carry, xs):
            kv, token, h = carry
            pos, m = xs
            out, kv = mtp.hidden_states(kv, token, h, pos, m, target)
            nxt = mtp.greedy(out, target)
            return (kv, nxt, out), nxt

        (kv, _, _), rest = lax.scan(step, (kv, first, x), (positions, md))
        return kv, jnp.concatenate([first[:, None], rest.T], axis=1)

    # --- host side ---------------------------------------------------------------------------
    def may_propose(self, seqs: list[Sequence]) -> np.ndarray:
        """The MTP layer proposes for every sequence."""
        return np.ones(len(seqs), bool)

    def free(self, seq_id: str) -> None:
        self._slot.pop(seq_id, None)
        self._blocks.pop(seq_id, None)

    def observe(self, sched: SchedulerOutput, sampled: dict, out) -> None:
        """Feed a collected target step (its StepHidden `out`; `sampled`: seq_id -> the
        SampleResults kept, accepted drafts and one more) to the MTP layer."""
        for sid in sched.preempted_ids:  # recomputed later: a slot again when it samples
            self.free(sid)
        if out is None:
            return
        T = out.hidden.shape[0]
        next_tokens = np.zeros(T, np.int32)
        rows = np.zeros(self.slots, np.int32)
        slots = np.full(self.slots, self.slots, np.int32)  # out of range: dropped
        here = {s.seq.seq_id for s in sched.scheduled}
        t, r = 0, 0
        for s in sched.scheduled:
            seq, n = s.seq, s.num_tokens
            known = n - len(s.spec_token_ids)
            got = sampled.get(seq.seq_id)
            if seq.status == SequenceStatus.RUNNING and (got or not s.sample):
                next_tokens[t:t + known - 1] = seq.token_slice(s.start + 1, known - 1)
                if s.sample:
                    last = t + known - 1 + len(got) - 1  # the last accepted row
                    next_tokens[t + known - 1:last + 1] = [g.token for g in got]
                    rows[r], slots[r] = last, self._take_slot(seq.seq_id, here)
                    r += 1
                else:  # a chunk of known tokens: its last row's next one is known too
                    next_tokens[t + known - 1] = seq.token_slice(s.start + known, 1)[0]
                self._blocks[seq.seq_id] = s.block_ids
            t += n
        key = ProgramKey("mtp_feed", T, out.metadata.decode_only)
        self.kv, self.buf_tokens, self.buf_hidden = self._programs.run(
            key, self._feed, self.state, self.runner.weights()[0], self.kv, self.buf_tokens,
            self.buf_hidden, out.hidden, next_tokens, out.positions, out.metadata, rows, slots,
            first_use=True)

    def _take_slot(self, seq_id: str, keep: set) -> int:
        """The sequence's buffer slot (a free one, or the least recently fed sequence's that
        is not in this step)."""
        slot = self._slot.pop(seq_id, None)
        if slot is None:
            used = set(self._slot.values())
            free = [i for i in range(self.slots) if i not in used]
            if free:
                slot = free[0]
            else:  # (all in this step only if a recomputing prompt kept an old slot)
                victim = next((sid for sid in self._slot if sid not in keep),
                              next(iter(self._slot)))
                slot = self._slot.pop(victim)
        self._slot[seq_id] = slot
        return slot

    def propose(self, seqs: list[Sequence], k: int, limits: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
        """Up to min(k, limits[r]) drafts after each sequence's confirmed tokens (none for a
        sequence the MTP layer has not seen sampled: its buffer slot went to another)."""
        if k > self.k:
            raise ValueError(f"k={k} exceeds num_speculative_tokens={self.k}")
        drafts = np.full((len(seqs), k), -1, np.int32)
        counts = np.zeros(len(seqs), np.int32)
        batch = [(r, s) for r, s in enumerate(seqs)
                 if min(int(limits[r]), k) > 0 and s.seq_id in self._slot]
        if not batch:
            return drafts, counts
        for _, s in batch:
            if s.has_pending or s.num_tokens - s.num_computed_tokens != 1:
                raise ValueError(f"sequence {s.seq_id}: drafts need its tokens confirmed and "
                                 "all but the last computed")
        out = self._run([s for _, s in batch])
        for (r, _), d in zip(batch, out):
            n = min(int(limits[r]), k)
            drafts[r, :n], counts[r] = d[:n], n
        return drafts, counts

    def _run(self, seqs: list[Sequence]) -> np.ndarray:
        """The draft program over `seqs`: int32 [len(seqs), K]."""
        K, B, S = self.k, self.block_size, self.slots
        T = bucket(len(seqs), self.buckets)
        slots = np.zeros(T, np.int32)
        positions = np.zeros((max(K - 1, 1), T), np.int32)
        slot_mapping = np.full((max(K - 1, 1), T), -1, np.int32)
        kv_lens = np.zeros((max(K - 1, 1), S), np.int32)
        tables = np.zeros((S, self.width), np.int32)
        cu = np.zeros(S + 1, np.int32)
        for i, s in enumerate(seqs):
            slot = self._slot[s.seq_id]
            slots[i] = slot
            own = self._blocks[s.seq_id][:self.width]
            extra = self.first_scratch + slot * self.scratch + np.arange(self.scratch)
            row = np.concatenate([np.asarray(own, np.int32), extra])[:self.width]
            tables[i, :len(row)] = row
            for j in range(K - 1):  # draft j + 1 is predicted at position n - 1 + j
                p = s.num_tokens - 1 + j
                positions[j, i] = p
                slot_mapping[j, i] = tables[i, p // B] * B + p % B
                kv_lens[j, i] = p + 1
        cu[1:len(seqs) + 1] = np.arange(1, len(seqs) + 1)
        cu[len(seqs) + 1:] = len(seqs)
        steps = max(K - 1, 1)
        md = AttentionMetadata(slot_mapping, kv_lens, np.stack([tables] * steps),
                               np.stack([cu] * steps),
                               np.full((steps, 1), len(seqs), np.int32),
                               decode_only=self.decode_only)
        self.kv, out = self._programs.run(
            ProgramKey("mtp_draft", T, steps=K), self._draft, self.state,
            self.runner.weights()[0], self.kv, self.buf_tokens, self.buf_hidden, slots,
            positions, md, first_use=True)
        return np.asarray(jax.device_get(out))[:len(seqs)]
