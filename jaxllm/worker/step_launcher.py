"""The step launcher: launches a step program here, on the other hosts too (multi-host rank 0),
or as placeholders when the program's devices are all another host's.

The compile manager (jaxllm/worker/compile_manager.py) only compiles and caches; where a call
runs is decided here, in one place, for the runner that owns this launcher:

- Multi-host rank 0 (`lead_hosts`): every call, compiled program or plain transfer, is first
  sent down the step channel (jaxllm/parallel/step_channel.py), so the followers run the
  same calls in the same order, then its outputs are numbered as they number theirs.
- A pipeline stage on another host's devices (`elsewhere`, the pipeline runner's rule): this
  process never compiles or runs its program; the call returns arrays with the outputs'
  shardings and no local shards, which the next call (a transfer to the next stage) passes
  on.
- Results read on rank 0 (`to_reader`): moved there when read, if their program ran on
  another host (`reader`, the pipeline runner's transfer).

A follower (jaxllm/deploy/follower.py) has a launcher without a leader: it runs what rank 0
sends it through `run` and `call` like any step.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional

import jax

from jaxllm.parallel.mesh import absent_array
from jaxllm.worker.compile_manager import CompileManager, Job, ProgramKey


class StepLauncher:
    def __init__(self, compile_manager: CompileManager, *,
                 elsewhere: Optional[Callable[[ProgramKey], bool]] = None,
                 reader: Optional[Callable[[Any], Any]] = None):
        """elsewhere(key): whether key's program runs on another host's devices only (default:
        none does). reader(tree): a step's results moved onto rank 0's devices (default:
        they are there)."""
        self.compile_manager = compile_manager
        self._elsewhere = elsewhere or (lambda key: False)
        self._reader = reader
        self._leader = None
        self._absent_shapes: dict[ProgramKey, Any] = {}

    @property
    def step_leader(self):
        """Rank 0's end of the step channel (None: one host, or a follower)."""
        return self._leader

    def lead_hosts(self, leader) -> None:
        """Multi-host rank 0: send every call to the other hosts from now on (a StepLeader:
        send(key, args), track(outputs))."""
        self._leader = leader

    def runs_here(self, key: ProgramKey) -> bool:
        """Whether this process compiles and runs key's program (warm-up skips the others)."""
        return not self._elsewhere(key)

    def here(self, jobs: Iterable[Job]) -> Iterator[Job]:
        """The compile jobs whose programs run on this process's devices."""
        return (job for job in jobs if self.runs_here(job[0]))

    # --- launching --------------------------------------------------------------------------
    def run(self, key: ProgramKey, fn, *args, first_use: bool = False):
        """Launch key's compiled program on args (first_use: see CompileManager.run)."""
        return self.call(key, lambda *a: self._run_here(key, fn, a, first_use), *args)

    def call(self, key: ProgramKey, fn, *args):
        """fn(*args), as one step-program call: rank 0 of several hosts sends it to the others
        first (a transfer between pipeline stages' devices goes this way, uncompiled)."""
        if self._leader is None:
            return fn(*args)
        self._leader.send(key, args)
        out = fn(*args)
        self._leader.track(out)
        return out

    def to_reader(self, tree):
        """A step's results where rank 0 reads them: moved when it reads them (a pipeline's
        last stage may be on another host; moving them at dispatch would make rank 0 wait
        there for that host); on one host, or a local last stage, they are already."""
        if self._reader is None:
            return tree
        return self.call(ProgramKey("to_reader"), self._reader, tree)

    def _run_here(self, key: ProgramKey, fn, args: tuple, first_use: bool):
        if self._elsewhere(key):
            return self._absent_outputs(key, fn, args)
        return self.compile_manager.run(key, fn, *args, first_use=first_use)

    def _absent_outputs(self, key: ProgramKey, fn, args: tuple):
        """fn's outputs as arrays with their shardings and no local shards (its shapes are
        traced once per key)."""
        shapes = self._absent_shapes.get(key)
        if shapes is None:
            shapes = self._absent_shapes[key] = jax.eval_shape(fn, *args)
        return jax.tree.map(lambda s: absent_array(s.shape, s.dtype, s.sharding), shapes)
