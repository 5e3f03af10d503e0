"""The outputs of tool_choice "required" and a named function (structured_output/tool_choice.py
constrains them), read as tool calls like any other format, so the server streams and finishes
them through the same ToolParser interface as `auto`.

  required  [{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]
  named     {"city": "Paris"}  (the arguments of the one function tool_choice names)

Not in the `--tool-call-parser` registry: the request, not the model, picks these.
"""

from __future__ import annotations

from typing import Optional

from jaxllm.entrypoints.openai_parsers.tool_parsers.base import (Scan, ToolParser,
                                                                 call_from_object, json_objects,
                                                                 with_tail)


class RequiredToolParser(ToolParser):
    """A JSON array of {name, parameters}; each call goes out as soon as its object closes."""
    name = "required"

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        if not body.startswith("["):
            return Scan(text if final or body else "")
        values, end, rest = json_objects(text, len(text) - len(body) + 1, ",]")
        s = Scan("")
        for value, at in values:
            call = call_from_object(value, ("parameters",))
            if call is None:
                return with_tail(s, text, at)
            s.calls.append(call)
        if rest is None or (rest and not final):
            return s
        return with_tail(s, text, end)


class NamedToolParser(ToolParser):
    """The whole output is the arguments of `function`. As vLLM, the arguments are the output
    text as written, and a stream sends the call's id, type and name first, then the argument
    text as it grows (what OpenAI clients accumulate)."""
    name = "named"

    def __init__(self, function: str, tokenizer=None):
        super().__init__(tokenizer)
        self.function = function
        self._args_sent: Optional[str] = None

    def scan(self, text: str, final: bool) -> Scan:
        return Scan("", [(self.function, text)]) if final else Scan("")

    def extract_delta(self, previous_text: str, current_text: str,
                      delta_text: str) -> Optional[dict]:
        del previous_text, delta_text
        if self._args_sent is None:
            if not current_text:
                return None
            self._args_sent = current_text
            return {"tool_calls": [{"index": 0, "id": self.new_id(), "type": "function",
                                    "function": {"name": self.function,
                                                 "arguments": current_text}}]}
        new = current_text[len(self._args_sent):]
        if not new:
            return None
        self._args_sent = current_text
        return {"tool_calls": [{"index": 0, "function": {"arguments": new}}]}

    def flush(self, current_text: str) -> Optional[dict]:
        return self.extract_delta("", current_text, "")
