"""POST /v1/chat/completions: the conversation rendered into a prompt (serving/generation.py),
generated, and each choice's text read back as the chat message, whole or as the stream's deltas.

A choice's text -> the message fields: `reasoning` (--reasoning-parser), `content` and
`tool_calls` (tool_choice "auto" with --tool-call-parser, or "required" / a named function
through structured output). Reasoning comes first: its parser splits the text, and the tool
parser reads only the content part, so a <tool_call> inside the reasoning is not a call. The
deltas of a stream join to what `whole` returns on the final text, because both come from the
same parsers' scans. A request without tools or a reasoning parser enters no parser: its text is
all content.
"""

from __future__ import annotations

import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Optional, Union

from jaxllm.entrypoints.openai_parsers.reasoning_parsers import get_reasoning_parser
from jaxllm.entrypoints.openai_parsers.tool_parsers import get_tool_parser
from jaxllm.entrypoints.openai_parsers.tool_parsers.base import ToolParser
from jaxllm.entrypoints.openai_parsers.tool_parsers.forced import (NamedToolParser,
                                                                   RequiredToolParser)
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams
from jaxllm.structured_output import StructuredOutputsParams
from jaxllm.structured_output.tool_choice import tool_choice_params
from serving.errors import APIError, error_body, stream_error_status
from serving.generation import (DONE, Prompt, build_params, chat_prompt, collect, max_tokens_for,
                               merge, sse, submit, truncated)
from serving.logprobs import chat_logprobs, prompt_logprobs_json
from serving.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                              ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
                              ChatCompletionStreamResponse, ChatMessage, DeltaMessage, UsageInfo)
from serving.state import ServingState, check_request_limits

logger = logging.getLogger("jaxllm.serving")


async def create_chat_completion(state: ServingState, req: ChatCompletionRequest, base_id: str
                                 ) -> Union[ChatCompletionResponse, AsyncIterator[str]]:
    model = state.model_name(req.model)
    req.check_supported()
    state.warn_ignored_fields(req)
    check_request_limits(state.limits, req)
    choice = ToolChoice.of(req, state.tool_call_parser, state.enable_auto_tool_choice)
    exclude = choice.mode == "none" and state.exclude_tools_when_tool_choice_none
    prompt, messages = await chat_prompt(state, req, None if exclude else req.tools)
    prompt = truncated(state, prompt, req.truncate_prompt_tokens)
    params = build_params(lambda: _with_tool_choice(req.sampling_params(
        max_tokens_for(state, len(prompt.token_ids), req.requested_max_tokens),
        req.num_logprobs, req.prompt_logprobs, state.generation_defaults), choice))
    if keeps_special_tokens(state, choice):  # GPT-OSS's harmony markers are special tokens
        params = replace(params, skip_special_tokens=False)
    params = after_reasoning(state, params, prompt.token_ids, req.chat_template_kwargs)
    so = params.structured_outputs
    parsers = [ChoiceParser(choice, state.tool_call_parser, state.reasoning_parser,
                            state.tokenizer, so is not None and so.after_reasoning is None,
                            tools=req.tools, chat_template_kwargs=req.chat_template_kwargs)
               for _ in range(req.n)]
    role = state.response_role if req.add_generation_prompt else messages[-1]["role"]
    # vLLM's chat echo: repeat the last message when it is the role being answered.
    echo = messages[-1]["content"] if req.echo and messages[-1]["role"] == role else None
    request_id = f"chatcmpl-{base_id}"
    streams = await submit(state, [prompt], [params], request_id, req.priority,
                           state.lora_request(model))
    if req.stream:
        return _stream(state, req, model, request_id, role, echo, prompt, streams, parsers)
    (out,) = await collect(streams)
    choices = [_choice(state, req, role, echo, o, parsers[o.index]) for o in out.outputs]
    return ChatCompletionResponse(
        id=request_id, model=model, choices=choices, usage=_usage(prompt, out),
        prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs)
        if req.prompt_logprobs is not None else None)


