"""The draft-model proposer (vLLM's "draft_model" method): a small model of the target's
vocabulary proposes K tokens per sequence by greedy decoding, with its own paged KV cache.

It reuses the engine's pieces rather than copying them: a `ModelRunner` of its own (the same
bucketed, jitted forward, greedy sampler and multi-step `burst` program, compiled at start-up)
and a `KVCacheManager` of its own (prefix caching off: rejected drafts are overwritten in
place, which a shared cached block must never see). The engine's sequences are mirrored by
shadow `Sequence`s that sample greedily.

Per `propose`, for each sequence it remembers the tokens it fed the draft: the longest common
prefix with the sequence's confirmed tokens is still valid in its cache (everything after it,
the rejected drafts, is simply overwritten). Then:
  catch-up  ONE ragged step over every row's new tokens (usually the correction or bonus token
            plus an unfed accepted draft: 1-2 tokens); it samples each row's first draft.
            A catch-up larger than max_num_batched_tokens (a new request's prompt) first runs
            all but each row's last token in chunked steps that sample nothing.
  decode    K-1 greedy decode steps of all rows in one `burst` program (a lax.scan), each step
            reading the last one's tokens on the device.
Both are launched without waiting; one device-to-host read returns all K drafts. Greedy (argmax)
drafts are what the verifier expects: it treats q as a point mass, so sampling stays exact.
A row whose blocks do not fit evicts the least recently used idle sequences' caches (those not
in this call), else proposes nothing this step; it never fails.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import jax
import numpy as np

from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.kv_calibration import calculate_kv_scales
from jaxllm.models.kv_scales import CALCULATED
from jaxllm.engine.runner_settings import (executable_cache_dir, kv_cache_dtype,
                                           max_num_batched_tokens, num_kv_blocks)
from jaxllm.engine_config import EngineConfig
from jaxllm.models.model_config import ModelConfig
from jaxllm.parallel.mesh import make_mesh
from jaxllm.sampling_params import SamplingParams
from jaxllm.sequence import PENDING, ScheduledSequence, SchedulerOutput, Sequence
from jaxllm.spec_decode.config import MTP_METHODS, SpeculativeConfig
from jaxllm.spec_decode.draft_load import draft_config, load_draft
from jaxllm.spec_decode.mtp import MtpProposer
from jaxllm.spec_decode.speculator import Speculator
from jaxllm.worker.model_runner import ModelRunner

_GREEDY = SamplingParams(temperature=0.0)


@dataclass
class _Row:
    """What the draft cache holds for one sequence: KV of `fed` at positions 0..len(fed)-1,
    the first `confirmed` of them known equal to the sequence's (confirmed tokens never
    change, so only the tail after them is compared)."""
    shadow: Sequence
    fed: list[int] = field(default_factory=list)
    confirmed: int = 0


class DraftModelProposer:
    """propose(seqs, k, limits) -> (drafts int32 [R, k] -1 padded, counts int32 [R]);
    free(seq_id). `config`/`target` are the target's engine config (its model path resolved)
    and model config; the draft runs unsharded on devices[0] (default: this process's first
    device), with `draft_config(spec, config)`. The draft
    cache is sized by the target's budget rules (for max_num_seqs sequences of the speculated
    length plus K), capped by target_num_blocks, the target cache's size, plus room for K
    tokens per sequence: it mirrors the target's sequences, so more would sit unused.
    num_blocks overrides all that."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, target: ModelConfig, *,
                 devices: Optional[list] = None, target_num_blocks: Optional[int] = None,
                 num_blocks: Optional[int] = None):
        self.k = spec.num_speculative_tokens
        mesh = make_mesh(1, devices=(devices or jax.local_devices())[:1])
        draft = draft_config(spec, config)
        model, mc, self.max_len = load_draft(spec, draft, config.load, target, mesh)
        # Block tables reach K positions past the speculated length: a row near it still runs
        # every decode step of the batch (its extra drafts are cut by its limit).
        mc = dataclasses.replace(mc, max_model_len=self.max_len + self.k)
        dtype = kv_cache_dtype(draft.cache, mc.jnp_dtype, model.attention_backend)
        if mc.kv_scales == CALCULATED:  # --calculate-kv-scales: the draft's own (no tokenizer
            calculate_kv_scales(model, dtype)  # here: the calibration's fallback ids)
        block_size, sched = draft.cache.block_size, draft.scheduler
        if num_blocks is None:
            num_blocks = num_kv_blocks(draft, mc, dtype)
            if target_num_blocks is not None:
                per_seq = -(-(self.k - 1) // block_size) + 1  # K-1 fed drafts, a partial block
                num_blocks = min(num_blocks, target_num_blocks + sched.max_num_seqs * per_seq)
        self.max_num_seqs = sched.max_num_seqs
        # Catch-up steps hold 1-2 tokens per row in the steady state: room for two per row.
        self.max_tokens = max_num_batched_tokens(sched, per_seq=2)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(
            model, mc, mesh, num_blocks=num_blocks, block_size=block_size,
            kv_cache_dtype=dtype, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=self.max_tokens, max_logprobs=sched.max_logprobs,
            enforce_eager=sched.enforce_eager, executable_dir=executable_cache_dir(),
            num_scheduler_steps=max(self.k - 1, 1))
        self.runner.warmup(greedy_only=True)
        self.runner.wait_for_background_compiles()  # the decode bursts: needed every step
        self._rows: OrderedDict[str, _Row] = OrderedDict()  # least recently proposed first

    @property
    def num_recompiles(self) -> int:
        return self.runner.num_recompiles

    def may_propose(self, seqs: list[Sequence]) -> np.ndarray:
        """The draft model proposes for every sequence (when its cache has room)."""
        return np.ones(len(seqs), bool)

    def observe(self, sched: SchedulerOutput, sampled: dict, hidden) -> None:
        pass  # the draft reads the sequences' tokens when it proposes

    def free(self, seq_id) -> None:
        """The sequence finished or was aborted: release its draft cache blocks."""
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self.kv.free(row.shadow)

    def propose(self, seqs: list[Sequence], k: int, limits: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
        """Up to min(k, limits[r]) greedy draft tokens after each sequence's confirmed tokens
        (fewer where the speculated length ends, none where the cache is full)."""
        if k > self.k:
            raise ValueError(f"k={k} exceeds num_speculative_tokens={self.k}")
        if len(seqs) > self.max_num_seqs:
            raise ValueError(f"{len(seqs)} sequences exceed max_num_seqs={self.max_num_seqs}")
        drafts = np.full((len(seqs), k), -1, np.int32)
        counts = np.zeros(len(seqs), np.int32)
        batch = []  # (index in seqs, _Row, tokens, first position to feed)
        ids = {s.seq_id for s in seqs}
        for r, seq in enumerate(seqs):
            if seq.has_pending:
                raise ValueError(f"sequence {seq.seq_id}: a draft needs its tokens confirmed "
                                 "(its last step is still in flight)")
            if min(int(limits[r]), k, self.max_len - seq.num_tokens) <= 0:
                continue
            tokens = seq.all_token_ids
            row = self._rows.get(seq.seq_id) or _Row(Sequence(seq.seq_id, [], _GREEDY))
            start = _valid_prefix(row, tokens)
            row.shadow.prompt_token_ids, row.shadow.output_token_ids = tokens, []
            row.shadow.num_computed_tokens = start
            if not self._reserve(row, len(tokens) - start + self.k - 1, ids):
                continue
            self._rows[seq.seq_id] = row
            self._rows.move_to_end(seq.seq_id)
            batch.append((r, row, tokens, start))
        if not batch:
            return drafts, counts
        out = self._run(batch)
        for (r, row, tokens, _), d in zip(batch, out):
            n = min(int(limits[r]), k, self.max_len - len(tokens))
            drafts[r, :n], counts[r] = d[:n], n
            row.fed, row.confirmed = tokens + d[:self.k - 1].tolist(), len(tokens)
        return drafts, counts

    def _reserve(self, row: _Row, num_new: int, keep: set) -> bool:
        """Blocks for num_new tokens after the row's valid prefix, evicting the least recently
        used sequences outside `keep` while they do not fit."""
        while not self.kv.allocate_slots(row.shadow, num_new):
            idle = next((sid for sid in self._rows if sid not in keep), None)
            if idle is None:
                return False
            self.free(idle)
        return True

    def _run(self, batch) -> np.ndarray:
        """Catch-up and K-1 decode steps on the device; int32 [len(batch), K] drafts."""
        runner, blocks = self.runner, lambda row: self.kv.get_block_ids(row.shadow.seq_id)
        if sum(len(t) - s for _, _, t, s in batch) > self.max_tokens:
            self._prefill([(row, s, len(t) - 1) for _, row, t, s in batch])
            batch = [(r, row, t, len(t) - 1) for r, row, t, _ in batch]
        first = runner.dispatch(SchedulerOutput([
            ScheduledSequence(row.shadow, s, len(t) - s, blocks(row), True)
            for _, row, t, s in batch]))
        steps = []
        prev = first
        for _ in range(self.k - 1):  # the decode steps, each fed the last one's tokens
            items = []
            for _, row, _, _ in batch:
                sh = row.shadow
                sh.output_token_ids.append(PENDING)
                items.append(ScheduledSequence(sh, sh.num_tokens - 1, 1, blocks(row), True))
            steps.append(runner.prepare_burst_step(SchedulerOutput(items), prev))
            prev = steps[-1].inflight
        outs = [first] + (runner.dispatch_burst(steps, prev=first) if steps else [])
        tokens = jax.device_get([o.out.token_ids for o in outs])
        return np.stack(tokens, 1)[:len(batch)].astype(np.int32)

    def _prefill(self, spans: list[tuple[_Row, int, int]]) -> None:
        """Feed each row's tokens [start, end) in steps of at most max_tokens tokens that
        sample nothing (a catch-up too large for one step)."""
        items, room = [], self.max_tokens
        for row, pos, end in spans:
            while pos < end:
                n = min(end - pos, room)
                items.append(ScheduledSequence(row.shadow, pos, n,
                                               self.kv.get_block_ids(row.shadow.seq_id), False))
                pos, room = pos + n, room - n
                if room == 0:
                    self.runner.dispatch(SchedulerOutput(items))
                    items, room = [], self.max_tokens
        if items:
            self.runner.dispatch(SchedulerOutput(items))


def _valid_prefix(row: _Row, tokens: list[int]) -> int:
    """How many of the row's fed tokens are still the sequence's, leaving at least its last
    token to feed (the draft must run on it to predict the next)."""
    n = min(len(row.fed), len(tokens) - 1)
    i = min(row.confirmed, n)
    while i < n and row.fed[i] == tokens[i]:
        i += 1
    return i


def build_speculator(config: EngineConfig, target: ModelConfig, runner,
                     num_blocks: int) -> Optional[Speculator]:
    """The engine's speculator for `--speculative-config` (None without it): n-gram lookup on
    the host, or a draft model on the target's first device with a cache no larger than the
    target's (num_blocks), or the target's own MTP layer (paged by the target's blocks).
    `config` is the engine's as started (EngineParts.config: its model
    path resolved)."""
    spec = config.speculative
    if spec is None:
        return None
    proposer = None
    if spec.method == "draft_model":
        proposer = DraftModelProposer(spec, config, target,
                                      devices=list(runner.mesh.devices.flat),
                                      target_num_blocks=num_blocks)
    elif spec.method in MTP_METHODS:
        proposer = MtpProposer(spec, config, target, runner, num_blocks,
                               kv_cache_dtype(config.cache, target.jnp_dtype,
                                              runner.backend.name),
                               executable_dir=None if config.parallel.nnodes > 1
                               else executable_cache_dir())
    return Speculator(spec, target.max_model_len, proposer=proposer)
