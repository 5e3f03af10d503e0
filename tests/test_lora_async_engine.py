"""The async engine's LoRA calls (add_lora, remove_lora, list_loras) pass through to the engine
on its own thread, as generation does; on a fake synchronous engine (no model)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from jaxllm.engine.async_engine import AsyncLLMEngine
from jaxllm.engine.stats import EngineStats
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import SamplingParams


class FakeSyncEngine:
    args = SimpleNamespace()
    model_config = SimpleNamespace()
    generation_defaults: dict = {}
    tokenizer = None
    eos_token_ids = frozenset()
    step_leader = None
    supported_tasks, classifier = ("generate",), None

    def __init__(self):
        import threading
        self.requests: dict = {}
        self.loras: set[int] = set()
        self.threads: set[str] = set()
        self._threading = threading

    def _on(self):
        self.threads.add(self._threading.current_thread().name)

    def stats(self):
        return EngineStats(num_running=len(self.requests))

    def wait_for_background_compiles(self):
        pass

    def has_unfinished_requests(self):
        return bool(self.requests)

    def add_request(self, rid, prompt, params, priority, lora_request=None):
        self._on()
        if lora_request is not None and lora_request.lora_int_id not in self.loras:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} is not loaded")
        self.requests[rid] = lora_request

    def abort_request(self, rid):
        self.requests.pop(rid, None)

    def step(self):
        outs = [RequestOutput(rid, None, [1], None, [CompletionOutput(
            0, lora.lora_name if lora else "", [7], None, None, "length")], True)
            for rid, lora in self.requests.items()]
        self.requests.clear()
        return outs

    def add_lora(self, lora_request):
        self._on()
        if not lora_request.lora_path:
            raise ValueError("no path")
        self.loras.add(lora_request.lora_int_id)
        return True

    def remove_lora(self, lora_int_id):
        self._on()
        if lora_int_id not in self.loras:
            return False
        self.loras.discard(lora_int_id)
        return True

    def list_loras(self):
        self._on()
        return set(self.loras)


def test_async_engine_runs_lora_calls_on_its_thread():
    fake = FakeSyncEngine()
    engine = AsyncLLMEngine(fake)

    async def run():
        a = LoRARequest("a", 1, "/x/a")
        assert await engine.add_lora(a) is True
        with pytest.raises(ValueError, match="no path"):
            await engine.add_lora(LoRARequest("b", 2))
        assert await engine.list_loras() == {1}
        outs = [o async for o in engine.generate([1], SamplingParams(), "r1", lora_request=a)]
        assert outs[-1].outputs[0].text == "a"
        outs = [o async for o in engine.generate([1], SamplingParams(), "r2")]
        assert outs[-1].outputs[0].text == ""
        assert await engine.remove_lora(1) is True and await engine.remove_lora(1) is False
        with pytest.raises(ValueError, match="'a' is not loaded"):
            async for _ in engine.generate([1], SamplingParams(), "r3", lora_request=a):
                pass
    try:
        asyncio.run(run())
        assert fake.threads == {"jaxllm-engine"} and engine.is_running
    finally:
        engine.shutdown()


# --- a real server with two adapters ----------------------------------------------------------
