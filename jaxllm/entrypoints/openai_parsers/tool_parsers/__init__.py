"""Tool-call parsers by vLLM's `--tool-call-parser` names, and the plugins that add to them."""

from jaxllm.entrypoints.openai_parsers import pick
from jaxllm.entrypoints.openai_parsers.tool_parsers.base import (ExtractedToolCalls, ToolCall,
                                                                 ToolParser)
from jaxllm.entrypoints.openai_parsers.tool_parsers.deepseek import (DeepSeekV3ToolParser,
                                                                     DeepSeekV31ToolParser)
from jaxllm.entrypoints.openai_parsers.tool_parsers.glm45 import Glm45ToolParser
from jaxllm.entrypoints.openai_parsers.tool_parsers.gpt_oss import GptOssToolParser
from jaxllm.entrypoints.openai_parsers.tool_parsers.granite import GraniteToolParser
from jaxllm.entrypoints.openai_parsers.tool_parsers.hermes import HermesToolParser
from jaxllm.entrypoints.openai_parsers.tool_parsers.kimi_k2 import KimiK2ToolParser
from jaxllm.entrypoints.openai_parsers.tool_parsers.llama3_json import (Llama3JsonToolParser,
                                                                        Llama4JsonToolParser)
from jaxllm.entrypoints.openai_parsers.tool_parsers.mistral import MistralToolParser
from jaxllm.entrypoints.openai_parsers.tool_parsers.plugins import ToolParserManager
from jaxllm.entrypoints.openai_parsers.tool_parsers.pythonic import (Llama4PythonicToolParser,
                                                                     PythonicToolParser)
from jaxllm.entrypoints.openai_parsers.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS = ToolParserManager.parsers
TOOL_PARSERS.update({p.name: p for p in (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser,
    GptOssToolParser, Llama4JsonToolParser, Llama4PythonicToolParser, Qwen3CoderToolParser,
    DeepSeekV3ToolParser, DeepSeekV31ToolParser, KimiK2ToolParser, Glm45ToolParser,
    GraniteToolParser)})


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class for `--tool-call-parser name`; a ValueError lists the known names."""
    return pick(TOOL_PARSERS, name, "tool call parser")


__all__ = ["ExtractedToolCalls", "ToolCall", "ToolParser", "ToolParserManager", "TOOL_PARSERS",
           "get_tool_parser"]
