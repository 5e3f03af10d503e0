"""vLLM's `openai` tool-call format: GPT-OSS's harmony messages to `functions.NAME` on the
commentary channel, arguments as JSON. Read from the output's text with the special tokens
kept, through openai-harmony (jaxllm/entrypoints/harmony.py), or from what the
`openai_gptoss` reasoning parser leaves (its calls in the same harmony text). A call is
complete at its <|call|> (or, once the output is final, where it stops); messages to other
recipients, and arguments that are not a JSON object, are content."""

from __future__ import annotations

import json
import re

from jaxllm.entrypoints.harmony import is_harmony_output, read_text
from jaxllm.entrypoints.openai_parsers.tool_parsers.base import Scan, ToolParser

PREFIX = "functions."
# A call as the reasoning parser leaves it (jaxllm/entrypoints/harmony.py's `call_text`)
CALL = re.compile(r"<\|start\|>assistant to=([^<]*)<\|channel\|>commentary json<\|message\|>"
                  r"(.*?)(<\|call\|>|(?=<\|start\|>assistant to=)|$)", re.S)


def _messages(text: str) -> list:
    """(recipient, text, ended) of each message: the model's own harmony output, or the
    reasoning parser's rest (plain text with its calls in harmony form)."""
    import openai_harmony as h

    if is_harmony_output(text):
        try:
            return read_text(text)[1]
        except h.HarmonyError:  # malformed: content
            return [(None, text, True)]
    out, pos = [], 0
    for m in CALL.finditer(text):
        if m.start() > pos:
            out.append((None, text[pos:m.start()], True))
        out.append((m.group(1), m.group(2), bool(m.group(3))))
        pos = m.end()
    if pos < len(text):
        out.append((None, text[pos:], True))
    return out


class GptOssToolParser(ToolParser):
    name = "openai"
    keeps_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        s = Scan("")  # (without the reasoning parser, analysis is not content either)
        for recipient, body, ended in _messages(text):
            if recipient is None:
                s.content += body
                continue
            if not (ended or final):
                break  # an unfinished call: held back
            try:
                args = json.loads(body)
            except json.JSONDecodeError:
                args = None
            if recipient.startswith(PREFIX) and isinstance(args, dict):
                s.calls.append((recipient[len(PREFIX):], json.dumps(args, ensure_ascii=False)))
            else:
                s.content += body
        return s
