"""vLLM's `llama3_json` tool-call format (Llama 3.1/3.2/3.3 with JSON tool calling):

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The output is the calls: JSON objects separated by ";", optionally after <|python_tag|>, with
the arguments under "parameters" (or "arguments"). Output that does not start so is content,
and so is the text from the first object that is not a call.
"""

from __future__ import annotations

from jaxllm.entrypoints.openai_parsers.tool_parsers.base import Scan, ToolParser, read_calls

BOT = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        if not final and BOT.startswith(body):  # maybe the tag, still arriving
            return Scan("")
        start = len(text) - len(body) + (len(BOT) if body.startswith(BOT) else 0)
        if not text.startswith((BOT, "{"), len(text) - len(body)):
            return Scan(text)
        return read_calls(Scan(""), text, start, ";", final, ("parameters", "arguments"))


class Llama4JsonToolParser(Llama3JsonToolParser):
    """vLLM's `llama4_json`: Llama 4's JSON tool calls, in Llama 3's format (vLLM registers
    one parser under both names)."""
    name = "llama4_json"
