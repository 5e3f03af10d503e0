"""Beam search (`LLM.beam_search`, vLLM's algorithm) against transformers' `num_beams`.

What matches: with no beam ending in EOS (transformers' min_new_tokens = max_tokens, ours
ignore_eos), both keep the globally best beam_width extensions each step, so the beams, their
order and their cumulative logprobs agree for any length_penalty (transformers reports
sum / generated_len ** length_penalty; every beam has the same length). What differs by
design: where EOS ends beams, vLLM's score divides by the whole length (prompt included) and
completes every EOS candidate, transformers by the generated length within its top 2W —
the EOS rules are tested here against vLLM's formula instead.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM
from jaxllm.entrypoints.beam_search import BeamSearch, BeamSearchParams, beam_score
from jaxllm.outputs import Logprob

NEW = 6
WIDTH = 3


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", block_size=4, use_tqdm_on_load=False,
               disable_log_stats=True, enforce_eager=True, max_num_seqs=16,
               max_num_batched_tokens=256)


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 500, n).tolist() for n in (5, 11)]


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_beam_search_matches_transformers(llm, tiny_llama, length_penalty):
    import torch
    from transformers import AutoModelForCausalLM

    params = BeamSearchParams(beam_width=WIDTH, max_tokens=NEW, ignore_eos=True,
                              length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in _prompts()], params)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for p, out in zip(_prompts(), outs):
        ref = model.generate(torch.tensor([p]), num_beams=WIDTH, num_return_sequences=WIDTH,
                             max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             length_penalty=length_penalty, early_stopping=True,
                             output_scores=True, return_dict_in_generate=True)
        assert [s.tokens[len(p):] for s in out.sequences] == ref.sequences[:, len(p):].tolist()
        assert all(s.tokens[:len(p)] == p for s in out.sequences)
        np.testing.assert_allclose([s.cum_logprob for s in out.sequences],
                                   ref.sequences_scores.numpy() * NEW ** length_penalty,
                                   atol=1e-4)
        assert all(s.finish_reason == "length" and len(s.logprobs) == NEW
                   for s in out.sequences)


def test_beam_search_text_and_refusals(llm):
    out = llm.beam_search("hello", BeamSearchParams(beam_width=2, max_tokens=3))[0]
    tok = llm.get_tokenizer()
    for s in out.sequences:
        prompt_len = len(s.tokens) - len(s.logprobs)
        gen = s.tokens[prompt_len:]
        if s.finish_reason == "stop":
            gen = gen[:-1]
        assert s.text == tok.decode(gen)
    with pytest.raises(ValueError, match="--max-logprobs"):
        llm.beam_search("hello", BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=2)


def test_eos_completes_a_beam_scored_as_vllm():
    """A candidate ending in EOS completes; the final ranking divides by the length without
    the EOS, prompt included (vLLM's get_beam_search_score)."""
    eos = 9
    search = BeamSearch([[1, 2]], BeamSearchParams(beam_width=1, max_tokens=2,
                                                   length_penalty=1.0), {eos}, 100, 20)
    assert search.pending() == [[1, 2]]
    search.advance([{eos: Logprob(-0.1), 5: Logprob(-0.5)}])
    assert search.pending() == [[1, 2, 5]]
    search.advance([{6: Logprob(-2.0)}])
    assert search.done
    best = search.outputs(None)[0].sequences
    # [1, 2, EOS]: -0.1 / 2 = -0.05 beats [1, 2, 5, 6]: -2.5 / 4.
    assert best[0].tokens == [1, 2, eos] and best[0].finish_reason == "stop"
    assert beam_score([1, 2, eos], -0.1, {eos}, 1.0) == pytest.approx(-0.05)
    assert beam_score([1, 2, 5, 6], -2.5, {eos}, 1.0) == pytest.approx(-0.625)
