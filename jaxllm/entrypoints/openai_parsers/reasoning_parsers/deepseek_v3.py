"""vLLM's `deepseek_v3` reasoning format (DeepSeek-V3.1+): the model thinks only when the
request turns thinking on in its chat template (chat_template_kwargs `thinking`, or
`enable_thinking`, true); its template then opens <think> in the prompt and the output is
read as `deepseek_r1` reads it. Otherwise the output is all content, a </think> in it too."""

from __future__ import annotations

from jaxllm.entrypoints.openai_parsers.reasoning_parsers.base import ReasoningParser
from jaxllm.entrypoints.openai_parsers.reasoning_parsers.deepseek_r1 import (
    DeepSeekR1ReasoningParser)


class DeepSeekV3ReasoningParser(ReasoningParser):
    name = "deepseek_v3"

    def __init__(self, tokenizer=None, chat_template_kwargs=None):
        super().__init__(tokenizer, chat_template_kwargs)
        kwargs = self.chat_template_kwargs
        self.thinking = bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))
        self._r1 = DeepSeekR1ReasoningParser(tokenizer, chat_template_kwargs)

    def split(self, text: str, final: bool) -> tuple[str, str]:
        return self._r1.split(text, final) if self.thinking else ("", text)

    def is_reasoning_end(self, text: str) -> bool:
        return self._r1.is_reasoning_end(text) if self.thinking else True

    def grammar_gate(self, prompt_ids):
        return self._r1.grammar_gate(prompt_ids) if self.thinking else None
