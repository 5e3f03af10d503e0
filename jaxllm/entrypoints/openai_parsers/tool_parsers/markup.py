"""Scans shared by the tool-call formats that wrap each call in begin/end markers.

Two shapes:
- `section_scan`: content, then one section of calls that runs to the end of the output
  (DeepSeek-V3/V3.1, Kimi-K2: `<section begin><call begin>...<call end>...<section end>`).
  The content is the text before the section, as in vLLM.
- `blocks_scan`: call blocks `<tool_call>...</tool_call>` among the text (GLM-4.5,
  Qwen3-Coder), read as the `hermes` parser reads its blocks: text before the first block is
  content as written, text between and after blocks only when it is not just whitespace, and
  the last block may lack its end marker once the output is final (generation stopped there).

Both follow base.py's rules: a call is reported once its end marker has arrived and its body
parses; from the first call that does not parse (or text that is neither a call nor the end of
the section) the text is content; while the output may still grow, a tail that could be the
start of a marker is held back.
"""

from __future__ import annotations

from typing import Callable, Optional

from jaxllm.entrypoints.openai_parsers.text_utils import safe_prefix
from jaxllm.entrypoints.openai_parsers.tool_parsers.base import Scan, with_tail

# A call body -> (name, arguments JSON) or (name, arguments JSON, id), or None if malformed.
BodyParser = Callable[[str], Optional[tuple]]


def section_scan(text: str, final: bool, section: tuple[str, str], call: tuple[str, str],
                 parse: BodyParser) -> Scan:
    begin = text.find(section[0])
    if begin < 0:
        return Scan(text if final else safe_prefix(text, section[0]))
    s, pos = Scan(text[:begin]), begin + len(section[0])
    while True:
        at = pos
        while at < len(text) and text[at].isspace():
            at += 1
        rest = text[at:]
        if rest.startswith(section[1]):  # the section ends; later text is content
            if not s.calls:
                return with_tail(s, text, 0)
            tail = text[at + len(section[1]):]
            if tail.strip():
                s.content += tail
            return s
        if not rest:
            return s if s.calls or not final else with_tail(s, text, 0)
        if not rest.startswith(call[0]):
            if not final and (call[0].startswith(rest) or section[1].startswith(rest)):
                return s  # a marker still arriving
            return with_tail(s, text, at)
        body = at + len(call[0])
        end = text.find(call[1], body)
        if end < 0:
            return s if not final else with_tail(s, text, at)
        found = parse(text[body:end])
        if found is None:
            return with_tail(s, text, at)
        s.calls.append(found)
        pos = end + len(call[1])


def blocks_scan(text: str, final: bool, start: str, end: str, parse: BodyParser) -> Scan:
    s, pos = Scan(""), 0
    while True:
        begin = text.find(start, pos)
        if begin < 0:
            s.content += _between(text[pos:] if final else safe_prefix(text[pos:], start), pos)
            return s
        s.content += _between(text[pos:begin], pos)
        body = begin + len(start)
        close = text.find(end, body)
        if close < 0 and not final:
            return s
        stop = len(text) if close < 0 else close + len(end)
        found = parse(text[body:] if close < 0 else text[body:close])
        if found is None:
            s.content += text[begin:stop]
        else:
            s.calls.append(found)
        if close < 0:
            return s
        pos = stop


def _between(segment: str, pos: int) -> str:
    return segment if pos == 0 or segment.strip() else ""
