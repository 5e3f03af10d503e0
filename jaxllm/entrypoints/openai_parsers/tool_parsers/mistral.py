"""vLLM's `mistral` tool-call format (Mistral 7B v0.3, Mistral Small/Large, Nemo):

    Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

and the newer tokenizers' (v11+) spelling, one call after another:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

Text before the first [TOOL_CALLS] is content, and so is the text from the first call that does
not parse. [TOOL_CALLS] and [ARGS] are special tokens, so the request must be detokenized with
skip_special_tokens=False (vLLM does the same). Call ids are 9 letters and digits, as Mistral's
chat templates require.
"""

from __future__ import annotations

import json
import random
import re
import string

from jaxllm.entrypoints.openai_parsers.text_utils import safe_prefix
from jaxllm.entrypoints.openai_parsers.tool_parsers.base import (Scan, ToolParser,
                                                                 call_from_object, read_calls,
                                                                 with_tail)

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ALNUM = string.ascii_letters + string.digits
_NAME = re.compile(r"\s*([A-Za-z_][\w.-]*)\s*$")
_DECODER = json.JSONDecoder()


class MistralToolParser(ToolParser):
    name = "mistral"

    def new_id(self) -> str:
        return "".join(random.choices(_ALNUM, k=9))

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(BOT)
        if start < 0:
            return Scan(text if final else safe_prefix(text, BOT))
        s, pos = Scan(text[:start]), start + len(BOT)
        if text[pos:].lstrip().startswith("["):
            return read_calls(s, text, text.index("[", pos) + 1, ",]", final)
        while True:  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
            args = text.find(ARGS, pos)
            if args < 0:  # hold a name (and the start of [ARGS]) that is still arriving
                head = safe_prefix(text[pos:], ARGS)
                unfinished = not head.strip() or _NAME.match(head)
                return s if not final and unfinished else with_tail(s, text, pos)
            name = _NAME.match(text[pos:args])
            at = args + len(ARGS)
            at += len(text[at:]) - len(text[at:].lstrip())
            try:
                value, end = _DECODER.raw_decode(text, at)
            except json.JSONDecodeError:
                unfinished = at == len(text) or text.startswith("{", at)
                return s if not final and unfinished else with_tail(s, text, pos)
            call = call_from_object({"name": name.group(1), "arguments": value}) if name else None
            if call is None:
                return with_tail(s, text, pos)
            s.calls.append(call)
            rest = text[end:].lstrip()
            if not rest or (not final and BOT.startswith(rest)):
                return s
            if not rest.startswith(BOT):
                return with_tail(s, text, end)
            pos = len(text) - len(rest) + len(BOT)