def _with_tool_choice(params: SamplingParams, choice: ToolChoice) -> SamplingParams:
    """The request's SamplingParams with what its tool_choice needs: the constraint of
    required/named; and for auto the special tokens kept in the text, since tool-call markers
    (<tool_call>, [TOOL_CALLS], <|python_tag|>) are special tokens in their models' vocabularies
    (vLLM's parsers do the same)."""
    if choice.constraint is not None:
        if params.structured_outputs is not None:
            raise ValueError(f"structured_outputs (or response_format, guided_*) cannot be "
                             f"combined with tool_choice {choice.mode!r}, which constrains "
                             f"the output itself")
        return replace(params, structured_outputs=choice.constraint,
                                   guided_decoding=None)
    if choice.mode == "auto":
        return replace(params, skip_special_tokens=False)
    return params


def after_reasoning(state: ServingState, params: SamplingParams, prompt_ids: list[int],
                    chat_template_kwargs: Optional[dict]) -> SamplingParams:
    """With --reasoning-parser, a constraint (structured output, tool_choice required/named)
    starts after the model's reasoning, as vLLM's does: the parser says where, from its
    markers and the prompt (`ReasoningParser.grammar_gate`); None keeps it from the first
    token."""
    so = params.structured_outputs
    if so is None or not state.reasoning_parser:
        return params
    gate = get_reasoning_parser(state.reasoning_parser)(
        state.tokenizer, chat_template_kwargs=chat_template_kwargs).grammar_gate(prompt_ids)
    if gate is None:
        return params
    return replace(params, structured_outputs=replace(so, after_reasoning=gate),
                   guided_decoding=None)


def keeps_special_tokens(state: ServingState, choice: "ToolChoice") -> bool:
    """Whether a parser this request uses reads the special tokens in the text (the harmony
    parsers, `openai_gptoss` and `openai`): then they are kept whatever the tool choice."""
    classes = []
    if state.reasoning_parser:
        classes.append(get_reasoning_parser(state.reasoning_parser))
    if choice.mode == "auto" and state.tool_call_parser:
        classes.append(get_tool_parser(state.tool_call_parser))
    return any(getattr(c, "keeps_special_tokens", False) for c in classes)


def _choice(state: ServingState, req: ChatCompletionRequest, role: str, echo: Optional[str],
            o, parser: ChoiceParser) -> ChatCompletionResponseChoice:
    message = parser.whole(o.text)
    if echo:
        message["content"] = echo + (message["content"] or "")
    return ChatCompletionResponseChoice(
        index=o.index, message=ChatMessage(role=role, **message),
        logprobs=(chat_logprobs(state, o.token_ids, o.logprobs or [], req.top_logprobs or 0,
                                as_ids=bool(req.return_tokens_as_token_ids))
                  if req.logprobs else None),
        finish_reason=parser.finish_reason(o.finish_reason), stop_reason=o.stop_reason)


def _usage(prompt: Prompt, out: Optional[RequestOutput]) -> UsageInfo:
    generated = sum(len(o.token_ids) for o in out.outputs) if out is not None else 0
    return UsageInfo.of(len(prompt.token_ids), generated)


