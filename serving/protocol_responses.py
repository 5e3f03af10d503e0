"""Request and response bodies of /v1/responses (OpenAI's Responses API, as vLLM serves it), and
the translation of a Responses request into the chat machinery's messages, tools and
response_format: the handler (serving/serving_responses.py) runs it as a chat completion.

What a Responses request may hold that the chat path cannot do (built-in tools, background
mode, `include` values, reasoning effort, images) is refused with a 400 naming the field.
Unknown fields are logged and ignored, as on every other route.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from serving.errors import APIError
from serving.protocol import RequestBody, random_id

# Input content part types read as text (an assistant turn given back has output_text parts).
TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "system", "developer", "assistant")


class ResponsesRequest(RequestBody):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    text: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    reasoning: Optional[dict[str, Any]] = None
    store: Optional[bool] = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    stream: Optional[bool] = False
    # Accepted only at the values this server gives.
    background: Optional[bool] = False
    include: Optional[list[str]] = None
    truncation: Optional[str] = "disabled"
    top_logprobs: Optional[int] = None
    max_tool_calls: Optional[int] = None
    service_tier: Optional[str] = None
    prompt: Optional[dict[str, Any]] = None
    stream_options: Optional[dict[str, Any]] = None
    conversation: Optional[Any] = None
    # vLLM's extras shared with chat.
    seed: Optional[int] = None
    priority: int = 0

    def check_supported(self) -> None:
        refuse = [("background", bool(self.background), "background mode"),
                  ("include", bool(self.include), "`include` values"),
                  ("truncation", self.truncation not in (None, "disabled"),
                   "truncation other than 'disabled'"),
                  ("top_logprobs", bool(self.top_logprobs), "logprobs"),
                  ("max_tool_calls", self.max_tool_calls is not None, "max_tool_calls"),
                  ("service_tier", self.service_tier not in (None, "auto", "default"),
                   "service tiers"),
                  ("prompt", self.prompt is not None, "stored prompt templates"),
                  ("stream_options", self.stream_options is not None, "stream_options"),
                  ("conversation", self.conversation is not None, "conversations")]
        for field, bad, what in refuse:
            if bad:
                raise APIError(f"{field}: {what} are not supported by this server.", param=field)
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise APIError("reasoning: effort and summary settings are not supported by this "
                           "server (reasoning items come from --reasoning-parser).",
                           param="reasoning")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise APIError("max_output_tokens must be at least 1.", param="max_output_tokens")
        if self.previous_response_id is not None and self.conversation is not None:
            raise APIError("previous_response_id cannot be used with conversation.",
                           param="previous_response_id")


# --- the request -> chat messages, tools, response_format -----------------------------------------

def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of content parts.",
                       param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(f"{where}.content[{j}]: part type {kind!r} is not supported (text "
                           f"only: input_text, output_text).", param="input")
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's `input` as chat messages: message items by role, function_call items as
    assistant tool calls (consecutive ones in one turn), function_call_output items as tool
    turns. Reasoning items given back are dropped, as chat templates drop earlier turns'
    reasoning."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict] = []
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise APIError(f"{where}.role must be one of {', '.join(ROLES)}.", param="input")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": item.get("arguments", "")}}
            if not isinstance(call["id"], str) or not isinstance(call["function"]["name"], str):
                raise APIError(f"{where}: a function_call needs a string call_id and name.",
                               param="input")
            last = out[-1] if out else None
            if last and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise APIError(f"{where}: a function_call_output needs a string call_id.",
                               param="input")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(output, where) if output is not None else ""})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(f"{where}: input item type {kind!r} is not supported (message, "
                           f"function_call, function_call_output, reasoning).", param="input")
    if not out:
        raise APIError("input must hold at least one message.", param="input")
    return out


def chat_tools(req: ResponsesRequest) -> tuple[Optional[list[dict]], Any]:
    """Function tools and tool_choice in the chat spelling; built-in tools are refused."""
    tools = None
    if req.tools is not None:
        tools = []
        for i, tool in enumerate(req.tools):
            kind = tool.get("type")
            if kind != "function":
                raise APIError(f"tools[{i}]: tool type {kind!r} is not supported (function "
                               f"tools only).", param="tools")
            if not isinstance(tool.get("name"), str):
                raise APIError(f"tools[{i}]: a function tool needs a string name.",
                               param="tools")
            fn = {"name": tool["name"], "parameters": tool.get("parameters") or {
                "type": "object", "properties": {}}}
            if tool.get("description") is not None:
                fn["description"] = tool["description"]
            tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(f"tool_choice of type {choice.get('type')!r} is not supported "
                           f"(auto, none, required or a named function).", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def response_format(req: ResponsesRequest) -> Optional[dict]:
    """text.format as chat's response_format (the structured-output path)."""
    text = req.text or {}
    unknown = sorted(set(text) - {"format"})
    if any(text.get(k) is not None for k in unknown):
        raise APIError(f"text.{unknown[0]} is not supported by this server.", param="text")
    fmt = text.get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError("text.format: json_schema needs a `schema` object.", param="text")
        spec = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise APIError(f"text.format type {fmt.get('type')!r} is not supported (text, json_object, "
                   f"json_schema).", param="text")


# --- the response ---------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}_{random_id()}"


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(
        default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class ResponsesResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    error: Optional[dict[str, Any]] = None
    incomplete_details: Optional[dict[str, Any]] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    metadata: Optional[dict[str, str]] = None
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    store: bool = True
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Union[str, dict[str, Any]] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: str = "disabled"
    background: bool = False
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None

    @classmethod
    def of_request(cls, req: ResponsesRequest, response_id: str, model: str,
                   status: str) -> "ResponsesResponse":
        """The response's echo of the request, with no output yet."""
        return cls(id=response_id, model=model, status=status, instructions=req.instructions,
                   max_output_tokens=req.max_output_tokens, metadata=req.metadata,
                   parallel_tool_calls=req.parallel_tool_calls is not False,
                   previous_response_id=req.previous_response_id, reasoning=req.reasoning,
                   store=req.store is not False, temperature=req.temperature,
                   top_p=req.top_p, text=req.text or {"format": {"type": "text"}},
                   tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
                   tools=req.tools or [], user=req.user)


def message_item(text: str, item_id: Optional[str] = None, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def reasoning_item(text: str, item_id: Optional[str] = None,
                   status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def function_call_item(call_id: str, name: str, arguments: str, item_id: Optional[str] = None,
                       status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}
