"""vLLM's `qwen3_coder` tool-call format (Qwen3-Coder, Qwen3-Next and later Qwen templates):
XML-like blocks whose parameter values are text:

  I'll look.<tool_call>
  <function=get_weather>
  <parameter=city>
  Paris
  </parameter>
  <parameter=days>
  3
  </parameter>
  </function>
  </tool_call>

One newline after <parameter=NAME> and one before </parameter> frame the value and are not
part of it. Values are typed by the request's tool schema as vLLM types them
(xml_values.qwen3_coder_value: integers, numbers, booleans, objects/arrays as JSON; a string or
a parameter the schema does not list stays text). As in vLLM, a missing </parameter> ends the
value at the next <parameter= or </function>, and a missing </function> at the block's end.
Blocks sit among the text as `hermes` blocks do (markup.blocks_scan); a block that is not one
function with its parameters is content. An output whose first call has no <tool_call> around
it (`<function=...>...</function>` alone, which vLLM also accepts) is read as blocks of bare
functions.
"""

from __future__ import annotations

import json
import re

from jaxllm.entrypoints.openai_parsers.text_utils import safe_prefix
from jaxllm.entrypoints.openai_parsers.tool_parsers.base import Scan, ToolParser
from jaxllm.entrypoints.openai_parsers.tool_parsers.markup import blocks_scan
from jaxllm.entrypoints.openai_parsers.tool_parsers.xml_values import qwen3_coder_value

START, END = "<tool_call>", "</tool_call>"
BARE_START, BARE_END = "<function=", "</function>"
FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|"
                       r"(?=</function>)|$)", re.S)
FUNCTION_END = re.compile(r"\s*(?:</function>\s*)?")


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def scan(self, text: str, final: bool):
        wrapped, bare = text.find(START), text.find(BARE_START)
        if wrapped < 0 and bare < 0 and not final:  # hold back what could begin either
            return Scan(min((safe_prefix(text, m) for m in (START, BARE_START)), key=len))
        if bare >= 0 and (wrapped < 0 or bare < wrapped):  # the first marker decides
            return blocks_scan(text, final, BARE_START, BARE_END,
                               lambda body: self._call(BARE_START + body))
        return blocks_scan(text, final, START, END, self._call)

    def _call(self, body: str):
        m = FUNCTION.match(body)
        if not m or not m.group(1).strip():
            return None
        name = m.group(1).strip()
        props, args, pos = self.parameters(name), {}, m.end()
        while True:
            end = FUNCTION_END.fullmatch(body, pos)
            if end:
                return name, json.dumps(args, ensure_ascii=False)
            p = PARAMETER.match(body, pos)
            if not p or p.end() == pos:
                return None
            value = p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            key = p.group(1).strip()
            args[key] = qwen3_coder_value(value, props.get(key))
            pos = p.end()
