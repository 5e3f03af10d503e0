"""The step policy: how many steps are in flight, and what each one dispatched is.

Set once from the config: one step in flight (each read before the next is planned); two with
--async-scheduling (step N+1 is planned and dispatched, taking its input tokens from the
device, before step N is read); N with --pipeline-parallel-size N (the stages work on N
steps holding disjoint sequences). With --num-scheduler-steps K, K decode steps may run as one
program (a burst). The policy plans through the scheduler and dispatches through the runner;
reading a step (the engine's update stage) is the caller's `read`.
"""

from __future__ import annotations

import collections
from typing import Callable


def _last(inflight):
    """The last step of what is in flight (a step, a burst's list of steps, or None)."""
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
