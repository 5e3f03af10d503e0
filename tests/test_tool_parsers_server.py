"""A real `jaxllm serve --tool-parser-plugin FILE --tool-call-parser NAME` with the official
`openai` client: the plugin's parser (a subclass of the built-in qwen3_coder) reads the calls,
whose text values come back typed by the request's tool schema, streamed or not.

As in test_chat_tools.py, the tiny random model cannot write a call by chance: a regex leaves it
one output, a Qwen3-Coder call after some content. Slow (a server start-up and compiles)."""

from __future__ import annotations

import json

import openai
import pytest
from server_process import ENGINE_FLAGS, ServerProcess
from test_chat_tools import assemble, check_same

pytestmark = pytest.mark.slow

NAME = "tiny-xml-tools"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}}}}}]
PLUGIN = '''
from jaxllm.entrypoints.openai_parsers.tool_parsers import ToolParserManager
from jaxllm.entrypoints.openai_parsers.tool_parsers.qwen3_coder import Qwen3CoderToolParser


@ToolParserManager.register_module("my_qwen_xml")
class MyQwenXml(Qwen3CoderToolParser):
    """The built-in format under the plugin's own name."""
'''
CALL = ("Let me look.<tool_call>\n<function=get_weather>\n<parameter=city>\n7 Rue\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n"
        "</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def client(make_tiny_checkpoint, tmp_path_factory):
    plugin = tmp_path_factory.mktemp("plugin") / "my_parsers.py"
    plugin.write_text(PLUGIN)
    model = make_tiny_checkpoint("llama", max_position_embeddings=1024)
    srv = ServerProcess(model, *ENGINE_FLAGS, "--max-model-len", "1024",
                        "--max-num-batched-tokens", "1024", "--enable-auto-tool-choice",
                        "--tool-parser-plugin", str(plugin), "--tool-call-parser",
                        "my_qwen_xml", "--served-model-name", NAME)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    srv.stop()


def test_a_plugin_parser_reads_typed_xml_calls(client):
    regex = "".join("\\" + ch if ch in "{}[]().*+?^$|\\" else ch for ch in CALL)
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
              tool_choice="auto", temperature=0.0, max_tokens=400,
              extra_body={"structured_outputs": {"regex": regex}})
    full = client.chat.completions.create(**kw)
    message = full.choices[0].message
    assert message.content == "Let me look."
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "7 Rue", "days": 3, "metric": True})
    assert full.choices[0].finish_reason == "tool_calls"
    check_same(full, assemble(client.chat.completions.create(stream=True, **kw)))
