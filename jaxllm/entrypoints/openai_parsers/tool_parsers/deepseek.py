"""vLLM's `deepseek_v3` and `deepseek_v31` tool-call formats (DeepSeek-V3/R1 and V3.1+): after
the content, one section of calls between DeepSeek's special tokens.

  deepseek_v3:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
                 ```json
                 {"city": "Paris"}
                 ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
  deepseek_v31:  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>
                 {"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(V3's call is `type<sep>name`, then the arguments in a ```json fence; V3.1 drops the type and
the fence.) The arguments must be a JSON object; anything else makes the call content.
"""

from __future__ import annotations

from jaxllm.entrypoints.openai_parsers.tool_parsers.base import ToolParser, call_from_object
from jaxllm.entrypoints.openai_parsers.tool_parsers.markup import section_scan

SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
SEP = "<｜tool▁sep｜>"
FENCE = ("```json", "```")


def _v3_call(body: str):
    kind, sep, rest = body.partition(SEP)
    name, newline, fenced = rest.partition("\n")
    fenced = fenced.strip()
    if not (sep and newline and kind.strip() == "function" and name.strip()
            and fenced.startswith(FENCE[0]) and fenced.endswith(FENCE[1])
            and len(fenced) >= len(FENCE[0]) + len(FENCE[1])):
        return None
    args = fenced[len(FENCE[0]):-len(FENCE[1])]
    return call_from_object({"name": name.strip(), "arguments": args})


def _v31_call(body: str):
    name, sep, args = body.partition(SEP)
    if not (sep and name.strip()) or SEP in args:
        return None
    return call_from_object({"name": name.strip(), "arguments": args})


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"

    def scan(self, text: str, final: bool):
        return section_scan(text, final, SECTION, CALL, _v3_call)


class DeepSeekV31ToolParser(ToolParser):
    name = "deepseek_v31"

    def scan(self, text: str, final: bool):
        return section_scan(text, final, SECTION, CALL, _v31_call)
