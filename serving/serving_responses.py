"""POST /v1/responses (OpenAI's Responses API), GET /v1/responses/{id} and its cancel.

A Responses request is run as the chat completion it stands for (serving/protocol_responses.py
translates it): the same prompt rendering, limits, tool choice, tool and reasoning parsers and
structured output. The chat answer is then read back as Responses output items (reasoning,
message, function_call), whole or, for `stream`, as the typed event sequence built from the
chat stream's deltas, so both carry the same text.

Stored responses (`store`, the default) are kept in memory (serving/state.py's ResponseStore),
with the conversation that led to them: `previous_response_id` continues it.
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional, Union

from serving.errors import APIError
from serving.protocol import ChatCompletionRequest
from serving.protocol_responses import (ResponsesRequest, ResponsesResponse, ResponseUsage,
                                        chat_tools, function_call_item, input_messages,
                                        message_item, new_id, reasoning_item, response_format)
from serving.serving_chat import create_chat_completion
from serving.state import ResponseStore, ServingState

def _chat_request(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    tools, choice = chat_tools(req)
    body: dict[str, Any] = {
        "model": req.model, "messages": history, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "tools": tools,
        "tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format(req), "user": req.user, "seed": req.seed,
        "priority": req.priority, "stream": bool(req.stream)}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.instructions is not None:
        body["messages"] = [{"role": "system", "content": req.instructions}, *history]
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


def _assistant_message(output: list[dict]) -> Optional[dict]:
    """The output items as the chat assistant turn a later request continues from."""
    text = "".join(p["text"] for item in output if item["type"] == "message"
                   for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if not text and not calls:
        return None
    message: dict = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _finish(response: ResponsesResponse, finish_reason: Optional[str], usage: dict) -> None:
    response.usage = ResponseUsage(input_tokens=usage["prompt_tokens"],
                                   output_tokens=usage["completion_tokens"],
                                   total_tokens=usage["total_tokens"])
    if finish_reason == "length":
        response.status = "incomplete"
        response.incomplete_details = {"reason": "max_output_tokens"}
    else:
        response.status = "completed"


async def create_response(state: ServingState, req: ResponsesRequest, base_id: str
                          ) -> Union[ResponsesResponse, AsyncIterator[str]]:
    req.check_supported()
    state.warn_ignored_fields(req)
    store = state.responses
    history: list[dict] = []
    if req.previous_response_id is not None:
        history = list(store.get(req.previous_response_id, "previous_response_id")[1])
    history += input_messages(req)
    chat = _chat_request(req, history)
    response_id = f"resp_{base_id}"
    result = await create_chat_completion(state, chat, base_id)
    response = ResponsesResponse.of_request(req, response_id, state.model_name(req.model),
                                            "in_progress")
    if req.stream:
        return stream_events(state, req, response, result, history)
    choice = result.choices[0]
    response.output = output_items(choice.message)
    _finish(response, choice.finish_reason, result.usage.model_dump())
    _keep(store, req, response, history)
    return response


def output_items(message) -> list[dict]:
    """A chat message as output items: its reasoning, its text, then its tool calls (an
    answer with none of them is one empty message)."""
    items = []
    if message.reasoning:
        items.append(reasoning_item(message.reasoning))
    if message.content or not (message.tool_calls or message.reasoning):
        items.append(message_item(message.content or ""))
    for call in message.tool_calls:
        fn = call["function"]
        items.append(function_call_item(call["id"], fn["name"], fn["arguments"]))
    return items


def _keep(store: ResponseStore, req: ResponsesRequest, response: ResponsesResponse,
          history: list[dict]) -> None:
    if req.store is False:
        return
    reply = _assistant_message(response.output)
    store.put(response.model_dump(), history + ([reply] if reply else []))


def retrieve_response(state: ServingState, response_id: str) -> dict:
    return state.responses.get(response_id)[0]


def cancel_response(state: ServingState, response_id: str) -> dict:
    """vLLM's answer for a response that ran in the foreground (the only kind here)."""
    state.responses.get(response_id)
    raise APIError("Cannot cancel a synchronous response.", 400)


# --- stream=true: the chat stream's deltas as the Responses event sequence ------------------------

