"""Tool-call parsers by vLLM's `--tool-call-parser` names."""

from jaxllm.entrypoints.openai_parsers import pick
from jaxllm.entrypoints.openai_parsers.tool_parsers.base import (ExtractedToolCalls, ToolCall,
                                                                 ToolParser)
from jaxllm.entrypoints.openai_parsers.tool_parsers.gpt_oss import GptOssToolParser
from jaxllm.entrypoints.openai_parsers.tool_parsers.hermes import HermesToolParser
from jaxllm.entrypoints.openai_parsers.tool_parsers.llama3_json import (Llama3JsonToolParser,
                                                                        Llama4JsonToolParser)
from jaxllm.entrypoints.openai_parsers.tool_parsers.mistral import MistralToolParser
from jaxllm.entrypoints.openai_parsers.tool_parsers.pythonic import (Llama4PythonicToolParser,
                                                                     PythonicToolParser)

TOOL_PARSERS = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                    PythonicToolParser, GptOssToolParser,
                                    Llama4JsonToolParser, Llama4PythonicToolParser)}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class for `--tool-call-parser name`; a ValueError lists the known names."""
    return pick(TOOL_PARSERS, name, "tool call parser")


__all__ = ["ExtractedToolCalls", "ToolCall", "ToolParser", "TOOL_PARSERS", "get_tool_parser"]
