"""vLLM's `granite` tool-call format (Granite 3.0: `<|tool_call|>`, Granite 3.1+: the text
`<tool_call>`): an output that is a JSON list of calls, after the marker.

  <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]

As in vLLM, only an output that starts with the list (after whitespace and the optional
markers) has calls, and a list any element of which is not a call is content, all of it. Text
after the list is content (vLLM would make the whole output content; a stream has sent the
calls by then).
The calls are reported when the list closes.
"""

from __future__ import annotations

import json

from jaxllm.entrypoints.openai_parsers.tool_parsers.base import (Scan, ToolParser,
                                                                 call_from_object)

MARKERS = ("<|tool_call|>", "<tool_call>")
_DECODER = json.JSONDecoder()


def _list_start(text: str):
    """Where the list starts, "maybe" if `text` could still become a list's beginning, or
    None when the output is not a tool-call list."""
    pos = len(text) - len(text.lstrip())
    for marker in MARKERS:
        rest = text[pos:]
        if rest.startswith(marker):
            pos += len(marker)
            pos += len(text[pos:]) - len(text[pos:].lstrip())
        elif marker.startswith(rest):
            return "maybe"
    if pos == len(text):
        return "maybe"
    return pos if text[pos] == "[" else None


class GraniteToolParser(ToolParser):
    name = "granite"

    def scan(self, text: str, final: bool) -> Scan:
        start = _list_start(text)
        if start is None or (start == "maybe" and final):
            return Scan(text)
        if start == "maybe":
            return Scan("")
        try:
            calls, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            return Scan("" if not final else text)
        found = [call_from_object(c) for c in calls] if isinstance(calls, list) else [None]
        if not found or None in found:
            return Scan(text)
        tail = text[end:]
        return Scan(tail if tail.strip() else "", found)
