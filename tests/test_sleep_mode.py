"""Sleep mode and new weights (issue 52): `LLM.sleep/wake_up/is_sleeping/update_weights` and
the server's development routes (/sleep, /wake_up, /is_sleeping, /update_weights).

The tiny float32 model's greedy tokens are the witness: after a sleep of either level, after
waking in parts, and after new weights (compared with transformers on those weights), the
engine answers as a fresh one would. Device memory is counted from the runner's arrays and
from every live JAX array of the process."""

from __future__ import annotations

import os

import httpx
import jax
import numpy as np
import pytest
import torch

from jaxllm import LLM, SamplingParams
from jaxllm.config import ConfigError, EngineArgs
from jaxllm.engine.errors import EngineSleepingError
from serving.dev_routes import DEV_MODE_ENV, dev_mode

PROMPTS = [[5, 17, 42, 9], [3, 3, 8, 100, 21, 7, 64]]
SP = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# 16-token steps: the prompts are short, and the default step budget (2048 tokens) would
# compile eight token buckets (16 to 2048) for them.
ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=2 << 20,
              max_num_seqs=4, max_num_batched_tokens=16, enable_sleep_mode=True)


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SP, use_tqdm=False)]


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, **ENGINE)


@pytest.fixture(scope="module")
def expected(llm):
    return _tokens(llm)


def test_sleep_level_1_frees_device_memory_and_wakes_identical(llm, expected):
    runner = llm.llm_engine.runner
    held, live = runner.device_bytes(), _live_bytes()
    assert held > 0
    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert runner.device_bytes() == 0
    assert live - _live_bytes() >= 0.9 * held  # really freed, not only forgotten
    with pytest.raises(EngineSleepingError, match="wake it up"):
        llm.generate("hello", SP, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping() and runner.device_bytes() == held
    assert _tokens(llm) == expected


def test_sleep_level_2_wakes_in_parts_from_the_checkpoint(llm, expected):
    runner = llm.llm_engine.runner
    llm.sleep(level=2)
    assert runner.weights_at == "none" and runner.kv_cache is None
    llm.wake_up(tags=["weights"])  # read again from the checkpoint
    assert runner.weights_at == "device" and runner.kv_cache is None and llm.is_sleeping()
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert _tokens(llm) == expected


def test_update_weights_then_back(llm, expected, make_tiny_checkpoint, greedy):
    """New weights (torch tensors of another checkpoint, as a trainer holds them) answer as
    transformers does on them; the prefix cache of the old weights is not reused; the
    original weights (NumPy) bring the original answers back."""
    from transformers import AutoModelForCausalLM
    other = AutoModelForCausalLM.from_pretrained(make_tiny_checkpoint("llama", seed=7),
                                                 dtype=torch.float32)
    llm.update_weights(other.state_dict().items())
    with torch.no_grad():
        want = [other.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                               min_new_tokens=8)[0, len(p):].tolist() for p in PROMPTS]
    got = _tokens(llm)
    assert got == want and got != expected
    from safetensors.numpy import load_file
    base = load_file(os.path.join(llm.llm_engine.config.load.model, "model.safetensors"))
    llm.update_weights(base.items())
    assert _tokens(llm) == expected


def test_refusals(llm, tiny_llama):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="must be 1 .* or 2"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["everything"])
    with pytest.raises(ValueError, match="missing"):  # a partial set names what is missing
        llm.update_weights([("model.norm.weight", np.ones(64, np.float32))])
    engine.add_request("pending", {"prompt_token_ids": PROMPTS[0]}, SP)
    with pytest.raises(ValueError, match="unfinished"):
        engine.sleep(1, mode="wait")
    assert engine.has_unfinished_requests()  # refused calls changed nothing
    engine.sleep(1, mode="abort")  # the request is aborted, then the engine sleeps
    assert not engine.has_unfinished_requests() and llm.is_sleeping()
    llm.wake_up()
    with pytest.raises(ConfigError, match="--data-parallel-size.*--enable-sleep-mode"):
        EngineArgs(model=tiny_llama, enable_sleep_mode=True, data_parallel_size=2)


def test_sleep_mode_off_is_refused_by_name(tiny_llama):
    llm = LLM(tiny_llama, **{**ENGINE, "enable_sleep_mode": False})
    with pytest.raises(ValueError, match="--enable-sleep-mode"):
        llm.sleep()
    assert dev_mode({DEV_MODE_ENV: "1"}) and not dev_mode({}) and not dev_mode(
        {DEV_MODE_ENV: "0"})


def _run_engine(engine, outs: dict, until=lambda outs: False) -> None:
    """Step until nothing is left, or `until(outs)` holds; outs: request id -> last output."""
    while engine.has_unfinished_requests() and not until(outs):
        for out in engine.step():
            outs[out.request_id] = out


