"""The tool-call formats of DeepSeek-V3/V3.1, Kimi-K2, GLM-4.5, Qwen3-Coder and Granite, on
outputs written as those models write them (their chat templates' call syntax): text before
the calls, several calls, arguments with nested JSON, newlines and unicode, no call at all,
malformed calls. Whole and streamed, as tests/test_tool_parsers.py: the stream's deltas, cut at
every kind of boundary, reassemble to what `extract` returns."""

import json

import pytest
from test_tool_parsers import _chunkings, _stream

from jaxllm.entrypoints.openai_parsers.tool_parsers import TOOL_PARSERS, get_tool_parser

W = ("get_weather", {"city": "Paris", "unit": "celsius"})
N = ("search", {"q": "naïve \"quotes\" </tool_call> ]\nline 2 ✓", "filters": {"year": [2024, 2025],
                "lang": None}, "n": 3})
NJ = json.dumps(N[1], ensure_ascii=False)
N2 = ("search", {**N[1], "q": "naïve \"quotes\" ]\nline 2 ✓"})  # in XML, no end tag inside
# The request's tools, for the formats that type text values by schema.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"},
                                         "filters": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "convert", "parameters": {
        "type": "object", "properties": {"x": {"type": "number"}, "exact": {"type": "boolean"},
                                         "tags": {"type": "array"}, "code": {"type": "string"},
                                         "count": {"type": ["integer", "null"]}}}}}]

DS_B, DS_E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CB, DS_CE, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def ds3(name, args):
    return f"{DS_CB}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CE}"


def ds31(name, args):
    return f"{DS_CB}{name}{DS_SEP}{args}{DS_CE}"


KB, KE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def kimi(name, idx, args):
    return (f"<|tool_call_begin|>functions.{name}:{idx}<|tool_call_argument_begin|>{args}"
            f"<|tool_call_end|>")


WJ = '{"city": "Paris", "unit": "celsius"}'
BAD_JSON, CUT_JSON = '{"city": Paris}', '{"city": '

