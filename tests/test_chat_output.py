"""What the server makes of a chat choice's text (serving/serving_chat.py): vLLM's tool_choice
rules, reasoning split before tool calls, and streams that reassemble to the plain response,
on recorded model outputs cut at every boundary. No model, no server."""

import json
import random
from types import SimpleNamespace

import jsonschema
import pytest

from jaxllm.entrypoints.openai_parsers.reasoning_parsers import REASONING_PARSERS
from jaxllm.entrypoints.openai_parsers.tool_parsers import TOOL_PARSERS
from serving import cli_args
from serving.errors import APIError
from serving.serving_chat import ChoiceParser, ToolChoice

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HERMES_TWO = ('<think>Paris, then the time.</think>Checking.<tool_call>\n{"name": '
              '"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
              '{"name": "get_time", "arguments": {}}\n</tool_call>')


def request(tool_choice=None, tools=TOOLS, parallel=True):
    return SimpleNamespace(tool_choice=tool_choice, tools=tools, parallel_tool_calls=parallel)


def test_cli_choices_are_the_registries():
    assert set(cli_args.TOOL_CALL_PARSERS) == set(TOOL_PARSERS)
    assert set(cli_args.REASONING_PARSERS) == set(REASONING_PARSERS)


@pytest.mark.parametrize("flags, words", [
    (["--tool-parser-plugin", "my_parser.py"], ["--tool-parser-plugin", "my_parser.py"]),
    (["--enable-auto-tool-choice"], ["--enable-auto-tool-choice", "--tool-call-parser"]),
])
def test_flag_rules_at_start_up(flags, words):
    from serving.cli.serve import parse_args
    with pytest.raises(ValueError) as e:
        cli_args.chat_output_settings(parse_args(flags))
    for word in words:
        assert word in str(e.value)
    settings = cli_args.chat_output_settings(parse_args(["--enable-auto-tool-choice",
                                                         "--tool-call-parser", "hermes"]))
    assert settings["enable_auto_tool_choice"] and settings["tool_call_parser"] == "hermes"


def test_unknown_parser_is_refused_at_start_up():
    """Checked after argparse, once any --tool-parser-plugin has registered its names."""
    from serving.cli.serve import parse_args
    with pytest.raises(ValueError, match="--tool-call-parser 'nope'.*hermes"):
        cli_args.chat_output_settings(parse_args(["--tool-call-parser", "nope"]))


@pytest.mark.parametrize("choice, tools, enabled, words", [
    ("auto", TOOLS, False, ["--enable-auto-tool-choice", "--tool-call-parser"]),
    (None, TOOLS, False, ["--enable-auto-tool-choice"]),  # tools alone mean "auto"
    ("required", None, True, ["tools"]),
    ({"type": "function", "function": {"name": "nope"}}, TOOLS, True, ["nope", "not in tools"]),
    ("sometimes", TOOLS, True, ["sometimes"]),
])
def test_tool_choice_refusals_name_the_field(choice, tools, enabled, words):
    with pytest.raises(APIError) as e:
        ToolChoice.of(request(choice, tools), "hermes" if enabled else None, enabled)
    assert e.value.status == 400 and e.value.param == "tool_choice"
    for word in words:
        assert word in str(e.value)


def test_tool_choice_modes():
    assert ToolChoice.of(request(None, None), None, False).mode == "none"
    assert ToolChoice.of(request("none"), None, False).mode == "none"
    assert ToolChoice.of(request("required", []), None, False).mode == "none"  # as vLLM
    assert ToolChoice.of(request(None), "hermes", True).mode == "auto"
    required = ToolChoice.of(request("required", parallel=False), None, False)
    assert required.mode == "required" and not required.parallel
    assert json.loads(required.constraint.json)["maxItems"] == 1
    named = ToolChoice.of(request(NAMED), None, False)
    assert (named.mode, named.function) == ("named", "get_weather")
    assert json.loads(named.constraint.json) == WEATHER


