"""SamplingParams.prompt_logprobs end to end through `LLM`: raw log-softmax of every prompt
position, checked against transformers, with chunked prefill, prefix caching, preemption and
n > 1, and no compilation counted after warm-up (the prompt-logprobs program is compiled on
first use)."""

from __future__ import annotations

import pytest

from jaxllm import SamplingParams
from test_engine import mixed_prompts, small_llm

TOL = 1e-4


@pytest.fixture(autouse=True)
def _fail_on_recompile(monkeypatch):
    monkeypatch.setenv("JAXLLM_FAIL_ON_RECOMPILE", "1")


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return small_llm(tiny_llama)


def params(k, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 2, "ignore_eos": True,
                             "prompt_logprobs": k, **kw})


def check_against_hf(hf_model, prompt: list[int], positions, k: int) -> None:
    """positions (RequestOutput.prompt_logprobs) hold, at i >= 1, prompt[i]'s logprob and rank
    under transformers' log_softmax of the logits at i - 1, plus its top k ids and values."""
    import torch

    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    assert len(positions) == len(prompt) and positions[0] is None
    for i in range(1, len(prompt)):
        entry, row, tok = positions[i], ref[i - 1], prompt[i]
        assert abs(entry[tok].logprob - float(row[tok])) < TOL, i
        # vLLM's rank: tokens at least as likely (near-ties within TOL may go either way)
        lo, hi = int((row > row[tok] + TOL).sum()) + 1, int((row >= row[tok] - TOL).sum())
        assert lo <= entry[tok].rank <= hi, i
        assert isinstance(entry[tok].decoded_token, str)
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k)
        values, ids = torch.topk(row, k)
        assert [t for _, t, _ in top] == ids.tolist(), i
        assert [r for r, _, _ in top] == list(range(1, k + 1))
        for (_, _, lp), v in zip(top, values.tolist()):
            assert abs(lp - v) < TOL, i
        assert len(entry) == k + (entry[tok].rank > k)


def test_prompt_logprobs_match_transformers(llm, hf_model):
    prompts = mixed_prompts(4, seed=3, lo=2, hi=40) + [[7]]
    ks = [3, 0, 5, 1, 2]
    # Mixed with requests that do not ask: those get None and are unaffected.
    plain = mixed_prompts(2, seed=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + plain],
                        [params(k) for k in ks] + [params(None)] * 2, use_tqdm=False)
    for p, k, out in zip(prompts, ks, outs):
        check_against_hf(hf_model, p, out.prompt_logprobs, k)
    alone = llm.generate([{"prompt_token_ids": p} for p in plain], params(None), use_tqdm=False)
    for out, ref in zip(outs[len(prompts):], alone):
        assert out.prompt_logprobs is None
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert llm.llm_engine.runner.num_recompiles == 0
    programs = llm.llm_engine.runner.compile_manager.programs()
    assert any(key.kind == "prompt_logprobs" for key in programs)


def test_prompt_logprobs_with_chunked_prefill(tiny_llama, hf_model):
    llm = small_llm(tiny_llama, max_num_batched_tokens=16)
    prompt = mixed_prompts(1, seed=5, lo=60, hi=61)[0]
    computed = []  # prompt positions returned per step
    llm.llm_engine.runner.add_step_hook(lambda e: e.kind == "collect" and computed.append(
        sum(len(v[1]) for v in e.prompt_logprobs.values())))
    out = llm.generate({"prompt_token_ids": prompt}, params(4), use_tqdm=False)[0]
    assert computed[:4] == [16, 16, 16, 11] and sum(computed) == len(prompt) - 1
    check_against_hf(hf_model, prompt, out.prompt_logprobs, 4)
    assert llm.llm_engine.runner.num_recompiles == 0


def test_prefix_cache_hits_are_skipped_but_blocks_published(llm, hf_model):
    llm.llm_engine.kv_cache_manager.reset_prefix_cache()
    shared = mixed_prompts(1, seed=7, lo=33, hi=34)[0]
    first, second = shared + [11, 12, 13], shared + [21, 22]
    a = llm.generate({"prompt_token_ids": first}, params(2), use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": second}, params(2), use_tqdm=False)[0]
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    check_against_hf(hf_model, second, b.prompt_logprobs, 2)
    for pa, pb in zip(a.prompt_logprobs[1:len(shared)], b.prompt_logprobs[1:len(shared)]):
        assert pa.keys() == pb.keys()
        assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-5 and pa[t].rank == pb[t].rank
                   for t in pa)
    # Their blocks were published: a request without prompt_logprobs hits the 8 full blocks.
    c = llm.generate({"prompt_token_ids": shared + [31, 32]}, params(None), use_tqdm=False)[0]
    assert c.num_cached_tokens == 32


def test_preemption_keeps_prompt_logprobs(tiny_llama, hf_model, monkeypatch):
    # 256 KV slots for 8 running sequences of up to ~60 tokens: some are preempted, some before
    # their first token (prompt positions recomputed), some after (prefix cache hits allowed).
    llm = small_llm(tiny_llama, num_gpu_blocks_override=64)
    sched = llm.llm_engine.scheduler
    victims = []  # output tokens of each preempted request when preempted
    schedule = sched.schedule

    def watched(*args, **kw):  # a step's preemptions, read off its public SchedulerOutput
        out = schedule(*args, **kw)
        victims.extend(sched.seqs[sid].num_output_tokens for sid in out.preempted_ids)
        return out

    monkeypatch.setattr(sched, "schedule", watched)
    prompts = mixed_prompts(16, seed=9, lo=25, hi=40)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        params(2, max_tokens=24), use_tqdm=False)
    assert 0 in victims and any(victims)
    for p, out in zip(prompts, outs):
        check_against_hf(hf_model, p, out.prompt_logprobs, 2)
    assert llm.llm_engine.runner.num_recompiles == 0


def test_n2_computes_once_and_reports_on_the_request(llm, hf_model):
    prompt = mixed_prompts(1, seed=8, lo=20, hi=21)[0]
    computed = []
    remove = llm.llm_engine.runner.add_step_hook(lambda e: e.kind == "collect" and computed.extend(
        (sid, len(v[1])) for sid, v in e.prompt_logprobs.items()))
    try:
        out = llm.generate({"prompt_token_ids": prompt},
                           params(3, n=2, temperature=1.0, seed=1, max_tokens=4),
                           use_tqdm=False)[0]
    finally:
        remove()
    assert len(out.outputs) == 2
    assert {sid for sid, _ in computed} == {f"0_{out.request_id}"}
    assert sum(n for _, n in computed) == len(prompt) - 1
    check_against_hf(hf_model, prompt, out.prompt_logprobs, 3)


def test_prompt_logprobs_above_max_logprobs_fail(llm):
    limit = llm.llm_engine.args.max_logprobs
    with pytest.raises(ValueError, match=rf"prompt_logprobs={limit + 1}"):
        llm.generate("hi", params(limit + 1), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    assert not llm.llm_engine.has_unfinished_requests()
