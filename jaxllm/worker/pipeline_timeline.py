"""When each pipeline stage is busy: per-stage dispatch and completion times of its programs,
and from them the fraction of time two or more stages work at once (the overlap the pipeline
exists for).

A watcher thread per stage waits for each stage output in dispatch order (`block_until_ready`
releases the GIL) and notes when it completed. A stage runs its programs one after another
and a program starts once its input is ready, so the program of step k on stage s is taken to
start at max(its dispatch, step k-1's end on stage s, step k's end on stage s-1). That is an
upper bound of the true busy interval (a device idles if the host was late), so the overlap
fraction is measured, not assumed: the stages' programs must really complete interleaved.
Off unless asked for (`PipelineRunner.start_timeline`): the watchers cost a thread wake-up per
stage and step.
"""

from __future__ import annotations

import queue
import threading
import time

import jax


class StageTimeline:
    def __init__(self, num_stages: int):
        self.num_stages = num_stages
        self._queues = [queue.SimpleQueue() for _ in range(num_stages)]
        self._done = [[] for _ in range(num_stages)]  # per stage: (dispatch, end) per step
        self._threads = [threading.Thread(target=self._watch, args=(s,), daemon=True,
                                          name=f"jaxllm-pp-timeline-{s}")
                         for s in range(num_stages)]
        for t in self._threads:
            t.start()

    def dispatched(self, stage: int, output) -> None:
        """Stage `stage` of the next step was launched; `output` is what it produces."""
        self._queues[stage].put((time.perf_counter(), output))

    def record(self, stage: int, dispatch: float, end: float) -> None:
        """Stage `stage`'s next step was dispatched at `dispatch` and completed at `end`
        (perf_counter seconds): what its watcher notes, and how times measured elsewhere (or
        made up, to check the arithmetic) are fed in. After close(), nothing else records."""
        self._done[stage].append((dispatch, end))

    def _watch(self, stage: int) -> None:
        while (item := self._queues[stage].get()) is not None:
            t, out = item
            jax.block_until_ready(out)
            self.record(stage, t, time.perf_counter())

    def close(self) -> dict:
        """Wait for the outputs dispatched so far, stop the watchers, and return `summary()`."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()
        return self.summary()

    def intervals(self) -> list[list[tuple[float, float]]]:
        """Per stage, the (start, end) of each step's program, as the module docstring says."""
        steps = min(len(d) for d in self._done)
        out: list[list[tuple[float, float]]] = [[] for _ in range(self.num_stages)]
        for k in range(steps):
            for s in range(self.num_stages):
                dispatch, end = self._done[s][k]
                start = max(dispatch, out[s][-1][1] if k else dispatch,
                            out[s - 1][k][1] if s else dispatch)
                out[s].append((min(start, end), end))
        return out

    def summary(self) -> dict:
        """steps; busy: each stage's busy fraction of the span from the first start to the last
        end; overlap_fraction: the time two or more stages were busy over the time any was."""
        ivs = self.intervals()
        events = sorted((t, d) for stage in ivs for a, b in stage for t, d in ((a, 1), (b, -1)))
        if not events:
            return {"steps": 0, "busy": [0.0] * self.num_stages, "overlap_fraction": 0.0}
        any_busy = two_busy = 0.0
        depth, last = 0, events[0][0]
        for t, d in events:
            any_busy += (t - last) * (depth >= 1)
            two_busy += (t - last) * (depth >= 2)
            depth, last = depth + d, t
        span = events[-1][0] - events[0][0]
        busy = [sum(b - a for a, b in stage) / span if span else 0.0 for stage in ivs]
        return {"steps": len(ivs[0]), "busy": busy,
                "overlap_fraction": two_busy / any_busy if any_busy else 0.0}