async def _stream(state: ServingState, req: ChatCompletionRequest, model: str, request_id: str,
                  role: str, echo: Optional[str], prompt: Prompt, streams,
                  parsers: list[ChoiceParser]) -> AsyncIterator[str]:
    created = int(time.time())
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts.continuous_usage_stats)
    dump = {} if include_usage else {"exclude": {"usage"}}
    last: Optional[RequestOutput] = None

    def chunk(choice: ChatCompletionResponseStreamChoice) -> str:
        c = ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                         choices=[choice])
        if continuous:
            c.usage = _usage(prompt, last)
        return sse(c, **dump)

    sent_tokens: dict[int, int] = {}
    sent_text: dict[int, int] = {}
    finished: set[int] = set()
    try:
        for j in range(req.n):
            yield chunk(ChatCompletionResponseStreamChoice(
                index=j, delta=DeltaMessage(role=role, content="")))
            if echo:
                yield chunk(ChatCompletionResponseStreamChoice(
                    index=j, delta=DeltaMessage(content=echo)))
        async with aclosing(merge(streams)) as outputs:
            async for _, out in outputs:
                last = out
                for o in out.outputs:
                    if o.index in finished:
                        continue
                    start = sent_tokens.get(o.index, 0)
                    fresh = len(o.text) > sent_text.get(o.index, 0)
                    final = o.finish_reason is not None
                    delta = (parsers[o.index].delta(o.text, final) if fresh or final
                             else None) or {}
                    logprobs = None
                    if req.logprobs:
                        logprobs = chat_logprobs(state, o.token_ids[start:],
                                                 list(o.logprobs or [])[start:],
                                                 req.top_logprobs or 0,
                                                 as_ids=bool(req.return_tokens_as_token_ids))
                    sent_tokens[o.index], sent_text[o.index] = len(o.token_ids), len(o.text)
                    if o.finish_reason is not None:
                        finished.add(o.index)
                    if not delta and not final and not (logprobs and logprobs.content):
                        continue
                    if not delta.get("tool_calls") and not delta.get("reasoning"):
                        delta.setdefault("content", "")  # a plain chunk carries content
                    yield chunk(ChatCompletionResponseStreamChoice(
                        index=o.index, delta=DeltaMessage(**delta), logprobs=logprobs,
                        finish_reason=parsers[o.index].finish_reason(o.finish_reason),
                        stop_reason=o.stop_reason))
        if include_usage:
            yield sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                   choices=[], usage=_usage(prompt, last)))
    except Exception as e:  # the response has started: report in-band, as vLLM does
        logger.exception("Error while streaming %s", request_id)
        yield sse(error_body(str(e), stream_error_status(e)))
    yield DONE


# --- a choice's text -> the message fields --------------------------------------------------------

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
    """One choice's parsers (they keep the stream state), built per choice. Without tools
    (tool_choice "none") there is no tool parser: all the text that is not reasoning is content."""

    def __init__(self, choice: ToolChoice, tool_parser: Optional[str],
                 reasoning_parser: Optional[str], tokenizer: Any = None,
                 constrained: bool = False, tools: Optional[list] = None,
                 chat_template_kwargs: Optional[dict] = None):
        self.choice = choice
        self.tools: Optional[ToolParser] = None
        if choice.mode == "auto":  # the request's tools type the values of XML formats
            self.tools = get_tool_parser(tool_parser)(tokenizer, tools=tools)
        elif choice.mode == "required":
            self.tools = RequiredToolParser(tokenizer)
        elif choice.mode == "named":
            self.tools = NamedToolParser(choice.function, tokenizer)
        # `constrained`: a grammar that applies from the first token (the reasoning parser gave
        # it no gate, `after_reasoning`): such an output has reasoning only where it writes
        # <think>...</think> itself, which is qwen3's reading (deepseek_r1's would call a JSON
        # answer reasoning, as it never sees </think>).
        if reasoning_parser and constrained:
            reasoning_parser = "qwen3"
        self.reasoning = (get_reasoning_parser(reasoning_parser)(
            tokenizer, chat_template_kwargs=chat_template_kwargs) if reasoning_parser else None)
        self._reasoning_sent = ""
        self._content_sent = ""  # without a tool parser (which keeps its own)
        self.called = False

    def whole(self, text: str) -> dict:
        """{"reasoning", "content", "tool_calls"} of a finished output."""
        reasoning, content = (self.reasoning.extract(text) if self.reasoning
                              else (None, text))
        if self.tools is None:
            return {"reasoning": reasoning, "content": content, "tool_calls": []}
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
        if self.tools is None:
            tools = self._new_content(content)
        else:
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

    def _new_content(self, content: str) -> Optional[dict]:
        """The content not sent yet (as a tool parser's delta without calls would be)."""
        sent = self._content_sent
        if not (content.startswith(sent) and len(content) > len(sent)):
            return None
        self._content_sent = content
        return {"content": content[len(sent):]}

    def _allowed(self, index: int) -> bool:
        return self.choice.parallel or index == 0

    def _at_most_allowed(self, calls: list) -> list:
        return calls if self.choice.parallel else calls[:1]
