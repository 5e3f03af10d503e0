"""Honest readiness: the serving engine (what `jaxllm serve` and `run-batch` build before they
listen or read a line) exists only once every program it serves with is compiled, so the first
requests share the cores with no compile."""

import asyncio

import pytest

from jaxllm import SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.deploy.data_parallel import make_engine
from jaxllm.engine.async_engine import AsyncLLMEngine


# One step per call (the default): the sampler variants with penalties, logprobs or filters are
# left to the background; with multi-step scheduling the multi-step programs too (slower).
@pytest.mark.parametrize("steps,deferred_kinds", [
    pytest.param(1, {"sample"}, marks=pytest.mark.slow),  # ~50 s of background compiles
    pytest.param(2, {"sample", "burst"}, marks=pytest.mark.slow)])
def test_serving_engine_is_ready_only_when_every_program_is_compiled(tiny_llama, monkeypatch,
                                                                     steps, deferred_kinds):
    monkeypatch.setenv("JAXLLM_FAIL_ON_RECOMPILE", "1")
    args = EngineArgs(model=tiny_llama, dtype="float32", max_num_seqs=2,
                      max_num_batched_tokens=16, block_size=4, num_scheduler_steps=steps, seed=0,
                      disable_log_stats=True, use_tqdm_on_load=False)
    engine = AsyncLLMEngine(make_engine(args))
    try:
        cm = engine.engine.runner.compile_manager
        deferred = cm.deferred()
        # Warm-up left programs to the background...
        assert {k.kind for k in deferred} == deferred_kinds
        # ...and none of them is still compiling once the engine exists.
        assert not cm.pending()
        assert set(deferred) <= set(cm.programs())
        assert engine.engine.startup_times["background_compile"] > 0
        compiled = set(cm.programs())

        async def generate(params):
            return [o async for o in engine.generate({"prompt_token_ids": [5, 6, 7]}, params,
                                                     "r")][-1]

        for params in (SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
                       SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                      logprobs=2, repetition_penalty=1.2)):
            out = asyncio.run(generate(params)).outputs[0]
            assert len(out.token_ids) == params.max_tokens
        assert set(cm.programs()) == compiled  # nothing compiled while serving
        assert engine.engine.runner.num_recompiles == 0
    finally:
        engine.shutdown()
