"""Tool-call parsers on model outputs in each format (well-formed and malformed), whole and
streamed: the stream's deltas, cut at every kind of boundary, reassemble to what `extract`
returns; malformed output comes back as content and never raises."""

import json
import random

import pytest

from jaxllm.entrypoints.openai_parsers.tool_parsers import TOOL_PARSERS, get_tool_parser

W = ("get_weather", {"city": "Paris", "unit": "celsius"})
T = ("get_time", {"zone": "Europe/Paris", "utc": False, "offset": [1, 2.5], "note": None})
U = ("search", {"q": "naïve \"quotes\" </tool_call> ]", "n": 3})

# (parser, output, expected content, expected [(name, arguments)]); arguments None = malformed.
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}\n</tool_call>', None, [W]),
    ("hermes", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
     '"arguments": {"zone": "Europe/Paris", "utc": false, "offset": [1, 2.5], "note": null}}'
     '\n</tool_call>', "Let me check both.\n", [W, T]),
    ("hermes", '<tool_call>{"name": "search", "arguments": {"q": "naïve \\"quotes\\" '
     '</tool_call> ]", "n": 3}}', None, None),  # the quoted end tag splits the JSON: content
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}', None, [W]),  # last block unclosed (generation stopped): still a call
    ("hermes", "The weather in Paris is sunny, 21 °C.", "The weather in Paris is sunny, 21 °C.",
     []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',
     None, None),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', None, None),
    ("hermes", 'Two.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}</tool_call>\n<tool_call>{"name": "oops", "arguments": [1]}</tool_call>',
     'Two.<tool_call>{"name": "oops", "arguments": [1]}</tool_call>', [W]),
    ("hermes", 'I think <tool_ is not a tag', "I think <tool_ is not a tag", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
     '"unit": "celsius"}}', None, [W]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
     '"celsius"}}; {"name": "get_time", "arguments": {"zone": "Europe/Paris", "utc": false, '
     '"offset": [1, 2.5], "note": null}}', None, [W, T]),
    ("llama3_json", '{"name": "search", "parameters": {"q": "naïve \\"quotes\\" </tool_call> ]",'
     ' "n": 3}}', None, [U]),
    ("llama3_json", "Paris is the capital of France.", "Paris is the capital of France.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"', None, None),
    ("llama3_json", '{"name": "get_weather", "parameters": "not json"}', None, None),
    ("llama3_json", '{"name": "get_weather", "parameters": {}} and then text', "and then text",
     [("get_weather", {})]),  # from the first thing that is not a call, the text is content
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}, {"name": "get_time", "arguments": {"zone": "Europe/Paris", "utc": false, '
     '"offset": [1, 2.5], "note": null}}]', None, [W, T]),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "search", "arguments": "{\\"q\\": \\"naïve '
     '\\\\\\"quotes\\\\\\" </tool_call> ]\\", \\"n\\": 3}"}]', "Sure.", [U]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]'
     'get_time[ARGS]{"zone": "Europe/Paris", "utc": false, "offset": [1, 2.5], "note": null}',
     None, [W, T]),
    ("mistral", "No tools needed: it is 21 °C.", "No tools needed: it is 21 °C.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}', None,
     None),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": Paris}', None, None),
    ("pythonic", '[get_weather(city="Paris", unit="celsius")]', None, [W]),
    ("pythonic", "[get_weather(city='Paris', unit='celsius'), get_time(zone='Europe/Paris', "
     "utc=False, offset=(1, 2.5), note=None)]", None, [W, T]),
    ("pythonic", '<|python_start|>[search(q="naïve \\"quotes\\" </tool_call> ]", n=3)]'
     '<|python_end|>', None, [U]),
    ("pythonic", "[1] Smith, J. (2020). A paper.", "[1] Smith, J. (2020). A paper.", []),
    ("pythonic", '[get_weather("Paris")]', None, None),   # positional: not vLLM's format
    ("pythonic", '[get_weather(city=city_name)]', None, None),  # not a literal
    ("pythonic", '[get_weather(city="Paris"', None, None),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time(zone)]',
     ', get_time(zone)]', [W]),
]


def _expected(text, content, calls):
    if calls is None:
        return text, []
    return content, [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_extract(name, text, content, calls):
    got = get_tool_parser(name)().extract(text)
    want_content, want_calls = _expected(text, content, calls)
    assert got.content == want_content
    assert [(c.name, c.arguments) for c in got.tool_calls] == want_calls
    assert got.tools_called == bool(want_calls)
    for c in got.tool_calls:
        oa = c.to_openai()
        assert oa["type"] == "function" and oa["id"]
        assert isinstance(json.loads(oa["function"]["arguments"]), dict)


def _chunkings(text):
    rng = random.Random(len(text))
    yield [text]
    yield list(text)
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def _stream(parser, chunks):
    text, deltas = "", []
    for chunk in chunks:
        previous, text = text, text + chunk
        d = parser.extract_delta(previous, text, chunk)
        if d is not None:
            deltas.append(d)
    last = parser.flush(text)
    return deltas + ([last] if last else [])


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_stream_reassembles(name, text, content, calls):
    want_content, want_calls = _expected(text, content, calls)
    for chunks in _chunkings(text):
        deltas = _stream(get_tool_parser(name)(), chunks)
        assert all(d for d in deltas)  # no empty deltas
        got_content = "".join(d.get("content", "") for d in deltas)
        tools: dict[int, dict] = {}
        for d in deltas:
            for e in d.get("tool_calls", []):
                if e["index"] not in tools:  # the first delta of a call names it, with an id
                    assert e["type"] == "function" and e["id"] and e["function"]["name"]
                    tools[e["index"]] = {"name": e["function"]["name"], "arguments": ""}
                else:
                    assert "id" not in e and "name" not in e.get("function", {})
                tools[e["index"]]["arguments"] += e.get("function", {}).get("arguments", "")
        assert sorted(tools) == list(range(len(tools)))
        assert (got_content or None) == (want_content if want_content and
                                         want_content.strip() else None)
        assert [(t["name"], t["arguments"]) for _, t in sorted(tools.items())] == want_calls


def test_a_call_goes_out_whole_once_complete():
    p = get_tool_parser("hermes")()
    text = 'Hi<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert p.extract_delta("", text, text) == {"content": "Hi"}
    rest = text + 'ris"}}\n</tool_call>'
    d = p.extract_delta(text, rest, rest[len(text):])
    assert d == {"tool_calls": [{"index": 0, "id": d["tool_calls"][0]["id"], "type": "function",
                                 "function": {"name": "get_weather",
                                              "arguments": '{"city": "Paris"}'}}]}
    assert p.extract_delta(rest, rest + "\n", "\n") is None and p.flush(rest + "\n") is None


def test_mistral_ids_and_registry():
    call = get_tool_parser("mistral")().extract(CASES[17][1]).tool_calls[0]
    assert len(call.id) == 9 and call.id.isalnum()
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "openai",
                                 "llama4_json", "llama4_pythonic", "qwen3_coder", "deepseek_v3",
                                 "deepseek_v31", "kimi_k2", "glm45", "granite"}
    with pytest.raises(ValueError, match="unknown tool call parser 'xml'.*hermes"):
        get_tool_parser("xml")
