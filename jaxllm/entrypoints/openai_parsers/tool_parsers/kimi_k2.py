"""vLLM's `kimi_k2` tool-call format (Kimi-K2): after the content, one section of calls, each
named `functions.NAME:INDEX`, which is also the call's id (as vLLM, so that the tool result the
client sends back with that id renders as the model's template expects):

  <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
  <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The name is what follows the last `.` before the `:`; the arguments must be a JSON object.
Kimi also writes the section markers in the singular (`<|tool_call_section_begin|>`), which
vLLM's parser accepts too.
"""

from __future__ import annotations

import re

from jaxllm.entrypoints.openai_parsers.text_utils import safe_prefix
from jaxllm.entrypoints.openai_parsers.tool_parsers.base import Scan, ToolParser, call_from_object
from jaxllm.entrypoints.openai_parsers.tool_parsers.markup import section_scan

SECTIONS = (("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
            ("<|tool_call_section_begin|>", "<|tool_call_section_end|>"))
CALL = ("<|tool_call_begin|>", "<|tool_call_end|>")
ARGS = "<|tool_call_argument_begin|>"
CALL_ID = re.compile(r"\s*([^\s<]+:\d+)\s*")


def _call(body: str):
    head, sep, args = body.partition(ARGS)
    m = CALL_ID.fullmatch(head)
    if not (sep and m):
        return None
    call_id = m.group(1)
    name = call_id.rsplit(":", 1)[0].split(".")[-1]
    found = call_from_object({"name": name, "arguments": args}) if name else None
    return found and (*found, call_id)


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"

    def scan(self, text: str, final: bool):
        found = [(text.find(begin), (begin, end)) for begin, end in SECTIONS if begin in text]
        if not found:  # hold back what could begin either spelling
            return Scan(text if final else min((safe_prefix(text, begin)
                                                for begin, _ in SECTIONS), key=len))
        return section_scan(text, final, min(found)[1], CALL, _call)
