"""The shared machinery of the reasoning parsers: a format says how a (possibly partial) output
splits into reasoning and content (`split`); whole-output `extract` and streaming
`extract_delta` both come from it, so the streamed pieces join to exactly what `extract` gives.

Deltas are {"reasoning": ..., "content": ...} (either key absent when empty): vLLM 0.32 names
the message field `reasoning`, older versions `reasoning_content`; the server picks the name.
"""

from __future__ import annotations

from typing import ClassVar, Optional, Sequence

from jaxllm.structured_output import ReasoningGate

START, END = "<think>", "</think>"


def single_token(tokenizer, text: str) -> Optional[int]:
    """The id of `text` when this tokenizer has it as one token (a model writes such a marker
    as that token), else None."""
    ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else []
    return ids[0] if len(ids) == 1 else None


class ReasoningParser:
    """Base of a format parser; one instance per request (the stream state lives here)."""
    name: ClassVar[str]

    def __init__(self, tokenizer=None, chat_template_kwargs=None):
        self.tokenizer = tokenizer
        # The request's chat_template_kwargs: some formats think only when the template was
        # told to (deepseek_v3's `thinking`).
        self.chat_template_kwargs = chat_template_kwargs or {}
        self._sent = ("", "")

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """Subclasses: (reasoning, content) of `text`; when not final, hold back a tail that
        could still be the start of a marker."""
        raise NotImplementedError

    def is_reasoning_end(self, text: str) -> bool:
        """Whether the reasoning is over, so that a grammar (structured output, tool calls)
        applies from here on."""
        return END in text

    def grammar_gate(self, prompt_ids: Sequence[int]) -> Optional[ReasoningGate]:
        """Where a constraint (structured output, tool_choice required/named) starts: after
        the reasoning, as vLLM. The think-tag formats: the prompt read from its end decides,
        as vLLM's parsers do: a </think> last means the reasoning was closed for the model
        (thinking off), a <think> last that the model starts inside it; neither, that its
        first token may open it. None: from the first token (also when the tokenizer does
        not have the tags as single tokens: a marker the model may spell in pieces cannot
        gate the grammar)."""
        start, end = single_token(self.tokenizer, START), single_token(self.tokenizer, END)
        if start is None or end is None:
            return None
        for t in reversed(prompt_ids):
            if t == end:
                return None
            if t == start:
                return ReasoningGate((end,), start, inside=True)
        return ReasoningGate((end,), start)

    def extract(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a finished output; None for an empty part."""
        reasoning, content = self.split(text, final=True)
        return reasoning or None, content or None

    def extract_delta(self, previous_text: str, current_text: str,
                      delta_text: str) -> Optional[dict]:
        del previous_text, delta_text  # the split reads the whole current text
        return self._delta(*self.split(current_text, final=False))

    def flush(self, current_text: str) -> Optional[dict]:
        """The last delta of a finished stream: whatever was held back."""
        return self._delta(*self.split(current_text, final=True))

    def _delta(self, reasoning: str, content: str) -> Optional[dict]:
        """What extends the parts already sent; nothing if a part was reread differently (a
        stream cannot take text back)."""
        if not (reasoning.startswith(self._sent[0]) and content.startswith(self._sent[1])):
            return None
        out = {key: new[len(old):] for key, new, old in
               zip(("reasoning", "content"), (reasoning, content), self._sent) if new != old}
        self._sent = (reasoning, content)
        return out or None
