"""vLLM's `granite` reasoning format (Granite 3.2+ with `thinking`): plain-text markers, no
special tokens:

  Here is my thought process:
  The user wants 2+2.
  Here is my response:
  4

("Here's" in place of "Here is" too, as vLLM accepts.) An output that does not start with the
thought-process marker is all content. After it, the reasoning runs to the response marker, or
to the end of an output cut off while thinking (as vLLM's stream; its whole-output parser calls
that content, which would make the stream and the message disagree), and the content is what
follows the response marker. Unlike vLLM's whole-output regex, a marker later in the text does
not start reasoning, again as its stream.
"""

from __future__ import annotations

from jaxllm.entrypoints.openai_parsers.reasoning_parsers.base import ReasoningParser
from jaxllm.entrypoints.openai_parsers.text_utils import safe_prefix

THINK = ("Here is my thought process:", "Here's my thought process:")
RESPONSE = ("Here is my response:", "Here's my response:")


class GraniteReasoningParser(ReasoningParser):
    name = "granite"

    def split(self, text: str, final: bool) -> tuple[str, str]:
        think = next((m for m in THINK if text.startswith(m)), None)
        if think is None:
            maybe = not final and any(m.startswith(text) for m in THINK)
            return "", ("" if maybe else text)
        body = text[len(think):]
        ends = [(body.find(m), m) for m in RESPONSE if m in body]
        if ends:
            at, marker = min(ends)
            return body[:at], body[at + len(marker):]
        if final:
            return body, ""
        return min((safe_prefix(body, m) for m in RESPONSE), key=len), ""

    def is_reasoning_end(self, text: str) -> bool:
        return not any(text.startswith(m) or m.startswith(text) for m in THINK) or any(
            m in text for m in RESPONSE)

    def grammar_gate(self, prompt_ids):
        """None: Granite's markers are plain text the model may tokenize in several ways, so
        the constraint applies from the first token."""
        return None
