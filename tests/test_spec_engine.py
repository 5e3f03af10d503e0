"""N-gram speculative decoding through the engine (issue 27): outputs equal plain decoding
(greedy against transformers; seeded sampling token for token; unseeded sampling in
distribution), with preemption, prefix caching, mixed batches, stops inside accepted runs,
the counters on /metrics, and the refusals of what it cannot do."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.structured_output import StructuredOutputsParams as SO

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
# A repetition penalty below 1 makes the random tiny model copy what it has seen, so its
# outputs repeat and lookups are accepted (runs of 2 and 3 drafts, not only single ones).
COPY = dict(repetition_penalty=0.2, ignore_eos=True)


@pytest.fixture(autouse=True)
def _fail_on_recompile(monkeypatch):
    monkeypatch.setenv("JAXLLM_FAIL_ON_RECOMPILE", "1")


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # 64 blocks of 4 tokens: 8 running sequences of up to ~90 tokens preempt each other.
    return LLM(tiny_llama, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
               block_size=4, num_gpu_blocks_override=64, use_tqdm_on_load=False, seed=0,
               disable_log_stats=True, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return ([rng.integers(3, 500, size=int(rng.integers(3, 40))).tolist() for _ in range(14)]
            + [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 8])


@contextlib.contextmanager
def plain(llm):
    """The same engine without speculation (its steps are then the plain steps)."""
    eng = llm.llm_engine
    spec, eng.speculator = eng.speculator, None
    try:
        yield
    finally:
        eng.speculator = spec


def counters(llm) -> dict:
    sd = llm.llm_engine.stats().spec_decode
    return {**dataclasses.asdict(sd),
            "num_accepted_tokens_per_pos": list(sd.num_accepted_tokens_per_pos)}


def gen(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_matches_transformers_under_preemption(llm, tiny_llama, prompts):
    from test_engine import hf_greedy

    before = counters(llm)
    outs = gen(llm, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    after = counters(llm)
    assert ids(outs) == hf_greedy(tiny_llama, prompts, 24)
    assert after["num_accepted_tokens"] > before["num_accepted_tokens"]
    eng = llm.llm_engine
    assert eng.scheduler.num_preemptions > 0 and eng.kv_cache_manager.usage == 0.0


def test_seeded_sampling_is_token_for_token_plain(llm, prompts):
    """Every sampling parameter, logprobs included: token i uses the uniform of (seed, i) on
    the same distribution with or without drafts, so the outputs are identical."""
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=32, logprobs=2,
                             top_k=[0, 20][i % 2], top_p=[1.0, 0.9][i % 3 % 2],
                             min_p=0.02 * (i % 2), frequency_penalty=0.3 * (i % 3 == 0),
                             logit_bias={7: 1.5}, min_tokens=3, **COPY)
              for i in range(len(prompts))]
    # All prompts (the KV cache is tight: preemptions, drafts cut short), then two alone.
    before = counters(llm)
    spec = gen(llm, prompts, params) + gen(llm, prompts[-2:], params[-2:])
    after = counters(llm)
    with plain(llm):
        want = gen(llm, prompts, params) + gen(llm, prompts[-2:], params[-2:])
    assert ids(spec) == ids(want)
    for a, b in zip(spec, want):  # the same up to the batch's rounding
        for got, ref in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert got.keys() == ref.keys()
            assert [lp.rank for lp in got.values()] == [lp.rank for lp in ref.values()]
            np.testing.assert_allclose([lp.logprob for lp in got.values()],
                                       [lp.logprob for lp in ref.values()], atol=1e-3)
    per_pos = np.subtract(after["num_accepted_tokens_per_pos"],
                          before["num_accepted_tokens_per_pos"])
    # Drafts were accepted on sampled rows: the rows after them were sampled with the
    # penalties and uniforms of their position, and still match the plain tokens.
    assert per_pos[0] > 0


def test_sampled_distribution_equals_plain(llm):
    """Unseeded outputs are draws: a two-sample chi-square test on the second and third
    tokens (each over its 7 commonest values and the rest) between disjoint seed ranges."""
    n, prompt = 400, [[5, 6, 7, 8] * 5]
    params = lambda first: [SamplingParams(temperature=1.0, top_k=6, max_tokens=3, seed=first + i,  # noqa
                                           **COPY) for i in range(n)]
    with plain(llm):
        want = np.array(ids(gen(llm, prompt * n, params(0))))
    before = counters(llm)
    got = np.array(ids(gen(llm, prompt * n, params(n))))
    assert counters(llm)["num_accepted_tokens"] > before["num_accepted_tokens"]
    for pos in (1, 2):
        values, counts = np.unique(np.r_[want[:, pos], got[:, pos]], return_counts=True)
        top = values[np.argsort(-counts)[:7]]
        table = np.array([[np.sum(x[:, pos] == v) for v in top] + [np.sum(~np.isin(x[:, pos], top))]
                          for x in (want, got)], float)
        table = table[:, table.sum(0) > 0]
        expect = table.sum(0) * 0.5  # equal sample sizes
        chi2 = ((table - expect) ** 2 / expect).sum()
        assert table.shape[1] >= 4, "the test needs several outcomes"
        assert chi2 < 29.9  # <= 7 dof, P(chi2 > 29.9) <= 1e-4


def test_mixed_batch_grammar_logprobs_and_drafts(llm, prompts):
    """Rows with a grammar take no drafts, rows with logprobs or n > 1 do; all in one batch."""
    params = [SamplingParams(temperature=0.0, max_tokens=20, **COPY),
              SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=SO(
                  choice=["Paris", "London"])),
              SamplingParams(temperature=0.7, seed=5, max_tokens=20, logprobs=1,
                             prompt_logprobs=1, **COPY),
              SamplingParams(temperature=0.7, seed=9, n=2, max_tokens=20, **COPY)]
    ps = prompts[-2:] + prompts[:2]
    seen = []
    remove = llm.llm_engine.runner.add_step_hook(
        lambda e: e.kind == "dispatch" and seen.append(
            [(s.seq.grammar is not None, len(s.spec_token_ids)) for s in e.steps[0].sched.scheduled]))
    try:
        spec = gen(llm, ps, params)
    finally:
        remove()
    with plain(llm):
        want = gen(llm, ps, params)
    assert [[o.token_ids for o in r.outputs] for r in spec] == \
        [[o.token_ids for o in r.outputs] for r in want]
    assert spec[1].outputs[0].text in ("Paris", "London")
    assert spec[2].prompt_logprobs is not None and spec[2].prompt_logprobs[1:] == \
        want[2].prompt_logprobs[1:]
    assert all(n == 0 for step in seen for g, n in step if g)
    assert any(g for step in seen for g, _ in step)
    assert any(n > 0 and any(g for g, _ in step) for step in seen for _, n in step)


def accepted_runs(llm, prompts, params):
    """The outputs, and per output the indices emitted as accepted drafts (not a run's last
    token, so a stop there must drop the rest of the run)."""
    runs = []
    remove = llm.llm_engine.runner.add_step_hook(
        lambda e: e.kind == "collect" and runs.extend(
            (s.seq.seq_id, s.out_index, len(e.sampled[s.seq.seq_id]))
            for s in e.steps[0].sched.scheduled if len(e.sampled.get(s.seq.seq_id, ())) > 1))
    try:
        outs = gen(llm, prompts, params)
    finally:
        remove()
    inside = {o.request_id: set() for o in outs}
    for seq_id, start, n in runs:
        inside[seq_id].update(range(start, start + n - 1))
    return [(o.outputs[0], sorted(inside[o.request_id])) for o in outs]


def test_stops_and_max_tokens_inside_an_accepted_run(llm, prompts):
    def params(max_tokens=40, **kw):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, **COPY, **kw)

    def run(prompt, **kw):
        return gen(llm, [prompt], params(**kw))[0].outputs[0]

    runs = accepted_runs(llm, prompts, params())
    # A stop token first output inside an accepted run (not as its last token).
    p, tokens, idx = next((p, o.token_ids, i) for p, (o, inside) in zip(prompts, runs)
                          for i in inside if o.token_ids.index(o.token_ids[i]) == i)
    out = run(p, stop_token_ids=[tokens[idx]])
    assert out.token_ids == tokens[:idx + 1] and out.finish_reason == "stop"
    out = run(p, max_tokens=idx + 1)
    assert out.token_ids == tokens[:idx + 1] and out.finish_reason == "length"
    # A stop string ending inside a run: the run's tokens after it are dropped.
    tok = llm.get_tokenizer()
    p, o, i, prefix = next(
        (p, o, i, t) for p, (o, inside) in zip(prompts, runs) for i in inside
        for t in [tok.decode(o.token_ids[:i + 1])]
        if o.text.startswith(t) and t[-2:].strip() and "\ufffd" not in t[-2:])
    stop, text = prefix[-2:], o.text
    out = run(p, stop=[stop])
    assert out.text == text[:text.index(stop)] and out.finish_reason == "stop"
    assert len(out.token_ids) <= i + 1 and out.token_ids == o.token_ids[:len(out.token_ids)]


def test_prefix_cache_only_holds_accepted_tokens(llm, prompts):
    """A second request whose prompt is the first's prompt plus output hits the cache for
    the blocks the first wrote, drafts included, and decodes as without the cache."""
    p = SamplingParams(temperature=0.0, max_tokens=30, **COPY)
    first = gen(llm, [prompts[-1]], p)[0].outputs[0].token_ids
    again = gen(llm, [prompts[-1] + first], p)[0]
    assert again.num_cached_tokens >= 4 * ((len(prompts[-1]) + len(first) - 1) // 4) - 4
    llm.llm_engine.kv_cache_manager.reset_prefix_cache()
    cold = gen(llm, [prompts[-1] + first], p)[0]
    assert cold.num_cached_tokens == 0
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids


def test_metrics_exposition(llm, prompts):
    from serving.metrics import ServerMetrics

    gen(llm, prompts[-2:], SamplingParams(temperature=0.0, max_tokens=20, **COPY))
    s = counters(llm)
    text = ServerMetrics(llm.llm_engine, "m").exposition().decode()
    assert s["num_drafts"] > 0 and s["num_accepted_tokens"] > 0
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f'vllm:spec_decode_{name}_total{{model_name="m"}} {float(s[name])}' in text
    for pos, n in enumerate(s["num_accepted_tokens_per_pos"]):
        assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",'
                f'position="{pos}"}} {float(n)}') in text
    assert sum(s["num_accepted_tokens_per_pos"]) == s["num_accepted_tokens"]


def test_overlapped_steps_between_drafted_ones_keep_the_outputs(llm, tiny_llama, prompts):
    """With prompt_lookup_min 2 a step overlaps the one in flight whenever lookup cannot
    match (async scheduling kept); drafted steps are read first. Greedy tokens as plain."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with plain(llm):
        want = ids(gen(llm, prompts, greedy))
    overlap = LLM(tiny_llama, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
                  block_size=4, num_gpu_blocks_override=64, use_tqdm_on_load=False, seed=0,
                  disable_log_stats=True, async_scheduling=True,
                  speculative_config={**NGRAM, "prompt_lookup_min": 2})
    chained = []
    overlap.llm_engine.runner.add_step_hook(
        lambda e: chained.append(e.chained) if e.kind == "dispatch" else None)
    assert ids(gen(overlap, prompts, greedy)) == want
    assert counters(overlap)["num_accepted_tokens"] > 0
    assert True in chained and False in chained


