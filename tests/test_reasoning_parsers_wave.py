"""The reasoning formats of DeepSeek-V3.1 (thinking per request), GLM-4.5 and Granite, whole and
streamed as tests/test_reasoning_parsers.py (the deltas join to exactly the whole-output split,
whatever the chunking), and the request's chat_template_kwargs and tools reaching the parsers
through the server's ChoiceParser."""

import json
import random
from types import SimpleNamespace

import pytest

from jaxllm.entrypoints.openai_parsers.reasoning_parsers import (REASONING_PARSERS,
                                                                 get_reasoning_parser)
from serving.serving_chat import ChoiceParser, ToolChoice

THOUGHT = "The user wants 2+2. <b>Basic</b> arithmetic: 4.\nHere is no marker."
ON, OFF = {"thinking": True}, {}
# (parser, chat_template_kwargs, output, reasoning, content)
CASES = [
    ("deepseek_v3", ON, f"{THOUGHT}</think>The answer is 4.", THOUGHT, "The answer is 4."),
    ("deepseek_v3", {"enable_thinking": True}, f"<think>{THOUGHT}</think>\n\n4.", THOUGHT,
     "\n\n4."),
    ("deepseek_v3", ON, f"{THOUGHT} and I was cut off", f"{THOUGHT} and I was cut off", None),
    ("deepseek_v3", OFF, "The answer is 4.", None, "The answer is 4."),
    ("deepseek_v3", {"thinking": False}, f"{THOUGHT}</think>4", None, f"{THOUGHT}</think>4"),
    ("glm45", OFF, f"<think>{THOUGHT}</think>\nThe answer is 4.", THOUGHT, "\nThe answer is 4."),
    ("glm45", OFF, "\n<think>hm</think>4", "hm", "\n4"),
    ("glm45", OFF, "The answer is 4.", None, "The answer is 4."),  # enable_thinking=False
    ("glm45", OFF, f"{THOUGHT}</think>4", None, f"{THOUGHT}</think>4"),  # no <think>: content
    ("glm45", OFF, f"<think>{THOUGHT} still", f"{THOUGHT} still", None),
    ("glm45", OFF, "x < y and <thin is no tag", None, "x < y and <thin is no tag"),
    ("granite", OFF, f"Here is my thought process:\n{THOUGHT}\nHere is my response:\n4.",
     f"\n{THOUGHT}\n", "\n4."),
    ("granite", OFF, "Here's my thought process:\nhmm, Here is my\nHere's my response: 4",
     "\nhmm, Here is my\n", " 4"),
    ("granite", OFF, "Here is my thought process: cut off", " cut off", None),
    ("granite", OFF, "The answer is 4. Here is my response: 4", None,
     "The answer is 4. Here is my response: 4"),
    ("granite", OFF, "Here is 4.", None, "Here is 4."),
]


def _chunkings(text):
    rng = random.Random(len(text))
    yield [text]
    yield list(text)
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 10))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("name, kwargs, text, reasoning, content", CASES)
def test_extract(name, kwargs, text, reasoning, content):
    p = get_reasoning_parser(name)(None, chat_template_kwargs=kwargs)
    assert p.extract(text) == (reasoning, content)


@pytest.mark.parametrize("name, kwargs, text, reasoning, content", CASES)
def test_stream_joins_to_extract(name, kwargs, text, reasoning, content):
    for chunks in _chunkings(text):
        p, cur, deltas = get_reasoning_parser(name)(None, chat_template_kwargs=kwargs), "", []
        for c in chunks:
            prev, cur = cur, cur + c
            deltas.append(p.extract_delta(prev, cur, c))
        deltas.append(p.flush(cur))
        deltas = [d for d in deltas if d is not None]
        assert all(d and set(d) <= {"reasoning", "content"} for d in deltas)
        joined = tuple("".join(d.get(k, "") for d in deltas) or None
                       for k in ("reasoning", "content"))
        assert joined == (reasoning, content)


def test_markers_are_never_streamed_as_text():
    p = get_reasoning_parser("granite")()
    assert p.extract_delta("", "Here is my", "Here is my") is None
    assert p.extract_delta("Here is my", "Here is my thought process: a Here",
                           " thought process: a Here") == {"reasoning": " a "}
    assert p.extract_delta("", "Here is my thought process: a Here is my response: b",
                           " is my response: b") == {"content": " b"}


def test_reasoning_end_and_registry():
    on = get_reasoning_parser("deepseek_v3")(None, chat_template_kwargs=ON)
    off = get_reasoning_parser("deepseek_v3")()
    assert not on.is_reasoning_end("still thinking") and on.is_reasoning_end("a</think>")
    assert off.is_reasoning_end("no thinking at all")
    glm, granite = get_reasoning_parser("glm45")(), get_reasoning_parser("granite")()
    assert glm.is_reasoning_end("4") and not glm.is_reasoning_end("<think>hm")
    assert not granite.is_reasoning_end("Here is my thought process: hm")
    assert granite.is_reasoning_end("Here is my thought process: hm Here is my response:")
    assert granite.is_reasoning_end("4")
    assert {"deepseek_v3", "glm45", "granite"} <= set(REASONING_PARSERS)


def _auto():
    req = SimpleNamespace(tool_choice="auto", parallel_tool_calls=True, tools=[
        {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"},
                                             "b": {"type": "number"}}}}}])
    return ToolChoice.of(req, "qwen3_coder", True), req.tools


def test_the_request_reaches_the_parsers():
    """The server's per-choice parser hands the request's chat_template_kwargs to the
    reasoning parser (deepseek_v3 thinks only when asked) and its tools to the tool parser
    (qwen3_coder types the values by them), in the message and in the stream alike."""
    choice, tools = _auto()
    text = ("Let me add.</think>Adding.<tool_call>\n<function=add>\n<parameter=a>\n2\n"
            "</parameter>\n<parameter=b>\n2.5\n</parameter>\n</function>\n</tool_call>")
    thinking = ChoiceParser(choice, "qwen3_coder", "deepseek_v3", tools=tools,
                            chat_template_kwargs={"thinking": True})
    message = thinking.whole(text)
    assert message["reasoning"] == "Let me add." and message["content"] == "Adding."
    call = message["tool_calls"][0]["function"]
    assert call["name"] == "add" and json.loads(call["arguments"]) == {"a": 2, "b": 2.5}
    plain = ChoiceParser(choice, "qwen3_coder", "deepseek_v3", tools=tools).whole(text)
    assert plain["reasoning"] is None and plain["content"] == "Let me add.</think>Adding."
    stream = ChoiceParser(choice, "qwen3_coder", "deepseek_v3", tools=tools,
                          chat_template_kwargs={"thinking": True})
    deltas = [stream.delta(text[:i], False) for i in range(1, len(text) + 1)]
    deltas = [d for d in deltas + [stream.delta(text, True)] if d]
    assert "".join(d.get("reasoning", "") for d in deltas) == "Let me add."
    assert "".join(d.get("content", "") for d in deltas) == "Adding."
    (streamed,) = [c for d in deltas for c in d.get("tool_calls", [])]
    assert streamed["function"] == call
    untyped = ChoiceParser(choice, "qwen3_coder", None).whole(text[len("Let me add.</think>"):])
    assert json.loads(untyped["tool_calls"][0]["function"]["arguments"]) == {"a": "2",
                                                                               "b": "2.5"}
