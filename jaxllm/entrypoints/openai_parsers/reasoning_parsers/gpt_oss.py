"""vLLM's `openai_gptoss` reasoning format: GPT-OSS writes harmony messages, and the
`analysis` channel's text is the reasoning. Read from the output's text with the special
tokens kept (the server keeps them for this parser), through openai-harmony
(jaxllm/entrypoints/harmony.py). The rest is the other messages: each function call as its
harmony text, for the `openai` tool parser to read, and the other channels' (final,
commentary preambles) text as it is."""

from __future__ import annotations

from jaxllm.entrypoints.harmony import call_text, is_harmony_output, read_text
from jaxllm.entrypoints.openai_parsers.reasoning_parsers.base import (ReasoningParser,
                                                                      single_token)
from jaxllm.structured_output import ReasoningGate

FINAL = "<|channel|>final<|message|>"


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    keeps_special_tokens = True

    def split(self, text: str, final: bool) -> tuple[str, str]:
        import openai_harmony as h

        if not is_harmony_output(text):  # malformed output is content, never an error
            return "", text
        try:
            reasoning, rest = read_text(text)
        except h.HarmonyError:
            return "", text
        if final and not (reasoning or rest):  # it never got past a header
            return "", text
        return reasoning, "".join(call_text(r, body, ended) if r else body
                                  for r, body, ended in rest)

    def is_reasoning_end(self, text: str) -> bool:
        return bool(self.split(text, final=False)[1])

    def grammar_gate(self, prompt_ids):
        """The constraint starts with the final channel's message (`<|channel|>final
        <|message|>`): harmony output opens with the analysis channel, so the model is in
        its reasoning from its first token. None: the prompt opened the final message."""
        if self.tokenizer is None:
            return None
        close = tuple(self.tokenizer.encode(FINAL, add_special_tokens=False))
        start = single_token(self.tokenizer, "<|start|>")
        tail = list(prompt_ids)
        if start is not None and start in tail:
            tail = tail[len(tail) - tail[::-1].index(start):]
        if any(tuple(tail[i:i + len(close)]) == close for i in range(len(tail))):
            return None
        return ReasoningGate(close, inside=True)
