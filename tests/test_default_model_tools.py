"""Tool calls with the real default model (SmolLM2-135M-Instruct) behind `jaxllm serve`, driven
with the official `openai` client (issue 41): tool_choice "required" must end in a call that
fits the tool's schema (it used to write invented keys until max_tokens), and SmolLM2's chat
template, which never renders `tools`, must be reported once rather than drop them silently.
"""

from __future__ import annotations

import json
import logging
import uuid

import jsonschema
import openai
import pytest

from jaxllm.config import DEFAULT_MODEL
from jaxllm.engine.input_processor import render_chat_prompt
from test_chat_tools import assemble
from server_process import ServerProcess

NAME = "smollm2"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "The weather forecast of a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
DROPPED = "does not render `tools`"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(DEFAULT_MODEL, "--max-model-len", "512", "--max-num-seqs", "2",
                        "--disable-log-stats", "--served-model-name", NAME,
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def ask(client, **kw):
    return client.chat.completions.create(**{"model": NAME, "messages": ASK, "tools": TOOLS,
                                             "temperature": 0.0, "max_tokens": 100, **kw})


@pytest.mark.slow  # the default model's server (~40 s to start)
def test_required_returns_a_call_that_fits_the_schema(client):
    choice = ask(client, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


@pytest.mark.slow  # the default model's server (~40 s to start)
def test_required_single_call_streamed(client):
    streamed = assemble(ask(client, tool_choice="required", parallel_tool_calls=False,
                            stream=True))
    assert streamed["finish_reason"] == "tool_calls" and streamed["content"] == ""
    (call,) = streamed["calls"].values()
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)


@pytest.mark.slow  # the default model's server (~40 s to start)
def test_dropped_tools_are_logged_once_naming_the_model(server, client):
    """SmolLM2's template has no `tools`: "auto" cannot call what the model never saw."""
    for choice in ("auto", "required", "auto"):
        ask(client, tool_choice=choice, max_tokens=4)
    log = server.output(tail=10 ** 7)
    assert log.count(DROPPED) == 1, log
    (line,) = [line for line in log.splitlines() if DROPPED in line]
    assert f"chat template of model {DEFAULT_MODEL}" in line


@pytest.fixture(scope="module")
def tokenizer():
    from jaxllm.tokenizer import get_tokenizer
    return get_tokenizer(None)


def test_render_warns_once_per_template_that_drops_tools(tokenizer, caplog):
    # A template of its own (unique text), so no earlier render in this process counts.
    ignores = f"{{# {uuid.uuid4()} #}}{{% for m in messages %}}{{{{ m.content }}}}{{% endfor %}}"
    reads = ignores + "{% for t in tools or [] %} {{ t.function.name }}{% endfor %}"
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        for _ in range(2):
            assert render_chat_prompt(tokenizer, ASK, chat_template=ignores, tools=TOOLS,
                                      template_source="the test's template") == ASK[0]["content"]
            assert render_chat_prompt(tokenizer, ASK, chat_template=reads, tools=TOOLS
                                      ).endswith(" get_weather")
        render_chat_prompt(tokenizer, ASK, chat_template=ignores + " ")  # no tools: no check
    (record,) = [r for r in caplog.records if DROPPED in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("The test's template does not render `tools`: the 1")
