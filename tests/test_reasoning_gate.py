"""Structured output after the reasoning (issues 48, 51): with --reasoning-parser, a constraint
starts where the model's reasoning ends, as vLLM applies it (`ReasoningGate`,
jaxllm/structured_output/params.py; the matcher's phases in backend.py; each parser's
`grammar_gate` reads its markers and the prompt)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.structured_output import ReasoningGate, StructuredOutputsParams

CHOICE = StructuredOutputsParams(choice=["yes", "no"])


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def marks(tok):
    """Two single-character tokens that can begin neither "yes" nor "no" (so the grammar
    bans them): stand-ins for a reasoning's opening and closing tags."""
    picks = [i for t, i in sorted(tok.get_vocab().items())
             if len(t) == 1 and t.isalpha() and t not in "yn" and i < 512]
    return picks[0], picks[1]


def banned(bits: np.ndarray, token: int) -> bool:
    return bool(bits[0, token // 32] >> np.uint32(token % 32) & 1)


def test_matcher_phases(tok, marks):
    from jaxllm.structured_output.backend import fill_banned_bits, get_compiler

    o, c = marks
    compiled = get_compiler(tok, 512).compile(CHOICE)
    words = -(-512 // 32)
    yes = tok.encode("yes", add_special_tokens=False)

    m = compiled.matcher(ReasoningGate((c,), o))
    bits = np.zeros((1, words), np.uint32)
    fill_banned_bits([(m, 0)], bits)
    assert not banned(bits, o) and banned(bits, c) and not banned(bits, yes[0])
    assert m.accept(o) and m.phase == "reasoning"
    bits[:] = 0
    fill_banned_bits([(m, 0)], bits)
    assert not bits.any()  # inside the reasoning nothing is banned
    assert m.accept(o) and m.accept(yes[0]) and not m.is_error()  # and nothing is fed
    assert m.accept(c) and m.phase is None
    fill_banned_bits([(m, 0)], bits)
    assert banned(bits, c) and banned(bits, o) and not banned(bits, yes[0])
    assert m.accept_tokens(yes) and m.is_accepting()

    # A first token that does not open the reasoning is the constraint's: no reasoning.
    m = compiled.matcher(ReasoningGate((c,), o))
    assert m.accept(yes[0]) and m.phase is None and not m.accept(o) and m.is_error()
    # The prompt opened it: the model starts inside, until the closing token.
    m = compiled.matcher(ReasoningGate((c,), inside=True))
    assert m.phase == "reasoning" and m.accept(o) and m.accept(c) and m.phase is None
    with pytest.raises(ValueError, match="opening"):
        ReasoningGate((c,))


def test_engine_applies_the_constraint_after_the_gate(tiny_llama, tok, marks):
    """Through the engine: a gate the prompt opened lets the (biased) closing token through
    first, then the choice constrains; an opening first token keeps the output unconstrained
    (reasoning to max_tokens); without a gate the closing token can never come."""
    o, c = marks
    llm = LLM(tiny_llama, dtype="float32", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=64)
    prompt = {"prompt_token_ids": [1, 5, 9, 13]}

    def run(gate, bias):
        so = StructuredOutputsParams(choice=["yes", "no"], after_reasoning=gate)
        return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8,
                                                   structured_outputs=so, logit_bias=bias),
                            use_tqdm=False)[0].outputs[0]

    inside = run(ReasoningGate((c,), inside=True), {c: 100.0})
    assert inside.token_ids[0] == c and tok.decode(inside.token_ids[1:]) in ("yes", "no")
    assert inside.finish_reason == "stop"
    opened = run(ReasoningGate((c,), o), {o: 100.0})
    assert opened.token_ids == [o] * 8 and opened.finish_reason == "length"
    plain = run(None, {c: 100.0})
    assert c not in plain.token_ids and plain.text in ("yes", "no")


def test_parsers_gates(tok):
    """The think-tag formats read the prompt from its end, as vLLM's parsers: </think> last
    closes the reasoning (no gate), <think> last puts the model inside it, neither lets the
    first token open it; a tokenizer without the tags as single tokens gives no gate."""
    from jaxllm.entrypoints.openai_parsers.reasoning_parsers import get_reasoning_parser

    qwen3 = get_reasoning_parser("qwen3")
    assert qwen3(tok).grammar_gate([1, 2, 3]) is None  # no <think> token in this vocabulary
    tagged = type(tok).from_pretrained(tok.name_or_path)
    tagged.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    start, end = tagged.convert_tokens_to_ids(["<think>", "</think>"])
    p = qwen3(tagged)
    assert p.grammar_gate([1, 2]) == ReasoningGate((end,), start)
    assert p.grammar_gate([1, start, 2]) == ReasoningGate((end,), start, inside=True)
    assert p.grammar_gate([1, start, 2, end, 3]) is None  # enable_thinking=False's prompt
    assert p.grammar_gate([start, 4, end, 5, start]).inside  # a new reasoning opened last
    v3 = get_reasoning_parser("deepseek_v3")
    assert v3(tagged).grammar_gate([1]) is None  # thinks only when asked
    assert v3(tagged, chat_template_kwargs={"thinking": True}).grammar_gate([1]) is not None
    assert get_reasoning_parser("granite")(tagged).grammar_gate([1]) is None
