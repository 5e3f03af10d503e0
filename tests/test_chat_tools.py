"""Tools and tool calls through the chat template, and tool calling / reasoning output of a real
`jaxllm serve --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`
driven with the official `openai` client; LLM.chat(tools=...) offline.

The tiny random model writes random text, so what it says cannot be a tool call by chance: the
calls the server must return come from structured output (tool_choice required / named, and a
regex that makes the model write a hermes call for `auto`), where the model has no choice. The
parsers themselves are tested on recorded outputs in test_chat_output.py and
test_tool_parsers.py."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from jaxllm.engine.input_processor import content_format_of, normalize_messages
from server_process import ENGINE_FLAGS, ServerProcess

NAME = "tiny-tools"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]
# A Hermes/Qwen-style template (kept short: the test tokenizer spends a token on most
# characters): tools in a system block, assistant calls as <tool_call> JSON
# (arguments as an object), tool results as their own turns.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}("
    "{{ (t.function.parameters.properties or {}) | list | join(', ') }}){% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name"
    " }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
FLAGS = [*ENGINE_FLAGS, "--max-model-len", "1024",
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser",
         "qwen3"]
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "template.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def long_llama(make_tiny_checkpoint) -> str:
    """The tiny model with room for tools, history and a few calls."""
    return make_tiny_checkpoint("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def server(long_llama, template_file):
    srv = ServerProcess(long_llama, *FLAGS, "--served-model-name", NAME, "--chat-template",
                        template_file)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_messages_for_the_template():
    (user, call, tool) = normalize_messages(HISTORY)
    assert call["content"] == "" and tool["tool_call_id"] == "call_1"
    assert call["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2}
    assert normalize_messages([{"role": "user", "content": "hi"}], "openai")[0]["content"] == [
        {"type": "text", "text": "hi"}]
    with pytest.raises(ValueError, match=r"tool_calls\[0\].function.arguments"):
        normalize_messages([{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])


def test_content_format_auto_reads_the_template():
    assert content_format_of(TEMPLATE) == "string"
    looping = "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}" \
              "{% endfor %}"
    assert content_format_of(looping) == "openai"
    assert content_format_of(looping, "string") == "string"


@pytest.mark.slow  # the module's server (~40 s to start)
def test_tools_and_history_reach_the_prompt(http, client):
    body = {"model": NAME, "messages": HISTORY, "tools": TOOLS}
    r = http.post("/tokenize", json={**body, "return_token_strs": True})
    assert r.status_code == 200, r.text
    text = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert "Tools: get_weather(city, days) get_time()<|im_end|>" in text
    assert ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
            '</tool_call>') in text
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in text
    # the chat endpoint renders the same prompt: tool_choice "none" still shows the tools
    out = client.chat.completions.create(model=NAME, messages=HISTORY, tools=TOOLS,
                                         tool_choice="none", max_tokens=2, **GREEDY)
    assert out.usage.prompt_tokens == r.json()["count"]
    assert out.choices[0].message.tool_calls in (None, [])


def assemble(chunks) -> dict:
    """A streamed choice joined as OpenAI clients join it."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish_reason": None}
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            out["content"] += d.content or ""
            out["reasoning"] += getattr(d, "reasoning", None) or ""
            for call in d.tool_calls or ():
                slot = out["calls"].setdefault(call.index, {"id": None, "name": "",
                                                            "arguments": ""})
                if call.id:
                    assert slot["id"] is None and call.type == "function"
                    slot["id"] = call.id
                slot["name"] += call.function.name or ""
                slot["arguments"] += call.function.arguments or ""
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
    return out


def check_same(full, streamed) -> None:
    message = full.choices[0].message
    assert streamed["finish_reason"] == full.choices[0].finish_reason
    assert streamed["content"] == (message.content or "")
    assert streamed["reasoning"] == (getattr(message, "reasoning", None) or "")
    calls = [streamed["calls"][i] for i in sorted(streamed["calls"])]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)


