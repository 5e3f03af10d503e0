"""Reasoning parsers by vLLM's `--reasoning-parser` names."""

from jaxllm.entrypoints.openai_parsers import pick
from jaxllm.entrypoints.openai_parsers.reasoning_parsers.base import ReasoningParser
from jaxllm.entrypoints.openai_parsers.reasoning_parsers.deepseek_r1 import (
    DeepSeekR1ReasoningParser)
from jaxllm.entrypoints.openai_parsers.reasoning_parsers.deepseek_v3 import (
    DeepSeekV3ReasoningParser)
from jaxllm.entrypoints.openai_parsers.reasoning_parsers.glm45 import Glm45ReasoningParser
from jaxllm.entrypoints.openai_parsers.reasoning_parsers.gpt_oss import GptOssReasoningParser
from jaxllm.entrypoints.openai_parsers.reasoning_parsers.granite import GraniteReasoningParser
from jaxllm.entrypoints.openai_parsers.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS = {p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser,
                                         GptOssReasoningParser, DeepSeekV3ReasoningParser,
                                         Glm45ReasoningParser, GraniteReasoningParser)}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class for `--reasoning-parser name`; a ValueError lists the known names."""
    return pick(REASONING_PARSERS, name, "reasoning parser")


__all__ = ["ReasoningParser", "REASONING_PARSERS", "get_reasoning_parser"]