def stream(parser: ChoiceParser, text: str, seed: int) -> dict:
    """Feed `text` in random chunks; join the deltas as an OpenAI client does."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    joined = {"reasoning": "", "content": "", "calls": {}}
    for i, end in enumerate([*cuts, len(text)]):
        delta = parser.delta(text[:end], final=i == len(cuts)) or {}
        assert set(delta) <= {"reasoning", "content", "tool_calls"}
        joined["reasoning"] += delta.get("reasoning", "")
        joined["content"] += delta.get("content", "")
        for call in delta.get("tool_calls", ()):
            slot = joined["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            if "id" in call:
                assert call["type"] == "function" and "id" not in slot
                slot["id"] = call["id"]
            slot["name"] += call["function"].get("name", "")
            slot["arguments"] += call["function"]["arguments"]
    return joined


def same(whole: dict, joined: dict) -> None:
    assert (whole["reasoning"] or "") == joined["reasoning"]
    assert (whole["content"] or "") == joined["content"]
    calls = [joined["calls"][i] for i in sorted(joined["calls"])]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in whole["tool_calls"]]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)


# (tool_choice, tool parser, reasoning parser, recorded output, reasoning, content, call names)
RECORDED = [
    ("auto", "hermes", "qwen3", HERMES_TWO, "Paris, then the time.", "Checking.",
     ["get_weather", "get_time"]),
    ("auto", "hermes", "deepseek_r1", 'I should call it.</think><tool_call>{"name": '
     '"get_weather", "arguments": {"city": "Oslo"}}</tool_call>', "I should call it.", None,
     ["get_weather"]),
    ("auto", "hermes", "qwen3", '<think>maybe <tool_call>{"name": "get_time", "arguments": {}}'
     '</tool_call></think>No call needed.', 'maybe <tool_call>{"name": "get_time", '
     '"arguments": {}}</tool_call>', "No call needed.", []),  # a call in the reasoning is not
    ("auto", "hermes", None, '<tool_call>{"name": "get_weather", "arguments": {"city": ',
     None, '<tool_call>{"name": "get_weather", "arguments": {"city": ', []),  # malformed
    ("auto", "pythonic", None, '[get_weather(city="Rome"), get_time()]', None, None,
     ["get_weather", "get_time"]),
    ("required", None, "qwen3", '[{"name": "get_time", "parameters": {}}, {"name": '
     '"get_weather", "parameters": {"city": "Lima"}}]', None, None, ["get_time", "get_weather"]),
    (NAMED, None, "deepseek_r1", '{"city": "Quito"}', None, None, ["get_weather"]),
    ("none", "hermes", "qwen3", "<think>hm</think>" + HERMES_TWO[36:], "hm", HERMES_TWO[36:],
     []),
]


@pytest.mark.parametrize("case", range(len(RECORDED)))
def test_recorded_outputs_whole_and_streamed(case):
    choice, tool_parser, reasoning_parser, text, reasoning, content, names = RECORDED[case]
    mode = ToolChoice.of(request(choice), tool_parser, True)
    constrained = mode.constraint is not None
    whole = ChoiceParser(mode, tool_parser, reasoning_parser, None, constrained).whole(text)
    assert whole["reasoning"] == reasoning
    assert whole["content"] == content
    assert [c["function"]["name"] for c in whole["tool_calls"]] == names
    for call in whole["tool_calls"]:
        params = next(t["function"].get("parameters", {}) for t in TOOLS
                      if t["function"]["name"] == call["function"]["name"])
        jsonschema.validate(json.loads(call["function"]["arguments"]), params)
    for seed in range(30):
        same(whole, stream(ChoiceParser(mode, tool_parser, reasoning_parser, None,
                                        constrained), text, seed))


def test_named_stream_sends_the_name_first_then_argument_fragments():
    parser = ChoiceParser(ToolChoice.of(request(NAMED), None, False), None, None)
    first = parser.delta('{"ci', final=False)["tool_calls"][0]
    assert first["id"].startswith("chatcmpl-tool-") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": '{"ci'}
    rest = parser.delta('{"city": "Paris"}', final=True)["tool_calls"][0]
    assert rest == {"index": 0, "function": {"arguments": 'ty": "Paris"}'}}
    assert parser.finish_reason("stop") == "stop"  # vLLM keeps it for a named function


def test_finish_reason_and_parallel_tool_calls():
    auto = ToolChoice.of(request("auto", parallel=False), "hermes", True)
    parser = ChoiceParser(auto, "hermes", "qwen3")
    whole = parser.whole(HERMES_TWO)
    assert [c["function"]["name"] for c in whole["tool_calls"]] == ["get_weather"]
    assert parser.finish_reason("stop") == "tool_calls"
    assert parser.finish_reason("length") == "tool_calls"
    joined = stream(ChoiceParser(auto, "hermes", "qwen3"), HERMES_TWO, 0)
    assert list(joined["calls"]) == [0]
    plain = ChoiceParser(auto, "hermes", None)
    plain.whole("no calls here")
    assert plain.finish_reason("stop") == "stop"
    required = ChoiceParser(ToolChoice.of(request("required"), None, False), None, None)
    required.whole('[{"name": "get_time", "parameters": {}}')  # cut off after one call
    assert required.finish_reason("length") == "length"


def test_constrained_output_has_reasoning_only_between_think_tags():
    """deepseek_r1 reads an output without </think> as all reasoning; a constrained output
    (grammar from the first token) is read by the explicit tags instead, so a JSON answer
    stays content."""
    none = ToolChoice()
    assert ChoiceParser(none, None, "deepseek_r1").whole('{"a": 1}')["reasoning"] == '{"a": 1}'
    free = ChoiceParser(none, None, "deepseek_r1", None, constrained=True)
    assert free.whole('{"a": 1}') == {"reasoning": None, "content": '{"a": 1}',
                                      "tool_calls": []}
    tagged = ChoiceParser(none, None, "deepseek_r1", None, constrained=True)
    assert tagged.whole("<think>hm</think>{}")["reasoning"] == "hm"