# (parser, output, expected content, expected [(name, arguments)]); calls None = malformed.
CASES = [
    ("deepseek_v3", f"Let me check.{DS_B}{ds3('get_weather', WJ)}\n{ds3('search', NJ)}{DS_E}",
     "Let me check.", [W, N]),
    ("deepseek_v3", f"{DS_B}{ds3('search', json.dumps(N[1], indent=2))}{DS_E}", None, [N]),
    ("deepseek_v3", "Paris is sunny, 21 °C.", "Paris is sunny, 21 °C.", []),
    ("deepseek_v3", f"{DS_B}{ds3('get_weather', BAD_JSON)}{DS_E}", None, None),
    ("deepseek_v3", f"{DS_B}{ds31('get_weather', WJ)}{DS_E}", None, None),  # V3.1's layout
    ("deepseek_v3", f"Hm.{DS_B}{DS_CB}function{DS_SEP}get_weather\n```json\n{{\"ci",
     None, None),  # cut off inside the call
    ("deepseek_v3", f"{DS_B}{ds3('get_weather', WJ)}{ds3('oops', '[1]')}{DS_E}",
     f"{ds3('oops', '[1]')}{DS_E}", [W]),
    ("deepseek_v31", f"On it.{DS_B}{ds31('get_weather', WJ)}{ds31('search', NJ)}{DS_E}",
     "On it.", [W, N]),
    ("deepseek_v31", f"{DS_B}{ds31('get_weather', WJ)}{DS_E}\n\nDone, that's all.",
     "\n\nDone, that's all.", [W]),
    ("deepseek_v31", "No tools: 2 + 2 = 4.", "No tools: 2 + 2 = 4.", []),
    ("deepseek_v31", f"{DS_B}{ds3('get_weather', WJ)}{DS_E}", None, None),  # V3's layout
    ("deepseek_v31", f"{DS_B}{ds31('get_weather', WJ)}", None, [W]),  # stopped before the end
    ("kimi_k2", f"I'll look.{KB}{kimi('get_weather', 0, WJ)}{kimi('search', 1, NJ)}{KE}",
     "I'll look.", [W, N]),
    ("kimi_k2", f"{KB}<|tool_call_begin|> functions.get_weather:0 <|tool_call_argument_begin|>"
     f" {WJ} <|tool_call_end|>{KE}", None, [W]),
    ("kimi_k2", f"Two.<|tool_call_section_begin|>{kimi('get_weather', 0, WJ)}"
     f"{kimi('search', 1, NJ)}<|tool_call_section_end|>", "Two.", [W, N]),  # singular markers
    ("kimi_k2", "Just text, ☀. <|tool_call_ is not a marker", "Just text, ☀. <|tool_call_ is "
     "not a marker", []),
    ("kimi_k2", f"{KB}<|tool_call_begin|>functions.get_weather<|tool_call_argument_begin|>{WJ}"
     f"<|tool_call_end|>{KE}", None, None),  # no :index
    ("kimi_k2", f"{KB}{kimi('get_weather', 0, CUT_JSON)}", None, None),
    ("glm45", "Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
     "</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>\n"
     f"<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>{N2[1]['q']}</arg_value>\n"
     f"<arg_key>filters</arg_key>\n<arg_value>{json.dumps(N[1]['filters'])}</arg_value>\n"
     "<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", "Let me check.", [W, N2]),
    ("glm45", "<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>naïve \"quotes\" ✓"
     "</arg_value>\n<arg_key>filters</arg_key>\n<arg_value>{\"year\": [2024, 2025], \"lang\": "
     "null}</arg_value>\n<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", None,
     [("search", {"q": "naïve \"quotes\" ✓", "filters": {"year": [2024, 2025], "lang": None},
                  "n": 3})]),
    ("glm45", "<tool_call>convert\n<arg_key>x</arg_key>\n<arg_value>2.5</arg_value>\n"
     "<arg_key>tags</arg_key>\n<arg_value>['a', 'b']</arg_value>\n<arg_key>code</arg_key>\n"
     "<arg_value>42</arg_value>\n<arg_key>other</arg_key>\n<arg_value>True</arg_value>\n"
     "</tool_call>", None,
     [("convert", {"x": 2.5, "tags": ["a", "b"], "code": "42", "other": True})]),
    ("glm45", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("glm45", "<tool_call>get_weather\ncity=Paris\n</tool_call>", None, None),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", None, None),
    ("qwen3_coder", "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=search>\n<parameter=q>\nnaïve \"quotes\" </tool_call> ]\nline 2 ✓"
     "\n</parameter>\n</function>\n</tool_call>", "I'll look.\n ]\nline 2 ✓\n</parameter>\n"
     "</function>\n</tool_call>", [W, ("search", {"q": "naïve \"quotes\" "})]),
    # an end tag inside a value ends the block there (vLLM's regexes read it so too)
    ("qwen3_coder", "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=search>\n<parameter=q>\nnaïve \"quotes\" ]\nline 2 ✓\n"
     "</parameter>\n<parameter=filters>\n{\"year\": [2024, 2025],\n \"lang\": null}\n"
     "</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>",
     "I'll look.\n", [W, N2]),
    ("qwen3_coder", "<tool_call>\n<function=convert>\n<parameter=x>\n3.0\n</parameter>\n"
     "<parameter=exact>\nTrue\n</parameter>\n<parameter=tags>\n[\"a\"]\n</parameter>\n"
     "<parameter=code>\n007\n</parameter>\n<parameter=count>\nnull\n</parameter>\n"
     "<parameter=extra>\n12\n</parameter>\n</function>\n</tool_call>", None,
     [("convert", {"x": 3, "exact": True, "tags": ["a"], "code": "007", "count": None,
                   "extra": "12"})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "<parameter=unit>\ncelsius\n</function>\n</tool_call>", None, [W]),  # vLLM's leniency
    ("qwen3_coder", "Sure.\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=unit>\ncelsius\n</parameter>\n</function>\n<function=search>\n"
     "<parameter=n>\n3\n</parameter>\n</function>", "Sure.\n",
     [W, ("search", {"n": 3})]),  # no <tool_call> around the calls (vLLM's back-off)
    ("qwen3_coder", "def f():\n    return 1  # no call here", "def f():\n    return 1  # no "
     "call here", []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\ncity: Paris\n</function>\n"
     "</tool_call>", None, None),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", None,
     [("get_weather", {"city": "Par"})]),  # stopped inside the last block: still a call
    ("granite", f'<|tool_call|>[{{"name": "get_weather", "arguments": {WJ}}}, {{"name": '
     f'"search", "arguments": {NJ}}}]', None, [W, N]),
    ("granite", f'  <tool_call>[{{"name": "search", "arguments": {NJ}}}]', None, [N]),
    ("granite", "It is 21 °C in Paris.", "It is 21 °C in Paris.", []),
    ("granite", f'Sure! <|tool_call|>[{{"name": "get_weather", "arguments": {WJ}}}]', None,
     None),  # only an output that starts with the calls has calls (as vLLM)
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, 7]',
     None, None),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Pa', None, None),
]


