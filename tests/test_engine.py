"""The engine end to end through `LLM`: continuous batching, chunked prefill, prefix caching,
preemption, sampling features, and no compilation after warm-up — transformers is the oracle."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams

NEW = 12  # greedy tokens compared per prompt


@pytest.fixture(autouse=True)
def _fail_on_recompile(monkeypatch):
    monkeypatch.setenv("JAXLLM_FAIL_ON_RECOMPILE", "1")


def small_llm(path: str, **kw) -> LLM:
    args = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, block_size=4,
                use_tqdm_on_load=False, seed=0, disable_log_stats=True)
    return LLM(path, **{**args, **kw})


def mixed_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def hf_greedy(path: str, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy continuation (EOS not special: the engine runs with ignore_eos)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model(ids, use_cache=True)
            toks = []
            for _ in range(new):
                nxt = int(out.logits[0, -1].argmax())
                toks.append(nxt)
                out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values,
                            use_cache=True)
            outs.append(toks)
    return outs


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(64)


@pytest.fixture(scope="module")
def expected(tiny_llama, prompts):
    return hf_greedy(tiny_llama, prompts, NEW)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return small_llm(tiny_llama)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_batch_equals_transformers_and_one_by_one(llm, prompts, expected):
    batch = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                   use_tqdm=False))
    assert batch == expected
    singles = [token_ids(llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False))[0]
               for p in prompts[:6]]
    assert singles == expected[:6]


# (each variant starts an engine: the slow run has the ones other default tests come near)
@pytest.mark.parametrize("kw", [
    pytest.param(dict(enable_chunked_prefill=False, max_num_batched_tokens=64),
                 id="no-chunked-prefill", marks=pytest.mark.slow),
    pytest.param(dict(enable_prefix_caching=False), id="no-prefix-caching",
                 marks=pytest.mark.slow),
    # 256 slots; 8 running sequences need ~400: preemption
    pytest.param(dict(num_gpu_blocks_override=64), id="preemption"),
    pytest.param(dict(enforce_eager=True), id="eager", marks=pytest.mark.slow),
    pytest.param(dict(async_scheduling=True, num_gpu_blocks_override=64),
                 id="async-preemption"),
    pytest.param(dict(attention_backend="reference"), id="reference-attention",
                 marks=pytest.mark.slow),
])
def test_engine_variants_match_transformers(tiny_llama, prompts, expected, kw):
    # 24 of the 64 prompts: three times max_num_seqs, enough to refill the batch and (with 64
    # blocks) to preempt; the full set runs in the batch test above.
    llm = small_llm(tiny_llama, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:24]], GREEDY, use_tqdm=False)
    assert token_ids(outs) == expected[:24]
    eng = llm.llm_engine
    # One forward program per bucket with the native CPU attention (it runs every step);
    # the reference compiles decode steps (one-query tiles) apart.
    batch = eng.runner.input_batch
    forward = {(k.tokens, k.decode_only) for k in eng.runner.compile_manager.programs()
               if k.kind == "forward"}
    buckets = {*batch.token_buckets, *batch.decode_buckets}
    if kw.get("attention_backend") == "reference":
        assert forward == ({(T, False) for T in batch.token_buckets}
                           | {(T, True) for T in batch.decode_buckets})
    elif not kw.get("enforce_eager"):
        assert forward == {(T, False) for T in buckets}
    if "num_gpu_blocks_override" in kw:
        assert eng.scheduler.num_preemptions > 0
    assert eng.kv_cache_manager.usage == 0.0  # everything freed when idle


def test_chunked_prefill_splits_long_prompt(tiny_llama, llm):
    # The module's engine (64-token steps) and a prompt of 140: its programs are compiled.
    prompt = mixed_prompts(1, seed=5, lo=140, hi=141)[0]
    steps = []
    remove = llm.llm_engine.runner.add_step_hook(
        lambda e: e.kind == "dispatch" and steps.append(e.steps[0].sched.total_num_tokens))
    try:
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    finally:
        remove()
    assert token_ids(out) == hf_greedy(tiny_llama, [prompt], NEW)
    assert max(steps) <= 64 and steps[:3] == [64, 64, 12]


def test_prefix_caching_computes_only_new_tokens(llm):
    shared = mixed_prompts(1, seed=7, lo=33, hi=34)[0]
    first, second = shared + [11, 12, 13], shared + [21, 22]
    llm.generate({"prompt_token_ids": first}, GREEDY, use_tqdm=False)
    steps = []
    remove = llm.llm_engine.runner.add_step_hook(lambda e: e.kind == "dispatch" and steps.append(
        e.steps[0].sched.total_num_tokens))
    try:
        out = llm.generate({"prompt_token_ids": second}, GREEDY, use_tqdm=False)[0]
    finally:
        remove()
    # 35 prompt tokens, the first 32 (8 full blocks of 4) cached -> 3 computed, then decodes
    assert steps[0] == len(second) - 32
    assert out.num_cached_tokens == 32
    llm.llm_engine.kv_cache_manager.reset_prefix_cache()
    again = llm.generate({"prompt_token_ids": second}, GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def test_seeded_sampling_independent_of_batch(llm, prompts):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompts[0]}, p, use_tqdm=False)[0]
    others = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True) for n in (3, 7, 12)]
    batch = llm.generate([{"prompt_token_ids": q} for q in prompts[1:4]]
                         + [{"prompt_token_ids": prompts[0]}], others + [p], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    a, b = llm.generate([{"prompt_token_ids": prompts[0]}] * 2, unseeded, use_tqdm=False)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids  # fresh seeds per request


def test_n_returns_distinct_completions(llm, prompts):
    out = llm.generate({"prompt_token_ids": prompts[1]},
                       SamplingParams(n=3, temperature=1.0, max_tokens=8, ignore_eos=True, seed=3),
                       use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3


def test_logprobs_match_transformers(tiny_llama, llm, prompts):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = prompts[2]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0]
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    total = 0.0
    for step, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp[tok].rank == 1
        assert abs(lp[tok].logprob - float(ref[step, tok])) < 1e-4
        top = torch.topk(ref[step], 3).indices.tolist()
        assert [i for i, _ in sorted(lp.items(), key=lambda kv: -kv[1].logprob)][:3] == top
        total += lp[tok].logprob
    assert abs(out.cumulative_logprob - total) < 1e-4


def test_stop_strings_and_stop_tokens(llm, prompts):
    tok = llm.get_tokenizer()
    free = llm.generate({"prompt_token_ids": prompts[3]},
                        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop_tok = free.token_ids[4]
    out = llm.generate({"prompt_token_ids": prompts[3]},
                       SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                                      stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == stop_tok and out.finish_reason == "stop"
    assert out.stop_reason == stop_tok and stop_tok not in out.token_ids[:-1]
    text = free.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), "test needs a non-blank stop string"
    out = llm.generate({"prompt_token_ids": prompts[3]},
                       SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                                      stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert tok is not None


def test_async_scheduling_overlaps_and_keeps_outputs(tiny_llama, llm, prompts):
    """With async scheduling step N+1 is dispatched before step N's tokens are read, and every
    output equals the synchronous engine's: seeded sampling, stop tokens and strings, EOS with
    min_tokens, max_tokens, logprobs, n > 1, and penalties (which wait for the tokens)."""
    eos = next(iter(llm.llm_engine.eos_token_ids))
    free = llm.generate({"prompt_token_ids": prompts[3]}, GREEDY, use_tqdm=False)[0].outputs[0]
    params = [
        SamplingParams(temperature=0.9, top_k=20, seed=i, max_tokens=3 + i % 9, ignore_eos=True)
        for i in range(12)] + [
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                       stop_token_ids=[free.token_ids[4]]),
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                       stop=[free.text[len(free.text) // 2:len(free.text) // 2 + 3]]),
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5, logit_bias={eos: 100.0}),
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3, ignore_eos=True)]
    batch = [{"prompt_token_ids": prompts[i % 8 if i != 13 else 3]} for i in range(len(params))]
    batch[12] = batch[13] = {"prompt_token_ids": prompts[3]}
    want = llm.generate(batch, params, use_tqdm=False)

    # The async-preemption variant's configuration (its programs are compiled): preemptions
    # happen here too, and must not change what the requests get either.
    async_llm = small_llm(tiny_llama, async_scheduling=True, num_gpu_blocks_override=64)
    calls = []
    async_llm.llm_engine.runner.add_step_hook(lambda e: calls.append(e.kind))
    got = async_llm.generate(batch, params, use_tqdm=False)

    def summary(outs):
        return [[(o.token_ids, o.text, o.finish_reason, o.stop_reason,
                  None if o.logprobs is None else [sorted(d) for d in o.logprobs])
                 for o in r.outputs] for r in outs]
    assert summary(got) == summary(want)
    assert "dispatch,dispatch" in ",".join(calls)  # the overlap happened
    assert calls.count("dispatch") == calls.count("collect")
    assert async_llm.llm_engine.kv_cache_manager.usage == 0.0
    assert not async_llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [
    pytest.param(False, id="sync", marks=pytest.mark.slow),  # ~20 s; async covers the burst
    pytest.param(True, id="async")])
def test_multi_step_keeps_outputs(tiny_llama, llm, prompts, async_scheduling):
    """With num_scheduler_steps=4, runs of plain decode steps go to the device four at a time,
    and every output equals the one-step engine's: seeded sampling, stop tokens and strings
    mid-burst, max_tokens, and requests with logprobs or logit_bias (which run alone)."""
    free = llm.generate({"prompt_token_ids": prompts[3]}, GREEDY, use_tqdm=False)[0].outputs[0]
    params = [
        SamplingParams(temperature=0.9, top_k=20, seed=i, max_tokens=3 + 6 * i, ignore_eos=True)
        for i in range(8)] + [
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                       stop_token_ids=[free.token_ids[6]]),
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                       stop=[free.text[len(free.text) // 2:len(free.text) // 2 + 3]]),
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, logit_bias={5: 3.0}, ignore_eos=True)]
    batch = [{"prompt_token_ids": prompts[i % 8]} for i in range(len(params))]
    batch[8] = batch[9] = {"prompt_token_ids": prompts[3]}
    want = llm.generate(batch, params, use_tqdm=False)

    def summary(outs):
        return [[(o.token_ids, o.text, o.finish_reason, o.stop_reason,
                  None if o.logprobs is None else [sorted(d) for d in o.logprobs])
                 for o in r.outputs] for r in outs]

    # 64 KV blocks: the async-preemption variant's forward programs (compiled); requests
    # are preempted between bursts here too, which must not change the outputs either.
    multi = small_llm(tiny_llama, num_scheduler_steps=4, async_scheduling=async_scheduling,
                      num_gpu_blocks_override=64)
    runner, bursts, chained = multi.llm_engine.runner, [], []

    def spy(event):  # chained: dispatched while the step before is still unread
        if event.kind == "burst":
            bursts.append(len(event.steps))
            chained.append(event.chained)
    runner.add_step_hook(spy)
    # The greedy and plain random bursts compile at start-up (in the background), others
    # (top_k here) when first wanted, while single steps serve: the same outputs either way.
    assert summary(multi.generate(batch, params, use_tqdm=False)) == summary(want)
    runner.wait_for_background_compiles()
    bursts.clear()
    chained.clear()
    assert summary(multi.generate(batch, params, use_tqdm=False)) == summary(want)
    assert bursts and set(bursts) == {4}
    assert any(chained) == async_scheduling
    assert multi.llm_engine.kv_cache_manager.usage == 0.0
    assert runner.num_recompiles == 0


def test_min_tokens_and_eos(tiny_llama, llm):
    eos = next(iter(llm.llm_engine.eos_token_ids))
    # A bias makes EOS the greedy choice at once; min_tokens holds it back.
    p = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5, logit_bias={eos: 100.0})
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, p, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos
    assert eos not in out.token_ids[:-1] and out.finish_reason == "stop"


def test_text_prompts_chat_and_order(llm):
    outs = llm.generate(["Hello world", "The capital of France is"],
                        SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello world", "The capital of France is"]
    tok = llm.get_tokenizer()
    assert outs[0].prompt_token_ids == tok.encode("Hello world")
    chat = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4),
                    use_tqdm=False)[0]
    assert chat.prompt.endswith("<|im_start|>assistant\n")
    assert chat.outputs[0].finish_reason in ("stop", "length")


def test_invalid_requests_fail_clearly(llm):
    limit = llm.llm_engine.model_config.max_model_len
    with pytest.raises(ValueError, match=rf"length {limit + 1}\).*{limit}"):
        llm.generate({"prompt_token_ids": [5] * (limit + 1)}, GREEDY, use_tqdm=False)
    for field, value in [("top_p", 0), ("n", 0), ("temperature", -1), ("max_tokens", 0)]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("hi", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_kv_cache_too_small_fails_at_startup(tiny_llama):
    from jaxllm.config import ConfigError

    with pytest.raises(ConfigError, match=r"max_model_len=256 needs 64 blocks.*--max-model-len"):
        small_llm(tiny_llama, num_gpu_blocks_override=10)


def test_no_recompilation_on_random_workload(llm):
    rng = np.random.default_rng(1)
    prompts = mixed_prompts(20, seed=11, lo=1, hi=90)
    params = [SamplingParams(temperature=float(rng.choice([0.0, 0.7])), top_k=int(rng.choice([0, 5])),
                             repetition_penalty=float(rng.choice([1.0, 1.2])),
                             logprobs=int(rng.choice([0, 2])) if rng.random() < 0.3 else None,
                             max_tokens=int(rng.integers(1, 20)), ignore_eos=True)
              for _ in prompts]
    before = llm.llm_engine.runner.num_recompiles
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.runner.num_recompiles == before == 0


def test_deferred_sampler_variants_serve_at_once_and_all_compile(tiny_llama):
    """Only the plain sampler variants compile before the engine is ready; a request that needs
    another one right away compiles it (or waits for the background thread), and the
    background thread ends with every variant compiled, none of it counted as a recompile."""
    llm = small_llm(tiny_llama)
    runner = llm.llm_engine.runner
    deferred = runner.compile_manager.deferred()
    assert len(deferred) == 10
    p = SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.2, logprobs=2, seed=3,
                       max_tokens=4, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, p, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and len(out.logprobs) == 4
    runner.wait_for_background_compiles()
    assert not runner.compile_manager.pending()
    assert set(deferred) <= set(runner.compile_manager.programs())
    assert runner.num_recompiles == 0


def test_pallas_backend_matches_reference(tiny_llama, prompts, expected):
    """--attention-backend pallas runs the Pallas kernel (interpret mode on CPU) end to end."""
    # Two rows and 16-token steps: three interpreted forward programs (decode 1 and 2, and
    # 16 tokens) instead of six; the prompts (up to 40 tokens) still come in chunks, and
    # four prompts refill the two rows.
    llm = small_llm(tiny_llama, attention_backend="pallas", max_num_seqs=2,
                    max_num_batched_tokens=16)
    assert llm.llm_engine.runner.state is not None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], GREEDY, use_tqdm=False)
    assert token_ids(outs) == expected[:4]


@pytest.mark.parametrize("requested,model_dtype,backend,want", [
    ("auto", "float32", "cpu", "float32"),
    ("auto", "bfloat16", "cpu", "bfloat16"),  # the native kernel reads and writes bf16
    ("auto", "bfloat16", "reference", "float32"),  # XLA:CPU would upcast the whole cache
    ("float32", "bfloat16", "cpu", "float32"),
    ("float16", "float32", "reference", "float16"),  # as asked (a warning says it is slow)
])
def test_kv_cache_dtype_on_cpu(requested, model_dtype, backend, want):
    import jax.numpy as jnp

    from jaxllm.config import EngineArgs
    from jaxllm.engine.runner_settings import kv_cache_dtype

    cache = EngineArgs(model="m", kv_cache_dtype=requested).create_engine_config().cache
    assert jnp.dtype(kv_cache_dtype(cache, jnp.dtype(model_dtype), backend)) == jnp.dtype(want)
