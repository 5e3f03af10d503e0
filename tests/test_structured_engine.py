"""Structured output, bad_words, truncate_prompt_tokens and output_kind through the engine, on
the tiny random Llama (its byte-level BPE tokenizer spells any text): constrained outputs
match their constraint, free requests batched with constrained ones get the tokens they get
alone, and a grammar that dead-ends finishes with "error" instead of hanging."""

from __future__ import annotations

import json
import re

import pytest

from jaxllm import LLM, GuidedDecodingParams, SamplingParams
from jaxllm.sampling_params import RequestOutputKind
from jaxllm.structured_output import StructuredOutputsParams as SO

FREE = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = ["The capital of France", "Hello world, how", "Once upon a time", "What is 2 + 2?"]


def tiny(path, **kw):
    return LLM(path, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, block_size=4,
               use_tqdm_on_load=False, seed=0, disable_log_stats=True, **kw)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return tiny(tiny_llama)


def texts(outs):
    return [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("so, check", [
    (SO(regex=r"\d{4}-\d{2}-\d{2}"), lambda t: re.fullmatch(r"\d{4}-\d{2}-\d{2}", t)),
    (SO(choice=["Paris", "London", "Rome"]), lambda t: t in ("Paris", "London", "Rome")),
    (SO(grammar='root ::= "yes" | "no" | "maybe so"'), lambda t: t in ("yes", "no", "maybe so")),
    (SO(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}, disable_any_whitespace=True),
     lambda t: isinstance(json.loads(t)["n"], int)),
])
def test_constrained_outputs_match_and_stop(llm, so, check):
    """Greedy and random sampling both give a complete match that ends with "stop"."""
    for sp in (SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so),
               SamplingParams(temperature=1.0, seed=3, max_tokens=40, guided_decoding=so)):
        for out in llm.generate(PROMPTS, sp, use_tqdm=False):
            o = out.outputs[0]
            assert check(o.text), o.text
            assert o.finish_reason == "stop", (o.text, o.finish_reason)


def test_free_requests_unchanged_by_constrained_neighbours(llm):
    """A mixed batch: the free rows' tokens are those they get in a batch of their own."""
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, FREE, use_tqdm=False)]
    guided = SamplingParams(temperature=0.0, max_tokens=10,
                            structured_outputs=SO(regex="[a-z ]{1,30}"))
    mixed = llm.generate([p for p in PROMPTS for _ in (0, 1)],
                         [sp for _ in PROMPTS for sp in (FREE, guided)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[::2]] == alone
    assert all(re.fullmatch("[a-z ]{1,30}", o.outputs[0].text) for o in mixed[1::2])


@pytest.mark.parametrize("steps", [1, pytest.param(4, marks=pytest.mark.slow)])  # compiles
def test_async_and_multi_step_engines_mix_grammar_and_free_requests(llm, tiny_llama, steps):
    """With async scheduling (and 4-step bursts), free requests batched with constrained ones
    (which run their steps one at a time, read before the next) get the tokens of the plain
    engine, and the constrained ones still match."""
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, FREE, use_tqdm=False)]
    fast = tiny(tiny_llama, async_scheduling=True, num_scheduler_steps=steps)
    fast.llm_engine.wait_for_background_compiles()
    guided = SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=SO(regex="[a-z]+"))
    mixed = fast.generate(PROMPTS + PROMPTS[:2], [FREE] * 4 + [guided] * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == expected
    assert all(re.fullmatch("[a-z]+", o.outputs[0].text) for o in mixed[4:])
    alone = fast.generate(PROMPTS, FREE, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == expected


def test_a_dead_end_finishes_with_error(llm):
    """allowed_token_ids leaves no token the grammar accepts: the request ends at once with
    finish_reason "error" and the matcher's message, it does not hang."""
    tok = llm.get_tokenizer()
    only = tok.encode("b", add_special_tokens=False)
    sp = SamplingParams(temperature=0.0, max_tokens=20, allowed_token_ids=only,
                        structured_outputs=SO(regex="a+"))
    o = llm.generate("x", sp, use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "error" and "grammar" in o.stop_reason
    assert len(o.token_ids) == 1


def test_an_uncompilable_constraint_is_refused_by_name(llm):
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate("x", SamplingParams(structured_outputs=SO(regex="(unclosed")),
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_bad_words_are_never_completed(llm):
    """Ban the first two tokens of the free greedy output as one word: the output changes, and
    neither the word nor its spaced spelling is ever produced."""
    tok = llm.get_tokenizer()
    base = llm.generate(PROMPTS[0], FREE, use_tqdm=False)[0].outputs[0]
    word = tok.decode(base.token_ids[:2])
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, bad_words=[word])
    out = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0]
    banned = sp.clone()
    banned.update_from_tokenizer(tok)
    assert out.token_ids != base.token_ids
    ids = out.token_ids
    for w in banned.bad_words_token_ids:
        assert not any(ids[i:i + len(w)] == w for i in range(len(ids))), (w, ids)


def test_bad_words_tokenization_follows_vllm():
    """Each word alone, plus its spaced spelling when that differs and has as many tokens."""
    class Tok:
        table = {"foo": [1], " foo": [2], "a b": [3, 4], " a b": [5, 6, 7], "x": [8], " x": [8]}

        def encode(self, text, add_special_tokens=False):
            return self.table[text]

    sp = SamplingParams(bad_words=["foo", " a b", "x"])
    sp.update_from_tokenizer(Tok())
    assert sp.bad_words_token_ids == [[1], [2], [3, 4], [8]]


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    k = 3
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                      truncate_prompt_tokens=k), use_tqdm=False)[0]
    ref = llm.generate({"prompt_token_ids": ids[-k:]},
                       SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-k:]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    full = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert full.prompt_token_ids == ids  # -1 = max_model_len: nothing cut here
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def _engine_outputs(llm, sp):
    engine = llm.llm_engine
    engine.add_request("kind", PROMPTS[2], sp)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


@pytest.mark.parametrize("kind", ["delta", RequestOutputKind.DELTA])
def test_delta_outputs_concatenate_to_the_cumulative_one(llm, kind):
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    cumulative = _engine_outputs(llm, sp)
    deltas = _engine_outputs(llm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                 logprobs=1, output_kind=kind))
    assert len(deltas) == len(cumulative) > 1
    final = cumulative[-1].outputs[0]
    assert "".join(d.outputs[0].text for d in deltas) == final.text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == final.token_ids
    assert sum((d.outputs[0].logprobs for d in deltas), []) == final.logprobs
    assert all(len(d.outputs[0].token_ids) == 1 for d in deltas)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]


def test_final_only_outputs_come_once(llm):
    cumulative = _engine_outputs(llm, SamplingParams(temperature=0.0, max_tokens=6,
                                                     ignore_eos=True))
    final = _engine_outputs(llm, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                output_kind="final_only"))
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == cumulative[-1].outputs[0].token_ids
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="partial")


def test_llm_returns_final_outputs_for_every_kind(llm):
    """As vLLM's LLM: generate returns each request's complete output whatever output_kind."""
    outs = {k: llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6,
                                                    output_kind=k), use_tqdm=False)
            for k in ("cumulative", "delta", "final_only")}
    assert texts(outs["delta"]) == texts(outs["cumulative"]) == texts(outs["final_only"])


def test_guided_decoding_alias_is_the_same_constraint():
    c = GuidedDecodingParams(choice=["a", "b"])
    assert SamplingParams(guided_decoding=c).structured_outputs is c
