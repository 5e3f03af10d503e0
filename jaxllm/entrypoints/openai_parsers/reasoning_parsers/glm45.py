"""vLLM's `glm45` reasoning format (GLM-4.5/4.6): the model opens <think> itself; with thinking
switched off (enable_thinking=False) the template closes an empty <think></think> in the prompt
and the output has no <think>, so it is all content (a stray </think> too, unlike `qwen3`).
After <think>, the reasoning runs to </think>, or to the end of an output cut off while
thinking (as vLLM's stream, and as `qwen3` here, so stream and message agree)."""

from __future__ import annotations

from jaxllm.entrypoints.openai_parsers.reasoning_parsers.base import START, ReasoningParser
from jaxllm.entrypoints.openai_parsers.reasoning_parsers.qwen3 import Qwen3ReasoningParser
from jaxllm.entrypoints.openai_parsers.text_utils import safe_prefix


class Glm45ReasoningParser(ReasoningParser):
    name = "glm45"

    def split(self, text: str, final: bool) -> tuple[str, str]:
        if START not in text:
            return "", (text if final else safe_prefix(text, START))
        return Qwen3ReasoningParser.split(self, text, final)

    def is_reasoning_end(self, text: str) -> bool:
        return Qwen3ReasoningParser.is_reasoning_end(self, text)