@pytest.mark.slow  # the module's server (~40 s to start)
def test_auto_without_a_call_is_content_streamed_or_not(client):
    kw = dict(model=NAME, messages=HISTORY, tools=TOOLS, max_tokens=12, **GREEDY,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.choices[0].finish_reason == "length" and not full.choices[0].message.tool_calls
    check_same(full, assemble(client.chat.completions.create(stream=True, **kw)))


def constrained(client, **kw):
    """The response to the tools conversation, greedy (tool_choice etc. in kw)."""
    return client.chat.completions.create(model=NAME, messages=HISTORY, tools=TOOLS,
                                          **GREEDY, **kw)


def valid_calls(calls) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for call in calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.slow  # the module's server (~40 s to start)
def test_required_returns_one_valid_call(client):
    kw = dict(tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    full = constrained(client, **kw)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert len(choice.message.tool_calls) == 1
    valid_calls(choice.message.tool_calls)
    check_same(full, assemble(constrained(client, stream=True, **kw)))


@pytest.mark.slow  # the module's server (~40 s to start)
def test_required_parallel_calls_are_valid(client):
    """The random model may add calls until max_tokens cuts one off: every complete call
    still fits its schema, and the cut one comes back as content."""
    kw = dict(tool_choice="required", max_tokens=300)
    full = constrained(client, **kw)
    choice = full.choices[0]
    valid_calls(choice.message.tool_calls)
    if choice.finish_reason == "length":  # the cut call: '{"name": ...' or a prefix of it
        cut = choice.message.content
        assert cut.startswith('{"name":') or '{"name":'.startswith(cut), cut
    else:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_same(full, assemble(constrained(client, stream=True, **kw)))


@pytest.mark.slow  # the module's server (~40 s to start)
def test_named_function_returns_its_arguments(client):
    kw = dict(tool_choice={"type": "function", "function": {"name": "get_weather"}},
              max_tokens=60)
    full = constrained(client, **kw)
    (call,) = full.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and full.choices[0].finish_reason == "stop"
    valid_calls([call])
    check_same(full, assemble(constrained(client, stream=True, **kw)))


HERMES_CALL = ('<think>Paris needs a forecast.</think>Let me look.<tool_call>{"name": '
               '"get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>')


@pytest.mark.slow  # the module's server (~40 s to start)
def test_auto_parses_a_hermes_call_after_reasoning(client):
    """The regex leaves the model one output, a hermes call after reasoning, so this is the
    `auto` path end to end: reasoning split, then the call parsed, streamed or not."""
    regex = "".join("\\" + ch if ch in "{}[]().*+?^$|\\" else ch for ch in HERMES_CALL)
    kw = dict(tool_choice="auto", max_tokens=300,
              extra_body={"structured_outputs": {"regex": regex}})
    full = constrained(client, **kw)
    message = full.choices[0].message
    assert message.reasoning == "Paris needs a forecast."
    assert message.content == "Let me look."
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris", "days": 3})
    assert full.choices[0].finish_reason == "tool_calls"
    check_same(full, assemble(constrained(client, stream=True, **kw)))


@pytest.mark.parametrize("body, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, ["nope"]),
    ({"tool_choice": "required", "tools": None}, ["tools"]),
    ({"tool_choice": "whenever"}, ["whenever"]),
])
@pytest.mark.slow  # the module's server (~40 s to start)
def test_bad_tool_choice_is_a_400_naming_it(http, body, words):
    r = http.post("/v1/chat/completions", json={
        "model": NAME, "messages": HISTORY, "tools": TOOLS, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tool_choice"
    for word in words:
        assert word in error["message"]


@pytest.mark.slow  # the module's server (~40 s to start)
def test_a_second_constraint_is_refused(http):
    r = http.post("/v1/chat/completions", json={
        "model": NAME, "messages": HISTORY, "tools": TOOLS, "tool_choice": "required",
        "response_format": {"type": "json_object"}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs"
    assert "tool_choice 'required'" in r.json()["error"]["message"]


def test_llm_chat_renders_tools(long_llama, template_file):
    from jaxllm import LLM, SamplingParams

    llm = LLM(long_llama, dtype="float32", max_model_len=1024, kv_cache_memory_bytes="4M",
              enforce_eager=True, disable_log_stats=True)
    with open(template_file) as f:
        template = f.read()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    (with_tools,) = llm.chat(HISTORY, params, use_tqdm=False, chat_template=template,
                             tools=TOOLS)
    (without,) = llm.chat(HISTORY, params, use_tqdm=False, chat_template=template)
    assert "Tools: get_weather(city, days) get_time()" in with_tools.prompt
    assert "Tools:" not in without.prompt
    assert "<|im_start|>tool\nsunny, 21 C" in without.prompt
