"""Continuous batching as in vLLM V1: each step spends one token budget, running requests first
(decodes and unfinished prompt chunks), then admits waiting ones. When KV blocks run out, a
running request is preempted by recompute: its blocks are freed and it rejoins the waiting queue
at the front with its outputs kept, to be recomputed (often from the prefix cache) as its prompt.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field
from typing import Iterable

from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.request import PENDING, Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    request: Request
    start: int        # num_computed_tokens before this step: the position of the first token
    num_tokens: int
    block_ids: list[int]  # the KV manager's live block table, valid for this step
    sample: bool      # the step reaches the last known token, so its next token is sampled
    out_index: int = -1  # where advance() put the PENDING placeholder of the sampled token


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs", block_size: int):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        if block_size != kv_cache_manager.block_size:
            raise ValueError(f"block_size {block_size} differs from the KV cache's "
                             f"{kv_cache_manager.block_size}")
        # Both limits below guarantee that a lone request can always make progress.
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
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.running: list[Request] = []        # in admission order
        self.waiting: list[tuple] = []          # heap of (key, request)
        self._order = 0
        self.num_preemptions = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, req: Request) -> None:
        if not 0 < req.num_tokens <= self.max_model_len:
            raise ValueError(f"request {req.request_id!r} has {req.num_tokens} tokens; "
                             f"need 1 to max_model_len={self.max_model_len}")
        self.requests[req.request_id] = req
        self._enqueue(req)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus,
                        drop_pending: bool = True) -> None:
        """Finish requests from outside (abort, or a stop string seen by the detokenizer); their
        blocks are freed at once, and a token still in flight is dropped unless drop_pending
        is False. Unknown or already finished ids are ignored."""
        done = [self.requests.pop(rid) for rid in request_ids if rid in self.requests]
        for req in done:
            req.status = status
            self.kv.free(req)
            while drop_pending and req.output_token_ids and req.output_token_ids[-1] == PENDING:
                req.output_token_ids.pop()
        if done:
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = [w for w in self.waiting if not w[1].is_finished]
            heapq.heapify(self.waiting)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[str] = []
        for req in list(self.running):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self._preempt()
                preempted.append(victim.request_id)
                if victim.request_id in scheduled:  # possible with the priority policy
                    budget += scheduled.pop(victim.request_id).num_tokens
                if victim is req:  # nothing ranks below it; others may still fit
                    break
            if req.status == RequestStatus.RUNNING:
                scheduled[req.request_id] = self._scheduled(req, n)
                budget -= n
        # As vLLM: admit nobody in a step that had to preempt, or the victim would bounce back.
        while not preempted and self.waiting and budget and len(self.running) < self.max_num_seqs:
            req = self.waiting[0][1]
            blocks, num_cached = self.kv.get_computed_blocks(req)
            n = req.num_tokens - num_cached
            if n > budget and not self.chunked_prefill:
                break  # keep the queue order: it will fit in a later step
            n = min(n, budget)
            if not self.kv.allocate_slots(req, n, blocks):
                break
            heapq.heappop(self.waiting)
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = self._scheduled(req, n)
            budget -= n
        return SchedulerOutput(list(scheduled.values()), preempted)

    def advance(self, sched: SchedulerOutput) -> None:
        """Move every scheduled request past its dispatched step, before its sampled tokens
        are known: each sampling request gets a PENDING placeholder (so the next schedule()
        counts it), and requests reaching max_tokens or max_model_len finish now."""
        for s in sched.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING:  # finished from outside since schedule()
                continue
            req.num_computed_tokens += s.num_tokens
            self.kv.cache_blocks(req)
            if s.sample:
                s.out_index = len(req.output_token_ids)
                req.output_token_ids.append(PENDING)
                sp = req.sampling_params
                if (sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens) \
                        or req.num_tokens >= self.max_model_len:
                    self.finish_requests([req.request_id], RequestStatus.FINISHED_LENGTH,
                                         drop_pending=False)  # its last token is in flight

    def resolve(self, sched: SchedulerOutput, sampled: dict[str, int]) -> set[str]:
        """Put the sampled tokens of an advanced step in place of their placeholders and apply
        the token stops (EOS, stop_token_ids, once min_tokens are out). Returns the ids whose
        token was kept: not those finished from outside meanwhile (their placeholder is gone)."""
        kept = set()
        for s in sched.scheduled:
            req, i = s.request, s.out_index
            if i < 0 or i >= len(req.output_token_ids) or req.output_token_ids[i] != PENDING:
                continue
            token = req.output_token_ids[i] = sampled[req.request_id]
            kept.add(req.request_id)
            sp = req.sampling_params
            if req.is_finished or i + 1 < sp.min_tokens:
                continue
            if not sp.ignore_eos and token in req.eos_token_ids:
                self._finish(req, RequestStatus.FINISHED_STOPPED)
            elif token in sp.stop_token_ids:
                req.stop_reason = token
                self._finish(req, RequestStatus.FINISHED_STOPPED)
        return kept

    def update_from_output(self, sched: SchedulerOutput, sampled: dict[str, int]) -> set[str]:
        """advance() and resolve() at once, for a step whose tokens are already known."""
        self.advance(sched)
        return self.resolve(sched, sampled)

    # --- helpers -------------------------------------------------------------------------------
    def _enqueue(self, req: Request, front: bool = False) -> None:
        """fcfs: arrival order, with preempted requests at the front. priority: (priority,
        arrival_time), so a preempted request goes back ahead of later arrivals of its class."""
        self._order += 1
        order = -self._order if front else self._order
        key = (req.priority, req.arrival_time, order) if self.policy == "priority" else (order,)
        heapq.heappush(self.waiting, (key, req))

    def _preempt(self) -> Request:
        """Preempt the last-admitted running request (fcfs) or the lowest-priority one, latest
        arrival first (priority). Warns on the first preemption and every 50th, as vLLM V0."""
        if self.policy == "priority":
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
        else:
            victim = self.running[-1]
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self._enqueue(victim, front=True)
        self.num_preemptions += 1
        if self.num_preemptions % 50 == 1:
            logger.warning(
                "Request %s was preempted (recomputed later) because the KV cache is full; "
                "total preemptions: %d. Raise the KV cache size or lower --max-num-seqs or "
                "--max-num-batched-tokens.", victim.request_id, self.num_preemptions)
        return victim

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(req, start, n, self.kv.get_block_ids(req.request_id),
                                sample=start + n == req.num_tokens)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Finish on a token stop; the step after, if already dispatched, loses its token."""
        self.finish_requests([req.request_id], status)
