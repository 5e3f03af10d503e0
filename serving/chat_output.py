"""A chat choice's generated text -> the message fields: `reasoning` (--reasoning-parser),
`content` and `tool_calls` (tool_choice "auto" with --tool-call-parser, or "required" / a named
function through structured output), whole for plain responses and as deltas for streams.

Reasoning comes first: its parser splits the text, and the tool parser reads only the content
part, so a <tool_call> inside the reasoning is not a call. The deltas of a stream join to what
`whole` returns on the final text, because both come from the same parsers' scans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from jaxllm.entrypoints.openai_parsers.tool_parsers import get_tool_parser
from jaxllm.entrypoints.openai_parsers.tool_parsers.base import Scan, ToolParser
from jaxllm.entrypoints.openai_parsers.tool_parsers.forced import (NamedToolParser,
                                                                   RequiredToolParser)
from jaxllm.entrypoints.openai_parsers.reasoning_parsers import get_reasoning_parser
from jaxllm.structured_output import StructuredOutputsParams
from jaxllm.structured_output.tool_choice import tool_choice_params
from serving.errors import APIError


class _NoTools(ToolParser):
    """Everything is content (tool_choice "none", or no tools)."""
    name = "none"

    def scan(self, text: str, final: bool) -> Scan:
        return Scan(text)


@dataclass
class ToolChoice:
    """How one request's output is read: the tool_choice mode ("none", "auto", "required",
    "named"), the named function, whether several calls may be made, and the constraint that
    required/named put on the output."""
    mode: str = "none"
    function: Optional[str] = None
    parallel: bool = True
    constraint: Optional[StructuredOutputsParams] = None

    @classmethod
    def of(cls, req, auto_parser: Optional[str], auto_enabled: bool) -> "ToolChoice":
        """vLLM's rules for a request's tools and tool_choice; a 400 naming the field."""
        choice, tools = req.tool_choice, req.tools
        if choice is None:  # OpenAI's default: "auto" when there are tools
            choice = "auto" if tools else "none"
        if choice == "none" or (choice == "required" and tools == []):  # vLLM: [] means none
            return cls()
        if not tools:
            raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if choice == "auto" and not (auto_enabled and auto_parser):
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice and '
                           '--tool-call-parser to be set', param="tool_choice")
        parallel = req.parallel_tool_calls is not False
        try:
            constraint = tool_choice_params(tools, choice, parallel)
        except ValueError as e:
            raise APIError(str(e), param="tool_choice") from None
        if choice == "auto":
            return cls("auto", parallel=parallel)
        if choice == "required":
            return cls("required", parallel=parallel, constraint=constraint)
        return cls("named", choice["function"]["name"], parallel, constraint)


class ChoiceParser:
    """One choice's parsers (they keep the stream state), built per choice."""

    def __init__(self, choice: ToolChoice, tool_parser: Optional[str],
                 reasoning_parser: Optional[str], tokenizer: Any = None,
                 constrained: bool = False):
        self.choice = choice
        if choice.mode == "auto":
            self.tools: ToolParser = get_tool_parser(tool_parser)(tokenizer)
        elif choice.mode == "required":
            self.tools = RequiredToolParser(tokenizer)
        elif choice.mode == "named":
            self.tools = NamedToolParser(choice.function, tokenizer)
        else:
            self.tools = _NoTools(tokenizer)
        # The grammar of a constrained output (structured output, tool_choice required/named)
        # applies from the first token, not after the reasoning: such an output has reasoning
        # only where it writes <think>...</think> itself, which is qwen3's reading
        # (deepseek_r1's would call a JSON answer reasoning, as it never sees </think>).
        if reasoning_parser and constrained:
            reasoning_parser = "qwen3"
        self.reasoning = (get_reasoning_parser(reasoning_parser)(tokenizer)
                          if reasoning_parser else None)
        self._reasoning_sent = ""
        self.called = False

    def whole(self, text: str) -> dict:
        """{"reasoning", "content", "tool_calls"} of a finished output."""
        reasoning, content = (self.reasoning.extract(text) if self.reasoning
                              else (None, text))
        found = self.tools.extract(content or "")
        calls = [c.to_openai() for c in self._at_most_allowed(found.tool_calls)]
        self.called = bool(calls)
        if not calls:
            return {"reasoning": reasoning, "content": content, "tool_calls": []}
        return {"reasoning": reasoning, "content": found.content, "tool_calls": calls}

    def delta(self, text: str, final: bool) -> Optional[dict]:
        """What the stream sends for the text so far (`final`: the output is complete, send
        what was held back), or None when there is nothing new."""
        out: dict = {}
        content = text
        if self.reasoning:
            reasoning, content = self.reasoning.split(text, final)
            if reasoning.startswith(self._reasoning_sent) and reasoning != self._reasoning_sent:
                out["reasoning"] = reasoning[len(self._reasoning_sent):]
                self._reasoning_sent = reasoning
        tools = (self.tools.flush(content) if final
                 else self.tools.extract_delta("", content, ""))
        if tools:
            calls = [c for c in tools.get("tool_calls", ()) if self._allowed(c["index"])]
            if calls:
                out["tool_calls"] = calls
                self.called = True
            if tools.get("content"):
                out["content"] = tools["content"]
        return out or None

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        """vLLM's: "tool_calls" when auto calls were made, or required ones and the model
        stopped; a named call keeps the engine's reason."""
        if reason is None or not self.called:
            return reason
        if self.choice.mode == "auto" or (self.choice.mode == "required" and reason == "stop"):
            return "tool_calls"
        return reason

    def _allowed(self, index: int) -> bool:
        return self.choice.parallel or index == 0

    def _at_most_allowed(self, calls: list) -> list:
        return calls if self.choice.parallel else calls[:1]
