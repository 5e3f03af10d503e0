"""/v1/responses (OpenAI's Responses API) through the official openai client, against the tiny
model's `jaxllm serve`: each answer is compared with the chat completion it stands for (same
prompt tokens, same greedy text), so the translation is checked, not only the shapes.

The tiny random model writes random text, so the function call comes from a named tool_choice
and the JSON from a json_schema text format: structured output leaves the model no choice."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from server_process import NAME

GREEDY = {"temperature": 0.0}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Forecast",
        "parameters": WEATHER}


def chat(client, messages, **kw):
    return client.chat.completions.create(model=NAME, messages=messages, **kw)


def test_plain_input_is_the_chat_completion_of_one_user_message(client):
    r = client.responses.create(model=NAME, input="Hello", max_output_tokens=6, **GREEDY)
    c = chat(client, [{"role": "user", "content": "Hello"}], max_tokens=6, **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert r.output_text == c.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens,
                                                             c.usage.completion_tokens)
    assert r.usage.total_tokens == c.usage.total_tokens
    done = {"length": "incomplete", "stop": "completed"}[c.choices[0].finish_reason]
    assert r.status == done and r.output[0].type == "message"
    if done == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_instructions_and_message_items(client):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Hi"},
                          {"type": "input_text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Yes?"}]},
             {"role": "user", "content": "Go on"}]
    r = client.responses.create(model=NAME, input=items, instructions="You are terse.",
                                max_output_tokens=5, metadata={"k": "v"}, user="u1", **GREEDY)
    c = chat(client, [{"role": "system", "content": "You are terse."},
                      {"role": "developer", "content": "Be brief."},
                      {"role": "user", "content": "Hi\nthere"},
                      {"role": "assistant", "content": "Yes?"},
                      {"role": "user", "content": "Go on"}], max_tokens=5, **GREEDY)
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.output_text == c.choices[0].message.content
    assert (r.instructions, r.metadata, r.user) == ("You are terse.", {"k": "v"}, "u1")


def test_stream_events_in_order_join_to_the_whole_text(client):
    kw = dict(model=NAME, input="Tell me", max_output_tokens=8, **GREEDY)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    n = len(deltas)
    assert kinds[4:4 + n] == ["response.output_text.delta"] * n
    assert kinds[4 + n:] == ["response.output_text.done", "response.content_part.done",
                             "response.output_item.done", "response.completed"]
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0].response.id and final.status == whole.status
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored


def test_function_call_round_trip(client):
    first = client.responses.create(model=NAME, input="Weather in Paris?", tools=[TOOL],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=30, **GREEDY)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    follow = [{"role": "user", "content": "Weather in Paris?"},
              {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
               "arguments": calls[0].arguments},
              {"type": "function_call_output", "call_id": calls[0].call_id,
               "output": "sunny"}]
    second = client.responses.create(model=NAME, input=follow, tools=[TOOL],
                                     tool_choice="none", max_output_tokens=4, **GREEDY)
    c = chat(client, [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": calls[0].call_id, "type": "function", "function": {
                              "name": "get_weather", "arguments": calls[0].arguments}}]},
                      {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}],
             tools=[{"type": "function", "function": {"name": "get_weather",
                                                      "parameters": WEATHER}}],
             tool_choice="none", max_tokens=4, **GREEDY)
    assert second.usage.input_tokens == c.usage.prompt_tokens
    assert second.output_text == c.choices[0].message.content


class Pick(BaseModel):
    colour: Literal["red", "green", "blue"]
    size: int = Field(ge=1, le=9)


def test_json_schema_text_format_and_parse(client):
    r = client.responses.parse(model=NAME, input="Pick", text_format=Pick,
                               max_output_tokens=40, temperature=1.0)
    assert isinstance(r.output_parsed, Pick)
    raw = client.responses.create(model=NAME, input="Pick", max_output_tokens=40,
                                  text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(raw.output_text), dict)


def test_previous_response_id_continues_the_conversation(client, http):
    first = client.responses.create(model=NAME, input="Hello", max_output_tokens=4, **GREEDY)
    second = client.responses.create(model=NAME, input="And?", previous_response_id=first.id,
                                     max_output_tokens=4, **GREEDY)
    c = chat(client, [{"role": "user", "content": "Hello"},
                      {"role": "assistant", "content": first.output_text},
                      {"role": "user", "content": "And?"}], max_tokens=4, **GREEDY)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == c.usage.prompt_tokens
    assert second.output_text == c.choices[0].message.content
    assert client.responses.retrieve(first.id).output_text == first.output_text
    unstored = client.responses.create(model=NAME, input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=NAME, input="x", previous_response_id="resp_nope")
    r = http.post(f"/v1/responses/{first.id}/cancel")
    assert r.status_code == 400 and "synchronous" in r.json()["error"]["message"]


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"text": {"format": {"type": "grammar"}}}, "text"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(http, extra, param):
    r = http.post("/v1/responses", json={"model": NAME, "input": "x", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_the_routes_need_the_api_key(server):
    import httpx

    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"),
                         ("POST", "/v1/responses/resp_x/cancel")):
        r = httpx.request(method, server.url + path, json={"model": NAME, "input": "x"})
        assert r.status_code == 401, (path, r.text)


def test_streamed_function_call_matches_the_whole_one(client):
    kw = dict(model=NAME, input="Weather in Paris?", tools=[TOOL], max_output_tokens=30,
              tool_choice={"type": "function", "name": "get_weather"}, **GREEDY)
    whole = [o for o in client.responses.create(**kw).output if o.type == "function_call"]
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert "".join(deltas) == done.arguments == call.arguments == whole[0].arguments
    assert call.name == done.name == "get_weather" and call.call_id


# --- the chat stream -> Responses events, on a recorded chat stream (no model) ----------------

def _chunk(delta: dict, finish=None) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta,
                                               "finish_reason": finish}]}) + "\n\n"


async def _events(chunks: list[str]) -> list[dict]:
    from types import SimpleNamespace

    from serving.protocol_responses import ResponsesRequest, ResponsesResponse
    from serving.serving_responses import stream_events
    from serving.state import ResponseStore

    async def lines():
        for c in chunks:
            yield c

    req = ResponsesRequest(input="x", store=False)
    response = ResponsesResponse.of_request(req, "resp_1", "m", "in_progress")
    out = []
    state = SimpleNamespace(responses=ResponseStore())
    async for text in stream_events(state, req, response, lines(), []):
        out.append(json.loads(text.split("data: ", 1)[1]))
    return out


def test_reasoning_text_and_calls_become_items_in_order():
    import asyncio

    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5,
                                                 "total_tokens": 8}})
    events = asyncio.run(_events([
        _chunk({"role": "assistant", "content": ""}), _chunk({"reasoning": "Let me "}),
        _chunk({"reasoning": "think."}), _chunk({"content": "Calling."}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                "function": {"name": "f", "arguments": "{\"a\""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "tool_calls"),
        f"data: {usage}\n\n", "data: [DONE]\n\n"]))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Let me think."
    assert final["output"][1]["content"][0]["text"] == "Calling."
    assert (final["output"][2]["call_id"], final["output"][2]["arguments"]) == ("call_a",
                                                                                '{"a": 1}')
    assert final["usage"]["output_tokens"] == 5 and final["status"] == "completed"


def test_an_error_inside_the_stream_fails_the_response():
    import asyncio

    events = asyncio.run(_events([_chunk({"content": "Hi"}), 'data: {"error": {"message": '
                                  '"boom", "code": 500}}\n\n']))
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["error"]["message"] == "boom"


def test_a_whole_chat_message_becomes_the_same_items():
    from serving.protocol import ChatMessage
    from serving.serving_responses import output_items

    items = output_items(ChatMessage(role="assistant", reasoning="Hmm.", content="Ok.",
                                     tool_calls=[{"id": "call_b", "type": "function",
                                                  "function": {"name": "g",
                                                               "arguments": "{}"}}]))
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert (items[0]["content"][0]["text"], items[1]["content"][0]["text"]) == ("Hmm.", "Ok.")
    assert (items[2]["call_id"], items[2]["name"]) == ("call_b", "g")
    (empty,) = output_items(ChatMessage(role="assistant", content=None))
    assert empty["type"] == "message" and empty["content"][0]["text"] == ""


@pytest.mark.slow  # its own model load (~25 s)
def test_run_batch_answers_responses_lines(tmp_path, tiny_llama, client):
    import subprocess
    import sys

    from server_process import ENGINE_FLAGS

    body = {"model": NAME, "input": "Hello", "max_output_tokens": 5, **GREEDY}
    lines = [{"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": body},
             {"custom_id": "bad", "method": "POST", "url": "/v1/responses",
              "body": {**body, "background": True}}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = subprocess.run([sys.executable, "-m", "serving.cli.main", "run-batch", "-i", str(src),
                        "-o", str(dst), "--model", tiny_llama, "--served-model-name", NAME,
                        *ENGINE_FLAGS], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    ok, bad = [json.loads(line) for line in dst.read_text().splitlines()]
    assert bad["error"]["param"] == "background" and bad["response"] is None
    out = ok["response"]["body"]
    assert out["object"] == "response" and out["status"] in ("completed", "incomplete")
    served = client.responses.create(**body)
    assert out["output"][0]["content"][0]["text"] == served.output_text
