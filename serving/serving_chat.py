"""POST /v1/chat/completions: render the conversation with the chat template, then generate."""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import aclosing
from functools import partial
from typing import AsyncIterator, Optional, Union

from jaxllm.entrypoints.chat_utils import normalize_messages, render_chat_prompt
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams
from serving.chat_output import ChoiceParser, ToolChoice
from serving.errors import APIError, error_body, stream_error_status
from serving.deadline import call_with_deadline
from serving.generation import build_params, collect, merge, submit
from serving.limits import check_request_limits
from serving.logprobs import chat_logprobs, prompt_logprobs_json
from serving.prompts import Prompt, check_token_ids, max_tokens_for, truncated
from serving.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                              ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
                              ChatCompletionStreamResponse, ChatMessage, DeltaMessage, UsageInfo)
from serving.sse import DONE, sse
from serving.state import ServingState

logger = logging.getLogger("jaxllm.serving")


async def chat_prompt(state: ServingState, req, tools: Optional[list] = None
                      ) -> tuple[Prompt, list[dict]]:
    """The conversation as prompt tokens, and the normalized messages.

    A request's own `chat_template` is used (as a Jinja string, never a file path) only when
    the operator trusts them (--trust-request-chat-template, as vLLM). Rendering runs on the
    tokenizer thread within --chat-template-timeout; a template that fails or overruns is a
    400. `tools` are rendered into the prompt by the template's `tools` argument."""
    tokenizer = state.require_tokenizer()
    limits = state.limits
    if req.chat_template is not None and not limits.trust_request_chat_template:
        raise APIError("Chat template is passed with request, but --trust-request-chat-template "
                       "is not set. Refused request with untrusted chat template.",
                       param="chat_template")
    try:
        messages = normalize_messages(req.messages)
        render = partial(render_chat_prompt, tokenizer, messages,
                         chat_template=req.chat_template or state.chat_template,
                         add_generation_prompt=req.add_generation_prompt,
                         continue_final_message=req.continue_final_message, tools=tools,
                         chat_template_kwargs=req.chat_template_kwargs,
                         content_format=state.chat_template_content_format,
                         template_source=_template_source(state, req))
        text = await state.in_tokenizer_thread(call_with_deadline, render,
                                               limits.chat_template_timeout)
    except ValueError as e:
        raise APIError(str(e), param="messages") from None
    add_special = bool(req.add_special_tokens)
    prompt = Prompt(await state.encode(text, add_special), text)
    check_token_ids(state, prompt.token_ids)
    return prompt, messages


def _template_source(state: ServingState, req) -> str:
    """Which template renders `req`, for the log (the warning about dropped tools)."""
    if req.chat_template is not None:
        return "the request's chat_template"
    if state.chat_template is not None:
        return "the --chat-template template"
    return f"the chat template of model {state.model_path}"


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
    params = build_params(state, lambda: _with_tool_choice(req.sampling_params(
        max_tokens_for(state, len(prompt.token_ids), req.requested_max_tokens),
        req.num_logprobs, req.prompt_logprobs, state.generation_defaults), choice))
    parsers = [ChoiceParser(choice, state.tool_call_parser, state.reasoning_parser,
                            state.tokenizer, params.structured_outputs is not None)
               for _ in range(req.n)]
    role = state.response_role if req.add_generation_prompt else messages[-1]["role"]
    # vLLM's chat echo: repeat the last message when it is the role being answered.
    echo = messages[-1]["content"] if req.echo and messages[-1]["role"] == role else None
    request_id = f"chatcmpl-{base_id}"
    streams = await submit(state, [prompt], [params], request_id, req.priority)
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
        return dataclasses.replace(params, structured_outputs=choice.constraint,
                                   guided_decoding=None)
    if choice.mode == "auto":
        return dataclasses.replace(params, skip_special_tokens=False)
    return params


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
