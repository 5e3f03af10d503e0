"""The compile manager: which step programs exist, and when each is compiled.

Programs are named by `ProgramKey`. Warm-up compiles the programs every engine serves with on
all cores before the engine is ready (`compile_now`); others are deferred (`defer`) and compiled
one by one in a background thread after warm-up, or on demand (`ready`, for the engine's
optional multi-step programs, which it skips while they compile). A step needing a program
that is not compiled yet compiles it or waits for the compile under way (`run`); a shape
outside every known program is compiled too, but counted and logged as a recompile, and raised
when JAXLLM_FAIL_ON_RECOMPILE=1 (the tests set it). Compiled programs are saved to and loaded
from the executable cache (jaxllm/worker/executable_cache.py) when one is given; a program the
cache holds is loaded when a step first runs it, not at warm-up: deserializing one costs about
as much as a step, and a short run uses a few of the two dozen programs.

Below it, the step launcher (`StepLauncher`): it launches a step program here, on the other
hosts too (multi-host rank 0), or as placeholders when the program's devices are all another
host's. The compile manager only compiles and caches; where a call runs is decided by the
launcher, in one place, for the runner that owns it:

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

import atexit
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional

import jax

from tqdm.auto import tqdm

from jaxllm.parallel.mesh import absent_array
from jaxllm.worker.executable_cache import ExecutableCache, compile_lowered, mlir_lock

logger = logging.getLogger("jaxllm")


class ProgramKey(NamedTuple):
    """Names one compiled program. kind: 'forward' (one model step over T tokens), 'sample'
    (the sampler), 'prompt_logprobs' (over a step's T hidden states) or 'burst' (`steps`
    decode steps of `tokens` rows, forward and sampler, in one program). The step launcher also
    sends uncompiled calls under a key: a pipeline's transfers ('to_stage', 'to_reader') and
    LoRA slot writes ('lora_write', ModelRunner.write_lora_slot)."""
    kind: str
    tokens: int = 0            # T (forward, prompt_logprobs, burst)
    decode_only: bool = False  # forward: the decode-only attention tiling
    steps: int = 1             # burst: steps per call
    sampler: Any = None        # sample, burst: the SamplingTensors tree structure (its variant)
    stage: int = 0             # forward: the pipeline stage (jaxllm/worker/pipeline_runner.py)


# (key, function, example arguments): what to compile.
Job = tuple[ProgramKey, Callable, tuple]


class CompileManager:
    def __init__(self, *, enforce_eager: bool = False,
                 executable_cache: Optional[ExecutableCache] = None):
        self.enforce_eager = enforce_eager
        self._cache = executable_cache
        self._executables: dict[ProgramKey, Any] = {}
        self._futures: dict[ProgramKey, Future] = {}  # every program compiled in the background
        self._unclaimed: dict[ProgramKey, tuple] = {}  # deferred (fn, args) nobody started yet
        self._deferred: list[ProgramKey] = []
        # In the executable cache, not loaded yet: (cache key, fn, args).
        self._on_disk: dict[ProgramKey, tuple[str, Callable, tuple]] = {}
        self._lock = threading.Lock()
        self._on_demand = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxllm-compile")
        self.num_recompiles = 0
        self.programs_from_cache = 0  # executables loaded from the cache (not traced)

    # --- what exists ------------------------------------------------------------------------
    def programs(self) -> list[ProgramKey]:
        """The programs ready to run: compiled, or in the executable cache."""
        return [*self._executables, *self._on_disk]

    def deferred(self) -> list[ProgramKey]:
        """The programs warm-up left to the background thread, in compile order."""
        return list(self._deferred)

    def pending(self) -> list[ProgramKey]:
        """Programs being compiled (or queued) in the background, not finished yet."""
        return [k for k, f in list(self._futures.items()) if not f.done()]

    def wait_for_background_compiles(self, load_cached: bool = False) -> Optional[float]:
        """Block until the deferred programs and those asked for on demand so far are compiled
        (a server is ready, and benchmarks time the steady state, only then); a failure is
        raised where the program is used. load_cached: also load now the programs left to
        their first use in the executable cache (a benchmark's steps then load nothing).
        The seconds waited for compiles, or None when none was pending."""
        t, pending = time.perf_counter(), len(self.pending())
        if pending:
            logger.info("Waiting for the %d programs compiling in the background before "
                        "serving", pending)
        for future in list(self._futures.values()):
            future.exception()
        waited = time.perf_counter() - t if pending else None
        if pending:
            logger.info("Compiled them in %.1f s", waited)
        if load_cached:
            for key in list(self._on_disk):
                self._load(key)
        return waited

    # --- running ----------------------------------------------------------------------------
    def run(self, key: ProgramKey, fn, *args, first_use: bool = False):
        """Call the executable compiled for key; first_use marks programs compiled when first
        needed rather than at warm-up, which is not a recompile. (Where a call runs, on
        other hosts too or not here at all, is the launcher's: `StepLauncher`, below.)"""
        if self.enforce_eager:
            return fn(*args)
        exe = self._executables.get(key)
        if exe is None and key in self._on_disk:
            exe = self._load(key)
        if exe is None and key in self._futures:
            exe = self._claim(key, load=True)
        if exe is None and first_use:
            logger.info("compiling %s on first use", key)
            exe = self._executables[key] = self.compile(key, fn, args)
        elif exe is None:
            self.num_recompiles += 1
            msg = f"compiling {key.kind} T={key.tokens} after warm-up (a shape outside the buckets)"
            if os.environ.get("JAXLLM_FAIL_ON_RECOMPILE") == "1":
                raise RuntimeError(msg)
            logger.warning(msg)
            exe = self._executables[key] = self.compile(key, fn, args)
        return exe(*args)

    def ready(self, key: ProgramKey, fn, make_args: Callable[[], tuple]) -> bool:
        """Whether key is compiled; if not, its compile starts in the background (the caller
        runs something else meanwhile) and False is returned."""
        if key in self._executables:
            return True
        if key in self._on_disk:
            self._load(key)
            return True
        future = self._futures.get(key)
        if future is None:
            args = make_args()
            exe = self._cached(key, args)[1]  # loaded here: only compiles go to the thread
            if exe is not None:
                self._executables[key] = exe
                return True
            self._futures[key] = self._on_demand.submit(self._compile_and_keep, key, fn, args,
                                                         load=False)
            return False
        if not future.done():
            return False
        self._executables[key] = future.result()  # a failed compile raises here
        return True

    # --- compiling --------------------------------------------------------------------------
    def compile(self, key: ProgramKey, fn, args, load: bool = True):
        """The executable of fn(*args): from the executable cache (unless not `load`), else
        compiled (and cached)."""
        cache_key, exe = self._cached(key, args, load)
        if exe is not None:
            return exe
        with mlir_lock:
            lowered = fn.lower(*args)
        return self._compile_lowered(cache_key, lowered)

    def compile_now(self, jobs: Iterable[Job], total: int) -> None:
        """Compile jobs on all cores. Lowering (Python, this thread) feeds the compiler threads
        as it goes, so a cold start compiles while the remaining programs are still being
        traced; a warm start finds them in the executable cache without tracing (and loads
        each when a step first runs it)."""
        bar = tqdm(total=total, desc="Compiling buckets", unit="shape", leave=False,
                   disable=None)  # on a terminal only: in a log a bar is noise

        def compile_one(cache_key, lowered):
            exe = self._compile_lowered(cache_key, lowered)
            bar.update(1)
            return exe

        done = {}
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for key, fn, args in jobs:
                cache_key = self._cache_key(key, args)
                if self._found_on_disk(key, cache_key, fn, args):
                    bar.update(1)
                    continue
                with mlir_lock:
                    lowered = fn.lower(*args)
                done[key] = pool.submit(compile_one, cache_key, lowered)
            self._executables.update((key, f.result()) for key, f in done.items())
        bar.close()

    def defer(self, key: ProgramKey, fn, args) -> None:
        """Leave key to the background thread (`start_background`), or to the first step
        needing it."""
        self._futures[key] = Future()
        self._unclaimed[key] = (fn, args)
        self._deferred.append(key)

    def start_background(self) -> None:
        """Leave the deferred programs the executable cache holds to their first use, then
        compile the others one by one in a daemon thread, in the order deferred. At
        interpreter exit it stops after the program in hand (XLA aborts the process if a
        compile is still running while Python shuts down).

        Only the engine's thread loads from the cache, never while a compile thread runs one
        of its loads: loading an XLA:CPU executable in a compile thread while the engine's
        thread ran steps crashed the process (a segfault in `deserialize_executable`, seen
        in tests/test_engine.py::test_multi_step_keeps_outputs, not reproduced alone)."""
        for key in self.deferred():
            job = self._unclaimed.get(key)
            if job is not None and self._found_on_disk(key, self._cache_key(key, job[1]), *job):
                del self._unclaimed[key]
                del self._futures[key]
        stop = threading.Event()
        to_compile = [key for key in self.deferred() if key in self._futures]

        def run():
            _lower_priority()
            for key in to_compile:
                if stop.is_set():
                    return
                try:
                    self._claim(key, load=False)
                except Exception:  # raised again to the step that needs the program
                    logger.exception("compiling %s in the background failed", key.kind)
            if to_compile:
                logger.info("Compiled the %d deferred programs", len(to_compile))

        thread = threading.Thread(target=run, name="jaxllm-compile", daemon=True)
        thread.start()
        atexit.register(lambda: (stop.set(), thread.join()))

    def _claim(self, key: ProgramKey, load: bool):
        """The executable of a background program: compiled here (first looked for in the
        executable cache if `load`) if nobody has started it (a step needs it now), else the
        compile under way is waited for."""
        with self._lock:
            job = self._unclaimed.pop(key, None)
        future = self._futures[key]
        if job is not None:
            try:
                future.set_result(self._compile_and_keep(key, *job, load=load))
            except BaseException as e:
                future.set_exception(e)
        return future.result()

    def _compile_and_keep(self, key: ProgramKey, fn, args, load: bool):
        exe = self._executables[key] = self.compile(key, fn, args, load)
        return exe

    def _cache_key(self, key: ProgramKey, args) -> Optional[str]:
        return None if self._cache is None else self._cache.key(key, args)

    def _found_on_disk(self, key: ProgramKey, cache_key: Optional[str], fn, args) -> bool:
        """Whether the executable cache holds key's program (then loaded on first use)."""
        if cache_key is None or not self._cache.holds(cache_key):
            return False
        self._on_disk[key] = (cache_key, fn, args)
        self.programs_from_cache += 1
        return True

    def _load(self, key: ProgramKey):
        """The executable of a program found on disk at warm-up: loaded, or compiled again if
        the file no longer loads (damaged, or removed meanwhile)."""
        cache_key, fn, args = self._on_disk.pop(key)
        t = time.perf_counter()
        exe = self._cache.get(cache_key)
        if exe is None:
            self.programs_from_cache -= 1
            exe = self.compile(key, fn, args, load=False)
        else:
            logger.debug("loaded %s T=%d from the executable cache in %.2f s", key.kind,
                         key.tokens, time.perf_counter() - t)
        self._executables[key] = exe
        return exe

    def _cached(self, key: ProgramKey, args, load: bool = True):
        """(executable-cache key, its executable or None (always without `load`)); (None,
        None) without the cache."""
        if self._cache is None:
            return None, None
        cache_key = self._cache.key(key, args)
        exe = self._cache.get(cache_key) if load else None
        self.programs_from_cache += exe is not None
        return cache_key, exe

    def _compile_lowered(self, cache_key, lowered):
        exe, compiled_here = compile_lowered(lowered)
        if cache_key is not None and compiled_here:
            self._cache.put(cache_key, exe)
        return exe


def _lower_priority() -> None:
    """Run this thread (and the compiler threads it starts) at a lower CPU priority: the
    background compiles then take only what the engine's steps leave, and a request served
    meanwhile is not slowed by programs it may never use. Linux gives each thread its own
    nice value; elsewhere this does nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


# --- the step launcher -------------------------------------------------------------------------

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
