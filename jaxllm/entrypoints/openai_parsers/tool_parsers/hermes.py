"""vLLM's `hermes` tool-call format (Hermes 2 Pro, Qwen 2.5/3, many fine-tunes):

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each call is a JSON object inside <tool_call>...</tool_call>; text outside the blocks is
content (whitespace between blocks aside), and so is a block that does not parse. As in vLLM,
the last block may lack its closing tag (generation stopped there).
"""

from __future__ import annotations

import json

from jaxllm.entrypoints.openai_parsers.tool_parsers.base import Scan, ToolParser, call_from_object
from jaxllm.entrypoints.openai_parsers.tool_parsers.markup import blocks_scan

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        return blocks_scan(text, final, START, END, _call)


def _call(body: str):
    try:
        return call_from_object(json.loads(body))
    except json.JSONDecodeError:
        return None