class _Events:
    """Numbers each event (sequence_number) and renders it as a server-sent event."""

    def __init__(self):
        self.number = 0

    def __call__(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"


async def stream_events(state: ServingState, req: ResponsesRequest, response: ResponsesResponse,
                  chunks: AsyncIterator[str], history: list[dict]) -> AsyncIterator[str]:
    emit = _Events()
    yield emit("response.created", response=response.model_dump())
    yield emit("response.in_progress", response=response.model_dump())
    output: list[dict] = []
    open_item: Optional[dict] = None  # the item the deltas are adding to
    calls: dict[int, dict] = {}  # chat tool-call index -> its function_call item
    finish_reason, usage = None, None

    def close(item: dict) -> list[str]:
        index = output.index(item)
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(emit("response.output_text.done", item_id=item["id"],
                               output_index=index, content_index=0, text=part["text"],
                               logprobs=[]))
            events.append(emit("response.content_part.done", item_id=item["id"],
                               output_index=index, content_index=0, part=part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events.append(emit("response.reasoning_text.done", item_id=item["id"],
                               output_index=index, content_index=0, text=part["text"]))
            events.append(emit("response.content_part.done", item_id=item["id"],
                               output_index=index, content_index=0, part=part))
        else:
            events.append(emit("response.function_call_arguments.done", item_id=item["id"],
                               output_index=index, name=item["name"],
                               arguments=item["arguments"]))
        item["status"] = "completed"
        events.append(emit("response.output_item.done", output_index=index, item=item))
        return events

    def open_(item: dict) -> list[str]:
        output.append(item)
        index = len(output) - 1
        events = [emit("response.output_item.added", output_index=index,
                       item={**item, "status": "in_progress"})]
        if item["type"] in ("message", "reasoning"):
            empty = {**item["content"][0], "text": ""}
            events.append(emit("response.content_part.added", item_id=item["id"],
                               output_index=index, content_index=0, part=empty))
        return events

    def add_text(kind: str, text: str) -> list[str]:
        nonlocal open_item
        events = []
        if open_item is None or open_item["type"] != kind:
            if open_item is not None:
                events += close(open_item)
            open_item = (message_item if kind == "message" else reasoning_item)("")
            events += open_(open_item)
        open_item["content"][0]["text"] += text
        delta_type = ("response.output_text.delta" if kind == "message"
                      else "response.reasoning_text.delta")
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(emit(delta_type, item_id=open_item["id"],
                           output_index=output.index(open_item), content_index=0, delta=text,
                           **extra))
        return events

    try:
        async with aclosing(chunks) as lines:
            async for line in lines:
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "generation failed"))
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", ()):
                    finish_reason = choice.get("finish_reason") or finish_reason
                    delta = choice.get("delta", {})
                    for event in (add_text("reasoning", delta["reasoning"])
                                  if delta.get("reasoning") else []):
                        yield event
                    for event in (add_text("message", delta["content"])
                                  if delta.get("content") else []):
                        yield event
                    for call in delta.get("tool_calls") or ():
                        fn = call.get("function") or {}
                        item = calls.get(call["index"])
                        if item is None:
                            if open_item is not None:
                                for event in close(open_item):
                                    yield event
                            item = calls[call["index"]] = function_call_item(
                                call.get("id") or new_id("call"), fn.get("name") or "", "")
                            open_item = item
                            for event in open_(item):
                                yield event
                        if fn.get("arguments"):
                            item["arguments"] += fn["arguments"]
                            yield emit("response.function_call_arguments.delta",
                                       item_id=item["id"], output_index=output.index(item),
                                       delta=fn["arguments"])
        if open_item is None and not output:  # an empty answer is still one message
            for event in open_(message_item("")):
                yield event
            open_item = output[-1]
        if open_item is not None:
            for event in close(open_item):
                yield event
        response.output = output
        _finish(response, finish_reason, usage or {"prompt_tokens": 0, "completion_tokens": 0,
                                                    "total_tokens": 0})
        _keep(state.responses, req, response, history)
        # vLLM's ending whatever the status (an output cut by max_output_tokens included):
        # the openai client's stream takes its final response from this event only.
        yield emit("response.completed", response=response.model_dump())
    except Exception as e:  # the stream has begun: report the failure in-band
        response.status, response.output = "failed", output
        response.error = {"code": "server_error", "message": str(e)}
        yield emit("error", code="server_error", message=str(e), param=None)
        yield emit("response.failed", response=response.model_dump())