def test_sleep_keep_resumes_the_requests_after_waking(llm, expected):
    """mode 'keep': requests part-way through are preempted and held; after wake_up they are
    recomputed and finish with the tokens an uninterrupted run gives."""
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"keep-{i}", {"prompt_token_ids": p}, SP)
    outs: dict = {}
    _run_engine(engine, outs, until=lambda o: len(o) == len(PROMPTS) and all(
        len(x.outputs[0].token_ids) >= 2 for x in o.values()))
    assert all(not o.finished for o in outs.values())
    preempted = engine.scheduler.num_preemptions
    engine.sleep(level=1, mode="keep")
    assert llm.is_sleeping() and engine.has_unfinished_requests()
    assert engine.scheduler.num_running == 0 and engine.kv_cache_manager.usage == 0.0
    assert engine.scheduler.num_preemptions == preempted + len(PROMPTS)
    for out in engine.step():  # the steps read while going to sleep, then nothing
        outs[out.request_id] = out
    assert engine.step() == [] and engine.scheduler.num_running == 0
    with pytest.raises(EngineSleepingError):
        engine.add_request("new", {"prompt_token_ids": PROMPTS[0]}, SP)
    engine.wake_up()
    _run_engine(engine, outs)
    assert [outs[f"keep-{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == expected


# Slow: the async engine first waits for every background compile (the sampler variants).
@pytest.mark.slow
def test_async_sleep_keep_pauses_the_streams(llm, monkeypatch):
    """The server's engine loop holds kept requests while asleep (it takes no step) and their
    streams go on after wake_up with the tokens of an uninterrupted run."""
    import asyncio

    from jaxllm.engine.async_engine import AsyncLLMEngine

    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]
    monkeypatch.setenv("JAXLLM_TEST_STEP_DELAY", "0.05")  # 24 steps outlast the checks below
    aeng = AsyncLLMEngine(llm.llm_engine)
    seen: dict[int, list] = {i: [] for i in range(len(PROMPTS))}

    async def run():
        async def one(i):
            async for out in aeng.generate({"prompt_token_ids": PROMPTS[i]}, sp, f"a-{i}"):
                seen[i] = out.outputs[0].token_ids
            return seen[i]

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(PROMPTS))]
        while not all(len(t) >= 2 for t in seen.values()):
            await asyncio.sleep(0.005)
        done = await aeng.sleep(1, "keep")
        at_sleep = {i: len(t) for i, t in seen.items()}
        await asyncio.sleep(0.5)  # asleep: no stream moves, none ends
        paused = not any(t.done() for t in tasks) and {i: len(t) for i, t in seen.items()}
        sleeping = await aeng.is_sleeping()
        with pytest.raises(ValueError, match="'keep'"):
            await aeng.sleep(1, "later")
        await aeng.wake_up()
        return done, at_sleep, paused, sleeping, await asyncio.gather(*tasks)

    try:
        done, at_sleep, paused, sleeping, tokens = asyncio.run(run())
    finally:
        aeng.shutdown()
    assert done["level"] == 1 and sleeping
    # What the steps in flight gave may arrive just after the sleep; nothing after that.
    assert paused and all(at_sleep[i] <= paused[i] <= at_sleep[i] + 2 for i in paused)
    assert all(n < 24 for n in paused.values())
    assert tokens == want


@pytest.fixture(scope="module")
def dev_server(tiny_llama):
    from server_process import ENGINE_FLAGS, ServerProcess
    old = os.environ.get(DEV_MODE_ENV)
    os.environ[DEV_MODE_ENV] = "1"  # the server subprocess inherits it
    try:
        srv = ServerProcess(tiny_llama, *ENGINE_FLAGS, "--enable-sleep-mode")
    finally:
        if old is None:
            del os.environ[DEV_MODE_ENV]
        else:
            os.environ[DEV_MODE_ENV] = old
    yield srv
    srv.stop()


@pytest.mark.slow  # the module's server (~40 s to start); LLM.sleep is tested offline above
def test_server_sleep_routes(dev_server, tiny_llama):
    with httpx.Client(base_url=dev_server.url, timeout=120) as http:
        def complete():
            r = http.post("/v1/completions", json={"model": tiny_llama, "prompt": PROMPTS[1],
                                                   "max_tokens": 6, "temperature": 0})
            return r.status_code, r.json()

        status, before = complete()
        assert status == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        r = http.post("/sleep", params={"level": 1})
        assert r.status_code == 200 and r.json()["freed_bytes"] > 0
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        status, body = complete()
        assert status == 503 and "sleeping" in body["error"]["message"]
        r = http.post("/sleep", params={"level": 5})
        assert r.status_code == 400 and "level" in r.json()["error"]["message"]
        assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}  # the KV cache sleeps
        assert http.post("/wake_up").status_code == 200
        status, after = complete()
        assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]
        r = http.post("/update_weights", json={"model_path": tiny_llama})
        assert r.status_code == 200
        assert complete()[1]["choices"][0]["text"] == before["choices"][0]["text"]
        r = http.post("/update_weights", json={"model_path": "/nonexistent"})
        assert r.status_code == 400 and "model_path" in r.json()["error"]["message"]
