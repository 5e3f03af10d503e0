"""vLLM's `glm45` tool-call format (GLM-4.5/4.6): each call a block naming the function on its
first line, then its arguments as key/value pairs whose values are text:

  Let me check.<tool_call>get_weather
  <arg_key>city</arg_key>
  <arg_value>Paris</arg_value>
  <arg_key>days</arg_key>
  <arg_value>3</arg_value>
  </tool_call>

A value is the text where the request's tool schema types that argument as a string, else it
is read as JSON (or a Python literal), as vLLM does (xml_values.py). Blocks sit among the text
as `hermes` blocks do (markup.blocks_scan); a block with anything but key/value pairs after
the name is content.
"""

from __future__ import annotations

import json
import re

from jaxllm.entrypoints.openai_parsers.tool_parsers.base import ToolParser
from jaxllm.entrypoints.openai_parsers.tool_parsers.markup import blocks_scan
from jaxllm.entrypoints.openai_parsers.tool_parsers.xml_values import glm45_value

START, END = "<tool_call>", "</tool_call>"
NAME = re.compile(r"\s*([^\s<]+)\s*")
PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)


class Glm45ToolParser(ToolParser):
    name = "glm45"

    def scan(self, text: str, final: bool):
        return blocks_scan(text, final, START, END, self._call)

    def _call(self, body: str):
        first = body.find("<arg_key>")
        head = body if first < 0 else body[:first]
        m = NAME.fullmatch(head)
        if not m:
            return None
        name, props, args, pos = m.group(1), self.parameters(m.group(1)), {}, len(head)
        while pos < len(body):
            pair = PAIR.match(body, pos)
            if not pair:
                return None
            key, value = pair.group(1).strip(), pair.group(2).strip()
            args[key] = glm45_value(value, props.get(key))
            pos = pair.end()
        return name, json.dumps(args, ensure_ascii=False)