@pytest.mark.slow  # loads and compiles the real default model (~1 min)
def test_default_model_greedy_with_accepted_drafts():
    """SmolLM2: greedy outputs with n-gram drafts equal those without, on prompts that make
    it repeat text (drafts accepted, runs of several tokens) and on open ones."""
    llm = LLM(dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
              use_tqdm_on_load=False, disable_log_stats=True,
              speculative_config={**NGRAM, "num_speculative_tokens": 4})
    text = ("The quick brown fox jumps over the lazy dog. Speculative decoding checks several "
            "guessed tokens in one step of the model.")
    chats = [[{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}],
             [{"role": "user", "content": "Write a short poem about the sea."}]]
    tok = llm.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False) for c in chats]
    prompts += [tok.encode("def fibonacci(n):")]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    before = counters(llm)
    spec = ids(gen(llm, prompts, params))
    after = counters(llm)
    with plain(llm):
        want = ids(gen(llm, prompts, params))
    assert spec == want
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    drafts = after["num_drafts"] - before["num_drafts"]
    assert drafts > 0 and accepted > 0
    assert after["num_accepted_tokens_per_pos"][3] > 0  # whole runs of 4 drafts accepted


@pytest.mark.slow  # three engines and a draft compile: ~30 s
def test_draft_model_through_the_engine(make_tiny_checkpoint):
    """--speculative-config {"model": ...}: the target as its own draft has every draft
    accepted; a smaller random draft (same vocabulary) almost none; both give plain decoding's
    tokens, greedy and seeded, and the draft's cache is empty once the requests finish."""
    target = make_tiny_checkpoint("llama", seed=3)
    small = make_tiny_checkpoint("llama", seed=7, num_hidden_layers=1, hidden_size=32,
                                 intermediate_size=48, num_attention_heads=2,
                                 num_key_value_heads=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in (5, 17, 9, 30, 3)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True)]
    args = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, block_size=4,
                max_model_len=128, use_tqdm_on_load=False, disable_log_stats=True)

    def run(spec):
        llm = LLM(target, **args, **({"speculative_config": spec} if spec else {}))
        out = [ids(gen(llm, prompts, params[0]))]
        greedy = counters(llm) if spec else None  # after the greedy requests only
        return out + [ids(gen(llm, prompts, params[1]))], greedy, llm

    want, _, _ = run(None)
    for draft in (target, small):
        got, greedy, llm = run({"model": draft, "num_speculative_tokens": 3})
        assert got == want, draft
        assert greedy["num_draft_tokens"] > 0
        if draft == target:  # greedy drafts of the same weights: all accepted
            assert greedy["num_accepted_tokens"] == greedy["num_draft_tokens"]
        else:
            assert greedy["num_accepted_tokens"] < greedy["num_draft_tokens"]
        proposer = llm.llm_engine.speculator.proposer
        assert proposer.kv.num_free_blocks == proposer.kv.num_blocks
