"""Reasoning parsers: <think>...</think> split into reasoning and content, whole and streamed
(the deltas join to exactly the whole-output split, whatever the chunking)."""

import random

import pytest

from jaxllm.entrypoints.openai_parsers.reasoning_parsers import (REASONING_PARSERS,
                                                                 get_reasoning_parser)

THOUGHT = "The user wants 2+2. <b>Basic</b> arithmetic: 4."
# (parser, output, reasoning, content)
CASES = [
    ("deepseek_r1", f"{THOUGHT}</think>\n\nThe answer is 4.", THOUGHT, "\n\nThe answer is 4."),
    ("deepseek_r1", f"<think>{THOUGHT}</think>The answer is 4.", THOUGHT, "The answer is 4."),
    ("deepseek_r1", f"<think>\n{THOUGHT}\n</think>", f"\n{THOUGHT}\n", None),
    ("deepseek_r1", f"{THOUGHT} and I was cut off", f"{THOUGHT} and I was cut off", None),
    ("deepseek_r1", "</think>Straight to it.", None, "Straight to it."),
    ("deepseek_r1", "a </thin b</think>c <think> d", "a </thin b", "c <think> d"),
    ("qwen3", f"<think>\n{THOUGHT}\n</think>\n\nThe answer is 4.", f"\n{THOUGHT}\n",
     "\n\nThe answer is 4."),
    ("qwen3", "The answer is 4.", None, "The answer is 4."),  # thinking switched off
    ("qwen3", "<think>\n\n</think>\n\nThe answer is 4.", "\n\n", "\n\nThe answer is 4."),
    ("qwen3", f"<think>{THOUGHT} still thinking", f"{THOUGHT} still thinking", None),
    ("qwen3", "x < y and <thin is no tag", None, "x < y and <thin is no tag"),
]


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_extract(name, text, reasoning, content):
    assert get_reasoning_parser(name)().extract(text) == (reasoning, content)


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_stream_joins_to_extract(name, text, reasoning, content):
    rng = random.Random(len(text))
    chunkings = [[text], list(text)]
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 10)))
        chunkings.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    for chunks in chunkings:
        p, cur, deltas = get_reasoning_parser(name)(), "", []
        for c in chunks:
            prev, cur = cur, cur + c
            deltas.append(p.extract_delta(prev, cur, c))
        deltas.append(p.flush(cur))
        deltas = [d for d in deltas if d is not None]
        assert all(d and set(d) <= {"reasoning", "content"} for d in deltas)
        joined = tuple("".join(d.get(k, "") for d in deltas) or None
                       for k in ("reasoning", "content"))
        assert joined == (reasoning, content)


def test_qwen3_thinking_2507_output_without_start_tag():
    """The template put <think> in the prompt: whole-output parsing splits at </think>, as
    vLLM does (streaming cannot, see qwen3.py: deepseek_r1 serves these models)."""
    text = f"{THOUGHT}</think>The answer is 4."
    assert get_reasoning_parser("qwen3")().extract(text) == (THOUGHT, "The answer is 4.")
    assert get_reasoning_parser("deepseek_r1")().extract(text) == (THOUGHT, "The answer is 4.")
    p = get_reasoning_parser("qwen3")()  # streamed: all content, nothing sent twice
    assert p.extract_delta("", text, text) == {"content": text} and p.flush(text) is None


def test_markers_are_never_streamed_as_text():
    p = get_reasoning_parser("deepseek_r1")()
    assert p.extract_delta("", "<thi", "<thi") is None
    assert p.extract_delta("<thi", "<think>Hm</", "nk>Hm</") == {"reasoning": "Hm"}
    assert p.extract_delta("<think>Hm</", "<think>Hm</think>OK", "think>OK") == {"content": "OK"}


def test_reasoning_end_and_registry():
    r1, q3 = get_reasoning_parser("deepseek_r1")(), get_reasoning_parser("qwen3")()
    assert not r1.is_reasoning_end("still thinking") and r1.is_reasoning_end("a</think>")
    assert q3.is_reasoning_end("no thinking at all") and not q3.is_reasoning_end("<think>hm")
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "openai_gptoss", "deepseek_v3",
                                      "glm45", "granite"}
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'.*deepseek_r1"):
        get_reasoning_parser("o1")