def _expected(text, content, calls):
    if calls is None:
        return text, []
    return content, [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]


def _parser(name):
    return get_tool_parser(name)(None, tools=TOOLS)


def _calls(got):
    return [(c.name, json.loads(c.arguments)) for c in got.tool_calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_extract(name, text, content, calls):
    got = _parser(name).extract(text)
    want_content, want_calls = _expected(text, content, calls)
    assert got.content == (want_content if want_calls else text)
    assert _calls(got) == [(n, json.loads(a)) for n, a in want_calls]
    assert got.tools_called == bool(want_calls)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_stream_reassembles(name, text, content, calls):
    want = _parser(name).extract(text)
    for chunks in _chunkings(text):
        deltas = _stream(_parser(name), chunks)
        assert all(d for d in deltas)
        tools: dict[int, dict] = {}
        for d in deltas:
            for e in d.get("tool_calls", []):
                assert e["index"] not in tools and e["type"] == "function" and e["id"]
                tools[e["index"]] = e
        assert sorted(tools) == list(range(len(tools)))
        got_content = "".join(d.get("content", "") for d in deltas)
        assert (got_content or None) == (want.content if want.content and
                                         want.content.strip() else None)
        assert [(t["function"]["name"], t["function"]["arguments"])
                for _, t in sorted(tools.items())] == [(c.name, c.arguments)
                                                       for c in want.tool_calls]


def test_kimi_ids_are_the_models_call_ids():
    text = f"{KB}{kimi('get_weather', 0, WJ)}{kimi('search', 1, NJ)}{KE}"
    got = _parser("kimi_k2").extract(text)
    assert [c.id for c in got.tool_calls] == ["functions.get_weather:0", "functions.search:1"]
    deltas = _stream(_parser("kimi_k2"), list(text))
    assert [e["id"] for d in deltas for e in d.get("tool_calls", [])] == [
        "functions.get_weather:0", "functions.search:1"]


def test_values_are_text_without_a_schema():
    """Without the request's tools, qwen3_coder keeps values as text and glm45 reads them as
    JSON where they parse, as vLLM."""
    q = ("<tool_call>\n<function=search>\n<parameter=n>\n3\n</parameter>\n</function>\n"
         "</tool_call>")
    assert _calls(get_tool_parser("qwen3_coder")().extract(q)) == [("search", {"n": "3"})]
    assert _calls(_parser("qwen3_coder").extract(q)) == [("search", {"n": 3})]
    g = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n</tool_call>"
    assert _calls(get_tool_parser("glm45")().extract(g)) == [("get_weather", {"city": 123})]
    assert _calls(_parser("glm45").extract(g)) == [("get_weather", {"city": "123"})]


def test_a_deepseek_call_goes_out_whole_once_its_end_arrives():
    p = _parser("deepseek_v31")
    head = f"Hi{DS_B}{DS_CB}get_weather{DS_SEP}{{\"city\": \"Paris\"}}"
    assert p.extract_delta("", head, head) == {"content": "Hi"}
    d = p.extract_delta(head, head + DS_CE, DS_CE)
    assert d["tool_calls"][0]["function"] == {"name": "get_weather",
                                              "arguments": '{"city": "Paris"}'}
    assert p.extract_delta(head + DS_CE, head + DS_CE + DS_E, DS_E) is None


def test_registry_has_this_waves_formats():
    assert {"qwen3_coder", "deepseek_v3", "deepseek_v31", "kimi_k2", "glm45",
            "granite"} <= set(TOOL_PARSERS)
