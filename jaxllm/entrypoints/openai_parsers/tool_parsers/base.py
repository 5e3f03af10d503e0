"""The shared machinery of the tool-call parsers: one `scan` per format, and from it both the
whole-output `extract` and the streaming `extract_delta`.

Why one scan for both: a format parser only says, for a text that may still be growing, which
part is content so far and which calls are complete. Streaming emits what is new since the last
delta, so the deltas reassemble to exactly what `extract` returns on the final text (content,
names and arguments), whatever the chunking. A call goes out whole (id, name and arguments in
one delta) once its text is complete and parses: sending a name earlier could not be taken back
if the call then turned out malformed.
Malformed output is content, never an exception: from the first block or call that does not
parse, the text is content (a stream holds an unfinished call back and releases it as content
from `flush()` if it never completes).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import ClassVar, Optional


def _tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=_tool_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: Optional[str]
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class Scan:
    """What a format parser reads from a (possibly partial) output."""
    content: str                                   # text that is content, so far
    # complete calls: (name, arguments), or (name, arguments, id) where the format names its
    # calls (Kimi-K2's `functions.get_weather:0`)
    calls: list[tuple] = field(default_factory=list)


class ToolParser:
    """Base of a format parser; one instance per request (the stream state lives here)."""
    name: ClassVar[str]

    def __init__(self, tokenizer=None, tools=None):
        self.tokenizer = tokenizer
        # The request's `tools` (OpenAI function tools): formats that write argument values
        # as text (qwen3_coder, glm45) type them by each function's JSON schema.
        self.tools = tools or []
        self._content_sent = ""
        self._calls_sent = 0

    def scan(self, text: str, final: bool) -> Scan:
        """Subclasses: read `text`; when not final, hold back any content that could still
        turn out to be the start of a tool call."""
        raise NotImplementedError

    def new_id(self) -> str:
        return _tool_call_id()

    def extract(self, text: str) -> ExtractedToolCalls:
        s = self.scan(text, final=True)
        if not s.calls:
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(s.content if s.content.strip() else None,
                                  [ToolCall(c[0], c[1], self._id(c)) for c in s.calls])

    def extract_delta(self, previous_text: str, current_text: str,
                      delta_text: str) -> Optional[dict]:
        """The OpenAI delta (`{"content": ..., "tool_calls": [...]}`) that `delta_text` adds,
        or None when there is nothing to send yet."""
        del previous_text, delta_text  # the scan reads the whole current text
        return self._delta(self.scan(current_text, final=False))

    def flush(self, current_text: str) -> Optional[dict]:
        """The last delta of a finished stream: what was held back (an unfinished call is
        content now)."""
        return self._delta(self.scan(current_text, final=True))

    def _delta(self, s: Scan) -> Optional[dict]:
        out: dict = {}
        if s.content.startswith(self._content_sent) and len(s.content) > len(self._content_sent):
            out["content"] = s.content[len(self._content_sent):]
            self._content_sent = s.content
        new = [{"index": i, "id": self._id(c), "type": "function",
                "function": {"name": c[0], "arguments": c[1]}}
               for i, c in enumerate(s.calls) if i >= self._calls_sent]
        if new:
            out["tool_calls"] = new
            self._calls_sent = len(s.calls)
        return out or None

    def _id(self, call: tuple) -> str:
        return call[2] if len(call) > 2 else self.new_id()

    def parameters(self, function: str) -> dict:
        """The JSON-schema `properties` of the request's tool `function` ({} if unknown)."""
        for tool in self.tools:
            tool = tool if isinstance(tool, dict) else getattr(tool, "model_dump", dict)()
            fn = tool.get("function") or {}
            if fn.get("name") == function:
                props = (fn.get("parameters") or {}).get("properties")
                return props if isinstance(props, dict) else {}
        return {}


# ---------------------------------------------------------------------------- format helpers


def call_from_object(obj, args_keys=("arguments",)) -> Optional[tuple[str, str]]:
    """{"name": str, "arguments": object or JSON text} -> (name, arguments JSON), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


_DECODER = json.JSONDecoder()


def json_objects(text: str, pos: int, separators: str):
    """Reads JSON values from text[pos:] separated by any of `separators` (and whitespace).
    Returns (values, end, rest): the complete values as (value, start), where reading stopped,
    and whether the rest is nothing (None), may be an unfinished value (True) or is not JSON
    (False)."""
    values = []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text):
            return values, pos, None
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return values, pos, text[pos] in "{["
        values.append((value, pos))
        pos = end


def read_calls(s: Scan, text: str, pos: int, separators: str, final: bool,
               args_keys=("arguments",)) -> Scan:
    """Adds to `s` the calls written as JSON objects from text[pos:] (see `json_objects`):
    from the first object that is not a call, or (once final) from a tail that is not JSON,
    the text is content; an unfinished object is held back while the output may grow."""
    values, end, rest = json_objects(text, pos, separators)
    for value, at in values:
        call = call_from_object(value, args_keys)
        if call is None:
            return with_tail(s, text, at)
        s.calls.append(call)
    if rest is None or (rest and not final):
        return s
    return with_tail(s, text, end)


def with_tail(s: Scan, text: str, pos: int) -> Scan:
    """From `pos` on the text is not a call: it is content (all of it if no call came
    before, so that an output without calls is returned exactly)."""
    s.content = s.content + text[pos:] if s.calls else text
    return s
