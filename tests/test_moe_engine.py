"""A mixture-of-experts model (Qwen2-MoE: routed experts, a shared expert, a dense layer in
between) through the whole engine: continuous batching with chunked prefill, prefix caching and
preemption give transformers' greedy tokens, and the same tokens as one request at a time."""

from __future__ import annotations

import pytest

from test_engine import GREEDY, NEW, hf_greedy, mixed_prompts, small_llm, token_ids


@pytest.fixture(autouse=True)
def _fail_on_recompile(monkeypatch):
    monkeypatch.setenv("JAXLLM_FAIL_ON_RECOMPILE", "1")


@pytest.fixture(scope="module")
def moe_model(make_tiny_checkpoint):
    return make_tiny_checkpoint("qwen2_moe")


@pytest.fixture(scope="module")
def moe_prompts():
    prompts = mixed_prompts(20, seed=3)
    return prompts + [prompts[0] + p for p in mixed_prompts(4, seed=4)]  # shared prefixes


@pytest.fixture(scope="module")
def moe_expected(moe_model, moe_prompts):
    return hf_greedy(moe_model, moe_prompts, NEW)


@pytest.mark.parametrize("kw", [
    pytest.param(dict(), id="prefix-caching"),
    # 64 blocks of 4 slots against 8 running sequences: preemption (~75 s: more programs)
    pytest.param(dict(num_gpu_blocks_override=64), id="preemption", marks=pytest.mark.slow),
])
def test_moe_engine_equals_transformers_and_one_by_one(moe_model, moe_prompts, moe_expected, kw):
    llm = small_llm(moe_model, **kw)
    batch = token_ids(llm.generate([{"prompt_token_ids": p} for p in moe_prompts], GREEDY,
                                   use_tqdm=False))
    assert batch == moe_expected
    eng = llm.llm_engine
    if kw:
        assert eng.scheduler.num_preemptions > 0
    else:
        singles = [token_ids(llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False))[0]
                   for p in moe_prompts[:3]]
        assert singles == moe_expected[:3]
        # the prompts that extend prompt 0 hit the prefix cache
        assert eng.kv_cache_manager.prefix_cache_hits > 0
