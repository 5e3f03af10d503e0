"""AsyncLLMEngine: the engine loop on its own thread, streamed to asyncio consumers.

The server's event loop never runs a model step: `generate()` hands the request to the engine
thread and awaits its outputs on an asyncio queue. Only the engine thread touches the engine, so
the scheduler needs no locks.

Ready means ready: this engine exists (and the server listens) only once every program it
serves with is compiled, the ones warm-up leaves to the background included. Those compiles
share the cores (and the GIL) with the steps, so a server that answered while its multi-step
programs were still compiling gave its first requests many times the warm time to first token
(docs/performance.md has the figures). The offline `LLM` keeps serving while they compile (its
first requests need few of them).

A step that raises is fatal, as in vLLM: its requests (and every other in flight or queued) fail
with EngineDeadError, the loop stops, `health()` reports why, and the server exits non-zero for
its supervisor to restart it. Recovering in place would need the scheduler and KV cache rolled
back to a state no half-finished step has touched; a fresh process is the simpler certainty.
For tests, $JAXLLM_TEST_FAIL_STEP=K makes the K-th step raise, and $JAXLLM_TEST_STEP_DELAY=S
makes every step S seconds slower (requests that outlive a shutdown timeout on a tiny model).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from typing import AsyncIterator, Optional

from jaxllm.engine.engine import LLMEngine, PromptType
from jaxllm.engine.errors import EngineDeadError, EngineSleepingError, RequestCancelledError
from jaxllm.engine.stats import EngineStats
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.parallel.step_channel import add_host_lost_hook
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger("jaxllm")


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.engine_args = engine.args
        self.model_config = engine.model_config
        self.generation_defaults = engine.generation_defaults
        self.eos_token_ids = engine.eos_token_ids
        # What the pooling routes may ask (/classify, /score, /rerank: serving/serving_score.py).
        self.supported_tasks = engine.supported_tasks
        self.classifier = engine.classifier
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = engine.stats()
        self._error: Optional[BaseException] = None
        self._heartbeat = time.monotonic()  # the loop's last pass (idle passes every 0.5 s)
        self._steps = 0
        self._fail_at_step = int(os.environ.get("JAXLLM_TEST_FAIL_STEP", 0))  # test-only hooks
        self._step_delay = float(os.environ.get("JAXLLM_TEST_STEP_DELAY", 0))
        self._stop = threading.Event()
        self._draining = False  # sleep or new weights: waiting for the requests in flight
        self._asleep = False  # asleep: the loop takes no step (requests kept wait)
        engine.wait_for_background_compiles()
        if engine.step_leader is not None:  # multi-host rank 0
            add_host_lost_hook(self._host_lost)
        self._thread = threading.Thread(target=self._loop, name="jaxllm-engine", daemon=True)
        self._thread.start()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step (read without stopping the loop)."""
        return self._stats

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def health(self, stall_after: float) -> Optional[str]:
        """None while the loop is alive and passing (stepping or idle-waiting) at least every
        `stall_after` seconds; else why not."""
        if self._error is not None:
            return f"the engine loop failed: {self._error!r}"
        if not self._thread.is_alive():
            return "the engine loop has stopped"
        age = time.monotonic() - self._heartbeat
        if age > stall_after:
            return f"the engine loop has not completed a pass for {age:.0f} s"
        return None

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, priority: int = 0,
                       lora_request: Optional[LoRARequest] = None
                       ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs as tokens arrive (with `lora_request`'s adapter, if any); invalid
        requests raise before the first yield."""
        if self._error is not None:
            raise EngineDeadError(f"the engine loop failed: {self._error!r}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self._draining:
            raise EngineSleepingError("the engine is going to sleep or taking new weights; "
                                      "retry after it wakes up")
        loop = asyncio.get_running_loop()
        out_q: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()
        self._streams[request_id] = (loop, out_q)
        self._commands.put(("add", request_id, prompt, sampling_params, priority, lora_request,
                            loop, added))
        if self._error is not None:  # the loop died meanwhile: nobody else will answer the add
            self._fail_pending()
        finished = False
        try:
            await added  # raises the engine's ValueError for a bad request
            while True:
                item = await out_q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams,
                     request_id: str) -> PoolingRequestOutput:
        """The pooled output of one prompt, computed on the engine thread between steps."""
        if self._error is not None:
            raise EngineDeadError(f"the engine loop failed: {self._error!r}")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(("encode", request_id, prompt, pooling_params, loop, done))
        if self._error is not None:
            self._fail_pending()
        return await done

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and validate an adapter into the engine's cache (on the engine thread, between
        steps); the engine's ValueError for a bad adapter or when LoRA is off."""
        return await self._call("add_lora", lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter (requests running with it finish with it); False if unknown."""
        return await self._call("remove_lora", lora_int_id)

    async def list_loras(self) -> set[int]:
        return await self._call("list_loras")

    # --- sleep mode ---------------------------------------------------------------------------
    async def sleep(self, level: int = 1, mode: str = "abort") -> dict:
        """Free the engine's device memory (LLMEngine.sleep): mode 'abort' cancels the
        requests in flight (their streams end with an error), 'wait' lets them finish first,
        'keep' holds them (their streams pause until wake_up); new requests are refused
        meanwhile (EngineSleepingError)."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"sleep mode {mode!r}: must be 'abort', 'wait' or 'keep'")
        self._draining = True
        try:
            if mode == "abort":
                self.cancel_all("the engine was put to sleep")
            while mode == "wait" and self._streams:
                await asyncio.sleep(0.05)
            done = await self._call("sleep", level, mode)
            self._asleep = True  # the loop idles, holding the kept requests
            return done
        finally:
            self._draining = False

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        await self._call("wake_up", tags)
        self._asleep = await self._call("is_sleeping")

    async def is_sleeping(self) -> bool:
        return self._draining or await self._call("is_sleeping")

    async def update_weights(self, named_tensors) -> None:
        """New weights (LLMEngine.update_weights), put in place between steps once no request
        is in the engine (new ones wait while they are read)."""
        self._draining = True
        try:
            while self._streams:
                await asyncio.sleep(0.05)
            await self._call("update_weights", named_tensors)
        finally:
            self._draining = False

    async def _call(self, method: str, *args):
        """`engine.method(*args)` on the engine thread; its result, or what it raised."""
        if self._error is not None:
            raise EngineDeadError(f"the engine loop failed: {self._error!r}")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(("call", method, args, loop, done))
        if self._error is not None:
            self._fail_pending()
        return await done

    def cancel_all(self, reason: str) -> int:
        """Fail every request in flight with RequestCancelledError(reason) and abort it in
        the engine (the shutdown timeout ran out); returns how many there were."""
        rids = list(self._streams)
        self._commands.put(("cancel", rids, reason))
        return len(rids)

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("noop",))
        self._thread.join(timeout=10)

    # --- engine thread -----------------------------------------------------------------------
    def _send(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _handle(self, cmd) -> None:
        if cmd[0] == "add":
            _, rid, prompt, params, priority, lora, loop, fut = cmd
            error = None
            try:
                if lora is None:
                    self.engine.add_request(rid, prompt, params, priority)
                else:
                    self.engine.add_request(rid, prompt, params, priority, lora_request=lora)
            except Exception as e:  # invalid request: report to its caller, keep serving
                error = e
            loop.call_soon_threadsafe(_settle, fut, error)
        elif cmd[0] == "call":
            _, method, args, loop, fut = cmd
            result = error = None
            try:
                result = getattr(self.engine, method)(*args)
            except Exception as e:  # a refused adapter: report to its caller, keep serving
                error = e
            loop.call_soon_threadsafe(_settle, fut, error, result)
        elif cmd[0] == "encode":
            _, rid, prompt, params, loop, fut = cmd
            result = error = None
            try:
                result = self.engine.encode(rid, prompt, params)
            except ValueError as e:  # invalid request: report to its caller, keep serving
                error = e
            loop.call_soon_threadsafe(_settle, fut, error, result)
        elif cmd[0] == "abort":
            self.engine.abort_request(cmd[1])
        elif cmd[0] == "cancel":
            for rid in cmd[1]:
                self._send(rid, RequestCancelledError(cmd[2]))
            self.engine.abort_request(cmd[1])

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._heartbeat = time.monotonic()
                block = self._asleep or not self.engine.has_unfinished_requests()
                try:
                    cmd = self._commands.get(block=block, timeout=0.5 if block else None)
                    self._handle(cmd)
                    while True:
                        self._handle(self._commands.get_nowait())
                except queue.Empty:
                    pass
                self._stats = self.engine.stats()  # gauges current before a long step too
                if self.engine.has_unfinished_requests() and not self._asleep:
                    self._steps += 1
                    if self._steps == self._fail_at_step:
                        raise RuntimeError("injected fault ($JAXLLM_TEST_FAIL_STEP)")
                    time.sleep(self._step_delay)
                    for out in self.engine.step():
                        self._send(out.request_id, out)
                self._stats = self.engine.stats()
        except BaseException as e:  # report to every waiting stream, then stop
            logger.exception("engine loop failed")
            self._error = e
            for rid in list(self._streams):
                self._send(rid, EngineDeadError(f"the engine loop failed: {e!r}"))
            self._fail_pending()

    def _host_lost(self, reason: str) -> None:
        """Another host of the group is gone (the engine thread may be stuck in a collective
        with it): fail every request now; the process exits next (step_channel.host_lost)."""
        self._error = EngineDeadError(f"a host of the group was lost: {reason}")
        for rid in list(self._streams):
            self._send(rid, self._error)
        self._fail_pending()

    def _fail_pending(self) -> None:
        """Refuse the requests still queued for a loop that is gone."""
        error = EngineDeadError(f"the engine loop failed: {self._error!r}")
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] in ("add", "encode", "call"):
                loop, fut = cmd[-2], cmd[-1]
                loop.call_soon_threadsafe(_settle, fut, error)


def _settle(fut: asyncio.Future, error: Optional[BaseException], result=None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
