"""`--tool-parser-plugin PATH`: a user's file registering a tool parser (as vLLM's
`ToolParserManager.register_module` plugins), loaded at start-up and used by name through
--tool-call-parser, for the message and the stream. Bad plugins are start-up errors naming the
flag."""

import json

import pytest

from jaxllm.entrypoints.openai_parsers.tool_parsers import TOOL_PARSERS, ToolParser
from serving import cli_args
from serving.serving_chat import ChoiceParser, ToolChoice
from test_chat_output import request

PLUGIN = '''
import json

from jaxllm.entrypoints.openai_parsers.tool_parsers import ToolParser, ToolParserManager
from jaxllm.entrypoints.openai_parsers.text_utils import safe_prefix
from jaxllm.entrypoints.openai_parsers.tool_parsers.base import Scan


@ToolParserManager.register_module(["call_lines", "call_lines_v2"])
class CallLines(ToolParser):
    """Content, then one `CALL name {json}` line per call."""

    def scan(self, text, final):
        content, _, calls = text.partition("CALL ")
        lines = ("CALL " + calls).splitlines() if _ else []
        if not (_ or final):
            content = safe_prefix(content, "CALL ")  # a CALL may be arriving
        done = lines if final else lines[:-1]
        return Scan(content, [(line.split(" ", 2)[1],
                               json.dumps(json.loads(line.split(" ", 2)[2])))
                              for line in done])
'''
TEXT = 'Checking.\nCALL get_weather {"city": "Paris"}\nCALL get_time {}'


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "my_parsers.py"
    path.write_text(PLUGIN)
    yield str(path)
    for name in ("call_lines", "call_lines_v2"):
        TOOL_PARSERS.pop(name, None)


def _settings(flags):
    from serving.cli.serve import parse_args
    return cli_args.chat_output_settings(parse_args(flags))


def test_a_plugin_parser_is_used_by_name(plugin):
    with pytest.raises(ValueError, match="--tool-call-parser 'call_lines'"):
        _settings(["--enable-auto-tool-choice", "--tool-call-parser", "call_lines"])
    settings = _settings(["--enable-auto-tool-choice", "--tool-call-parser", "call_lines",
                          "--tool-parser-plugin", plugin])
    assert settings["tool_call_parser"] == "call_lines"
    assert issubclass(TOOL_PARSERS["call_lines_v2"], ToolParser)
    choice = ToolChoice.of(request("auto"), settings["tool_call_parser"], True)
    message = ChoiceParser(choice, "call_lines", None).whole(TEXT)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in message["tool_calls"]]
    assert message["content"] == "Checking.\n"
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    stream = ChoiceParser(choice, "call_lines", None)
    deltas = [stream.delta(TEXT[:i], False) for i in range(1, len(TEXT) + 1)]
    deltas = [d for d in deltas + [stream.delta(TEXT, True)] if d]
    assert "".join(d.get("content", "") for d in deltas) == "Checking.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for d in deltas for c in d.get("tool_calls", [])] == calls
    assert stream.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("source, words", [
    (None, ["no such file"]),
    ("def broken(:\n", ["failed to load", "SyntaxError"]),
    ("from jaxllm.entrypoints.openai_parsers.tool_parsers import ToolParserManager\n"
     "@ToolParserManager.register_module('x')\nclass NotAParser:\n    pass\n",
     ["failed to load", "must subclass jaxllm's ToolParser"]),
])
def test_bad_plugins_are_start_up_errors(tmp_path, source, words):
    path = tmp_path / "bad_plugin.py"
    if source is not None:
        path.write_text(source)
    with pytest.raises(ValueError) as e:
        _settings(["--tool-parser-plugin", str(path)])
    for word in ["--tool-parser-plugin", str(path)] + words:
        assert word in str(e.value)
    assert "x" not in TOOL_PARSERS
