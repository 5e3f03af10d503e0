"""Pipeline parallelism (`--pipeline-parallel-size N`): the engine keeps up to N steps in
flight, so that in steady state stage s works on step k while stage s+1 works on step k-1
(vLLM's virtual engines, with one scheduler).

Steps in flight hold disjoint sequences: the scheduler leaves out a sequence whose sampled
token is not read yet, and gives a step at most 1/N of the unfinished sequences, so N steps
share them (`Scheduler.pipeline_depth`). A step is read back only when N are in flight, or
when nothing else can be scheduled; by then its stages have run behind the newer steps'
earlier stages (jaxllm/worker/pipeline_runner.py). A step never needs a token still in
flight, so penalties, grammars and stop strings see every output token, as on one device.
KV blocks freed or reused while a step is in flight are safe: each stage runs its steps in
dispatch order, so a block's writes and reads on a stage keep the order the scheduler gave.

The stages and their `PipelineRunner` are built by start-up (`build_pipeline_runner` in
jaxllm/engine/startup.py), like any engine's runner: this module only schedules them, so it
imports the engine and start-up never imports it.
"""

from __future__ import annotations

import collections
import time
from typing import Optional

from jaxllm.config import EngineArgs
from jaxllm.engine.engine import LLMEngine
from jaxllm.outputs import RequestOutput


class PipelineEngine(LLMEngine):
    def __init__(self, args: EngineArgs, devices: Optional[list] = None):
        super().__init__(args, devices)
        self.scheduler.pipeline_depth = args.pipeline_parallel_size
        self._pipeline: collections.deque = collections.deque()  # steps in flight, oldest first

    def step(self) -> list[RequestOutput]:
        """Dispatch the next step (if any sequence can run), then read the oldest step once
        N are in flight or nothing new could be dispatched."""
        sched = self.scheduler.schedule()
        if sched.scheduled:
            self._pipeline.append(self.runner.dispatch(sched))
            self.scheduler.advance(sched)
        outputs = []
        if self._pipeline and (len(self._pipeline) >= self.args.pipeline_parallel_size
                               or not sched.scheduled):
            outputs = self._complete(self._pipeline.popleft())
        self._maybe_log_stats(time.monotonic())
        return outputs
