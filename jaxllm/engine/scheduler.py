"""Continuous batching as in vLLM V1: each step spends one token budget, running sequences first
(decodes and unfinished prompt chunks), then admits waiting ones. When KV blocks run out, a
running sequence is preempted by recompute: its blocks are freed and it rejoins the waiting queue
at the front with its outputs kept, to be recomputed (often from the prefix cache) as its prompt.

Below the scheduler, the step policy (`StepPolicy`): how many steps are in flight, and what each
one dispatched is. Set once from the config: one step in flight (each read before the next is
planned); two with --async-scheduling (step N+1 is planned and dispatched, taking its input
tokens from the device, before step N is read); N with --pipeline-parallel-size N (the stages
work on N steps holding disjoint sequences). With --num-scheduler-steps K, K decode steps may
run as one program (a burst). The policy plans through the scheduler and dispatches through the
runner; reading a step (the engine's update stage) is the caller's `read`.
"""

from __future__ import annotations

import collections
import heapq
import logging
from typing import Callable, Iterable, Optional

from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.models.vision_spec import bidirectional_images
from jaxllm.sequence import (PENDING, ScheduledSequence, SchedulerOutput, Sequence,
                             SequenceStatus, Stop)

logger = logging.getLogger(__name__)


class Scheduler:
    @classmethod
    def from_config(cls, config, kv_cache_manager: KVCacheManager, model_config,
                    max_num_batched_tokens: int, lora_slots=None) -> "Scheduler":
        sc = config.scheduler  # the EngineConfig's; the token budget is the runner's
        return cls(kv_cache_manager, max_num_seqs=sc.max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens,
                   max_model_len=model_config.max_model_len,
                   enable_chunked_prefill=sc.enable_chunked_prefill, policy=sc.policy,
                   block_size=config.cache.block_size,
                   pipeline_depth=config.parallel.pipeline_parallel_size,
                   lora_slots=lora_slots, whole_images=bidirectional_images(model_config))

    def __init__(self, kv_cache_manager: KVCacheManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs", block_size: int,
                 pipeline_depth: int = 1, lora_slots=None, whole_images: bool = False):
        """lora_slots: the engine's LoRA adapter slots (jaxllm/engine/lora_slots.py) when
        LoRA is on: a sequence runs only while its adapter holds a slot. whole_images: a
        prompt chunk never ends inside an image's tokens (they attend to each other: Gemma 3),
        so an image's tokens are computed in one step, as vLLM keeps them (the input processor
        refuses larger ones)."""
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        if block_size != kv_cache_manager.block_size:
            raise ValueError(f"block_size {block_size} differs from the KV cache's "
                             f"{kv_cache_manager.block_size}")
        # Both limits below guarantee that a lone sequence can always make progress.
        if kv_cache_manager.num_blocks * block_size < max_model_len:
            raise ValueError(f"the KV cache holds {kv_cache_manager.num_blocks * block_size} "
                             f"tokens, fewer than max_model_len={max_model_len}")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(f"without chunked prefill, max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be at least max_model_len "
                             f"({max_model_len}) to fit any prompt in one step")
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence, by id
        self.running: list[Sequence] = []    # in admission order
        self.waiting: list[tuple] = []          # heap of (key, sequence)
        self._order = 0
        self.num_preemptions = 0
        # Pipeline parallelism keeps this many steps in flight (the step policy): above 1, a
        # step leaves out sequences whose sampled token is in flight (the steps in flight hold
        # disjoint sequences) and takes at most 1/depth of them all, so penalties, grammars
        # and stop strings see every output token, as on one device.
        self.pipeline_depth = pipeline_depth
        self.lora_slots = lora_slots
        self.whole_images = whole_images
        self._lora_holders: set[str] = set()  # running sequences holding an adapter slot

    num_running = property(lambda self: len(self.running))
    num_waiting = property(lambda self: len(self.waiting))

    def waiting_seqs(self) -> list[Sequence]:
        """The waiting sequences, in no particular order."""
        return [seq for _, seq in self.waiting]

    def has_unfinished_seqs(self) -> bool:
        return bool(self.seqs)

    def add_seq(self, seq: Sequence) -> None:
        if not 0 < seq.num_tokens <= self.max_model_len:
            raise ValueError(f"sequence {seq.seq_id!r} has {seq.num_tokens} tokens; "
                             f"need 1 to max_model_len={self.max_model_len}")
        self.seqs[seq.seq_id] = seq
        self._enqueue(seq)

    def abort_seqs(self, seq_ids: Iterable[str]) -> None:
        self.finish_seqs(seq_ids, SequenceStatus.FINISHED_ABORTED)

    def finish_seqs(self, seq_ids: Iterable[str], status: SequenceStatus,
                        drop_pending: bool = True) -> None:
        """Finish sequences from outside (abort, or a stop string seen by the detokenizer); their
        blocks are freed at once, and a token still in flight is dropped unless drop_pending
        is False. Unknown or already finished ids are ignored."""
        done = [self.seqs.pop(rid) for rid in seq_ids if rid in self.seqs]
        for seq in done:
            seq.status = status
            self.kv.free(seq)
            self._release_lora(seq)
            while drop_pending and seq.output_token_ids and seq.output_token_ids[-1] == PENDING:
                seq.output_token_ids.pop()
        if done:
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = [w for w in self.waiting if not w[1].is_finished]
            heapq.heapify(self.waiting)

    def apply_stops(self, stops: Iterable[Stop]) -> None:
        """End sequences on what the output processor found in their tokens (stop strings,
        grammar ends): stop_reason set, output tokens after a stop inside accepted drafts
        dropped, and the sequence finished (one already finished by a later token of its
        step takes the stop's status when the stop overrides)."""
        for stop in stops:
            seq = stop.seq
            seq.stop_reason = stop.reason
            del seq.output_token_ids[stop.drop_from:stop.drop_to]
            if not seq.is_finished:
                self.finish_seqs([seq.seq_id], stop.status)
            elif stop.override:
                seq.status = stop.status

    def can_burst(self, num_steps: int) -> bool:
        """Whether the next num_steps steps can be scheduled as one burst of decode steps
        with the same sequences: nobody waits, every running sequence decodes (one new token
        a step) with no length stop before the last step, and the KV cache has their blocks.
        (The runner decides whether their sampling allows it: ModelRunner.burst_ready.)"""
        if (num_steps == 1 or self.waiting or not self.running
                or len(self.running) > self.max_num_batched_tokens):
            return False
        need, bs = 0, self.kv.block_size
        for r in self.running:
            sp = r.sampling_params
            left = min(self.max_model_len - r.num_tokens,
                       sp.max_tokens - r.num_output_tokens if sp.max_tokens else num_steps)
            if r.num_tokens - r.num_computed_tokens != 1 or left < num_steps:
                return False
            need += (-(-(r.num_computed_tokens + num_steps) // bs)
                     - len(self.kv.get_block_ids(r.seq_id)))
        return need <= self.kv.num_free_blocks

    def schedule(self, drafts: Optional[dict[str, list[int]]] = None) -> SchedulerOutput:
        """drafts: speculative tokens of running decode sequences, computed after their last
        token where the budget and free KV blocks allow (the budget may cut them short; they
        never cause a preemption)."""
        drafts = drafts or {}
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledSequence] = {}
        preempted: list[str] = []
        cap = -(-len(self.seqs) // self.pipeline_depth)  # sequences in this step, at most
        for seq in list(self.running):
            if budget == 0 or len(scheduled) >= cap:
                break
            if seq.status != SequenceStatus.RUNNING or self._in_flight(seq):
                continue  # preempted earlier in this loop, or its token is not back yet
            spec = drafts.get(seq.seq_id, ())
            n = self._image_cut(seq, seq.num_computed_tokens,
                                min(seq.num_tokens - seq.num_computed_tokens, budget))
            if n == 0:
                continue  # the next image does not fit this step's budget
            if spec and n < budget and self.kv.allocate_slots(seq, min(n + len(spec), budget)):
                n = min(n + len(spec), budget)  # drafts only take free blocks: never preempt
            while not self.kv.allocate_slots(seq, n):
                victim = self._preempt()
                preempted.append(victim.seq_id)
                if victim.seq_id in scheduled:  # possible with the priority policy
                    budget += scheduled.pop(victim.seq_id).num_tokens
                if victim is seq:  # nothing ranks below it; others may still fit
                    break
            if seq.status == SequenceStatus.RUNNING:
                scheduled[seq.seq_id] = self._scheduled(seq, n, spec)
                budget -= n
        # As vLLM: admit nobody in a step that had to preempt, or the victim would bounce back.
        no_slot = []  # waiting sequences passed over: their adapter found no free slot
        while (not preempted and self.waiting and budget and len(scheduled) < cap
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0][1]
            if self._in_flight(seq):
                break  # preempted with its token in flight: it comes back first
            if not self._has_lora_slot(seq):
                no_slot.append(heapq.heappop(self.waiting))  # as vLLM: later ones may run
                continue
            blocks, num_cached = self.kv.get_computed_blocks(seq)
            n = seq.num_tokens - num_cached
            if n > budget and not self.chunked_prefill:
                break  # keep the queue order: it will fit in a later step
            n = self._image_cut(seq, num_cached, min(n, budget))
            if n == 0 or not self.kv.allocate_slots(seq, n, blocks):
                break
            heapq.heappop(self.waiting)
            self._take_lora(seq)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq.seq_id] = self._scheduled(seq, n)
            budget -= n
        for item in no_slot:
            heapq.heappush(self.waiting, item)
        return SchedulerOutput(list(scheduled.values()), preempted, self.kv.take_transfers())

    def _image_cut(self, seq: Sequence, start: int, n: int) -> int:
        if not self.whole_images or seq.mm is None:
            return n
        return image_chunk_cut(seq.mm.starts, seq.mm.num_tokens, start, n)

    def advance(self, sched: SchedulerOutput) -> None:
        """Move every scheduled sequence past its dispatched step, before its sampled tokens
        are known: each sampling sequence gets a PENDING placeholder (so the next schedule()
        counts it), and sequences reaching max_tokens or max_model_len finish now."""
        for s in sched.scheduled:
            seq = s.seq
            if seq.status != SequenceStatus.RUNNING:  # finished from outside since schedule()
                continue
            seq.num_computed_tokens += s.num_tokens - len(s.spec_token_ids)  # drafts: resolve
            self.kv.cache_blocks(seq)
            if s.sample:
                s.out_index = len(seq.output_token_ids)
                seq.output_token_ids.append(PENDING)
                sp = seq.sampling_params
                if (sp.max_tokens is not None and seq.num_output_tokens >= sp.max_tokens) \
                        or seq.num_tokens >= self.max_model_len:
                    self.finish_seqs([seq.seq_id], SequenceStatus.FINISHED_LENGTH,
                                         drop_pending=False)  # its last token is in flight

    def resolve(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> dict[str, int]:
        """Put the tokens of an advanced step in place of their placeholders (a speculating
        sequence emits its accepted drafts and one more: several tokens) and apply the stops:
        EOS, stop_token_ids (once min_tokens are out), max_tokens and max_model_len; no token
        after a stop is kept. The accepted drafts' KV now counts as computed (and cacheable).
        Returns {seq_id: tokens kept}, without those finished from outside meanwhile (their
        placeholder is gone)."""
        kept = {}
        for s in sched.scheduled:
            seq, i = s.seq, s.out_index
            if i < 0 or i >= len(seq.output_token_ids) or seq.output_token_ids[i] != PENDING:
                continue
            tokens = sampled[seq.seq_id]
            seq.output_token_ids[i] = tokens[0]
            n = 1
            while not self._stops(seq, i + n - 1) and n < len(tokens):
                seq.output_token_ids.insert(i + n, tokens[n])  # later placeholders stay after
                n += 1
            kept[seq.seq_id] = n
            if not seq.is_finished and n > 1:
                seq.num_computed_tokens += n - 1  # the accepted drafts' KV is the tokens'
                self.kv.cache_blocks(seq)
        return kept

    def _stops(self, seq: Sequence, i: int) -> bool:
        """Whether output token i (just placed) ends the sequence; finishes it if so."""
        if seq.is_finished:  # on length at advance(), or from outside
            return True
        sp, token = seq.sampling_params, seq.output_token_ids[i]
        if i + 1 >= sp.min_tokens:
            if not sp.ignore_eos and token in seq.eos_token_ids:
                self._finish(seq, SequenceStatus.FINISHED_STOPPED)
            elif token in sp.stop_token_ids:
                seq.stop_reason = token
                self._finish(seq, SequenceStatus.FINISHED_STOPPED)
        if not seq.is_finished and ((sp.max_tokens is not None and i + 1 >= sp.max_tokens)
                                    or seq.num_prompt_tokens + i + 1 >= self.max_model_len):
            self._finish(seq, SequenceStatus.FINISHED_LENGTH)
        return seq.is_finished

    def update_from_output(self, sched: SchedulerOutput,
                           sampled: dict[str, list[int]]) -> dict[str, int]:
        """advance() and resolve() at once, for a step whose tokens are already known."""
        self.advance(sched)
        return self.resolve(sched, sampled)

    # --- helpers -------------------------------------------------------------------------------
    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        """fcfs: arrival order, with preempted sequences at the front. priority: (priority,
        arrival_time), so a preempted sequence goes back ahead of later arrivals of its class."""
        self._order += 1
        order = -self._order if front else self._order
        key = (seq.priority, seq.arrival_time, order) if self.policy == "priority" else (order,)
        heapq.heappush(self.waiting, (key, seq))

    def _in_flight(self, seq: Sequence) -> bool:
        return (self.pipeline_depth > 1 and bool(seq.output_token_ids)
                and seq.output_token_ids[-1] == PENDING)

    def preempt_all(self) -> None:
        """Preempt every running sequence, last admitted first, so the waiting queue keeps
        their order: sleep mode's 'keep' (recomputed once the engine wakes)."""
        while self.running:
            self._preempt(self.running[-1])

    def _preempt(self, victim: Optional[Sequence] = None) -> Sequence:
        """Preempt `victim`, or (the KV cache full) the last-admitted running sequence (fcfs)
        or the lowest-priority one, latest arrival first (priority), warning on the first such
        preemption and every 50th, as vLLM V0."""
        full = victim is None
        if full:
            victim = (max(self.running, key=lambda r: (r.priority, r.arrival_time))
                      if self.policy == "priority" else self.running[-1])
        self.running.remove(victim)
        self.kv.free(victim)
        self._release_lora(victim)
        victim.status = SequenceStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self._enqueue(victim, front=True)
        self.num_preemptions += 1
        if full and self.num_preemptions % 50 == 1:
            logger.warning(
                "Sequence %s was preempted (recomputed later) because the KV cache is full; "
                "total preemptions: %d. Raise the KV cache size or lower --max-num-seqs or "
                "--max-num-batched-tokens.", victim.seq_id, self.num_preemptions)
        return victim

    def _scheduled(self, seq: Sequence, n: int, drafts=()) -> ScheduledSequence:
        start = seq.num_computed_tokens
        num_spec = max(0, start + n - seq.num_tokens)
        slot = (-1 if seq.lora_request is None or self.lora_slots is None
                else self.lora_slots.slot(seq.lora_request))
        return ScheduledSequence(seq, start, n, self.kv.get_block_ids(seq.seq_id),
                                 sample=start + n >= seq.num_tokens,
                                 spec_token_ids=list(drafts[:num_spec]), lora_slot=slot,
                                 state_slot=self.kv.state_slot(seq.seq_id))

    # --- LoRA adapter slots ----------------------------------------------------------------------
    def _has_lora_slot(self, seq: Sequence) -> bool:
        """Whether a waiting sequence's adapter is in a slot, or could be put in one (then
        `_take_lora` does, once the sequence is admitted)."""
        if seq.lora_request is None:
            return True
        if self.lora_slots is None:
            raise ValueError(f"sequence {seq.seq_id!r} has a LoRA adapter and LoRA is off")
        return self.lora_slots.can_acquire(seq.lora_request)

    def _take_lora(self, seq: Sequence) -> None:
        if seq.lora_request is not None:
            self.lora_slots.acquire(seq.lora_request)
            self._lora_holders.add(seq.seq_id)

    def _release_lora(self, seq: Sequence) -> None:
        if seq.seq_id in self._lora_holders:
            self._lora_holders.discard(seq.seq_id)
            self.lora_slots.release(seq.lora_request)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Finish on a token stop; the step after, if already dispatched, loses its token."""
        self.finish_seqs([seq.seq_id], status)


def image_chunk_cut(starts, lengths, start: int, n: int) -> int:
    """How much of the chunk [start, start + n) to schedule when images (at `starts`, of
    `lengths` tokens) must be prefilled whole: cut short before an image it would end inside
    of (0: it starts inside the image and n cannot finish it)."""
    for s, k in zip(starts, lengths):
        if s < start + n < s + k:
            return max(0, s - start)
    return n


# --- the step policy ---------------------------------------------------------------------------

def _last(inflight):  # the last step of what is in flight: a step, a burst's list, or None
    return inflight[-1] if isinstance(inflight, list) else inflight


class StepPolicy:
    def __init__(self, scheduler, runner, speculator, *, pipeline_depth: int,
                 async_scheduling: bool, burst_steps: int):
        self._scheduler, self._runner, self._speculator = scheduler, runner, speculator
        self._depth = pipeline_depth if pipeline_depth > 1 else 2 if async_scheduling else 1
        # Whether a step takes its input tokens from the one before it on the device.
        self._chain = pipeline_depth == 1 and async_scheduling
        self._burst_steps = burst_steps
        self._inflight: collections.deque = collections.deque()  # oldest first

    @classmethod
    def from_config(cls, config, scheduler, runner, speculator) -> "StepPolicy":
        return cls(scheduler, runner, speculator,
                   pipeline_depth=config.parallel.pipeline_parallel_size,
                   async_scheduling=config.scheduler.async_scheduling,
                   burst_steps=config.scheduler.num_scheduler_steps)

    def step(self, read: Callable[[object], list]) -> list:
        """Plan and dispatch one step (or a burst), then read the oldest step in flight once
        the depth is reached or nothing new was dispatched; what `read` returned for the
        steps read."""
        outputs: list = []
        inflight, sched = self._inflight, self._scheduler
        if inflight and self._chain and not self._can_overlap():
            outputs += read(inflight.popleft())  # sampling needs its tokens
        prev = _last(inflight[-1]) if self._chain and inflight else None
        if sched.can_burst(self._burst_steps) and self._runner.burst_ready(
                sched.running, self._burst_steps):
            cur = self._dispatch_burst(prev)
        else:
            drafts = (self._speculator.propose(sched.running)
                      if self._speculator is not None else None)
            plan = sched.schedule(drafts)
            cur = self._runner.dispatch(plan, prev) if plan.scheduled else None
            if cur is not None:
                sched.advance(plan)
        if cur is not None:
            inflight.append(cur)
        if inflight and (len(inflight) >= self._depth or cur is None):
            outputs += read(inflight.popleft())
        return outputs

    def drain(self, read: Callable[[object], list]) -> list:
        """Read every step still in flight, oldest first."""
        outputs: list = []
        while self._inflight:
            outputs += read(self._inflight.popleft())
        return outputs

    def _dispatch_burst(self, prev) -> list:
        """num_scheduler_steps decode steps in one program: each is planned and advanced on
        the host as usual (its input token is the step before's, still on the device; step
        0's is prev's), then all are dispatched. Their tokens are resolved in order when read
        (tokens after a stop are dropped)."""
        steps = []
        for _ in range(self._burst_steps):
            plan = self._scheduler.schedule()
            steps.append(self._runner.prepare_burst_step(
                plan, steps[-1].inflight if steps else prev))
            self._scheduler.advance(plan)
        return self._runner.dispatch_burst(steps, prev)

    def _can_overlap(self) -> bool:
        """The next step's sampling may not read output tokens still in flight, nor may its
        drafts be proposed without them (a step that may speculate reads them first), nor
        may a step follow one with drafts before it is known how many were accepted."""
        running = self._scheduler.running
        if self._speculator is not None and (
                any(s.spec_token_ids for s in _last(self._inflight[-1]).sched.scheduled)
                or self._speculator.wants_tokens(running)):
            return False
        return not any(r.sampling_params.needs_output_history for r in running)
