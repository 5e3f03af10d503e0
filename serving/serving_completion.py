"""POST /v1/completions: one engine request per prompt; choice index = prompt * n + sample."""

from __future__ import annotations

import logging
import time
from contextlib import aclosing
from typing import AsyncIterator, Union

from jaxllm.outputs import CompletionOutput, RequestOutput
from serving.beam_search import beam_search_completion
from serving.errors import APIError, error_body, stream_error_status
from serving.generation import (DONE, Prompt, build_params, collect, max_tokens_for, merge,
                               split_prompts, sse, submit, to_prompts, truncated)
from serving.logprobs import completion_logprobs, prompt_logprobs_json
from serving.prompt_embeds import decode_prompt_embeds
from serving.protocol import UsageInfo
from serving.protocol_completion import (CompletionLogProbs, CompletionRequest,
                                         CompletionResponse, CompletionResponseChoice,
                                         CompletionResponseStreamChoice, CompletionStreamResponse)
from serving.state import ServingState, check_request_limits

logger = logging.getLogger("jaxllm.serving")


async def create_completion(state: ServingState, req: CompletionRequest, base_id: str
                            ) -> Union[CompletionResponse, AsyncIterator[str]]:
    """Validate, submit, and return the response (or its SSE event stream)."""
    model = state.model_name(req.model)
    req.check_supported()
    state.warn_ignored_fields(req)
    if req.prompt_embeds is not None:
        prompts = embeds_prompts(state, req)
        check_request_limits(state.limits, req, len(prompts))
    else:
        check_request_limits(state.limits, req, len(split_prompts(req.prompt)))
        prompts = [truncated(state, p, req.truncate_prompt_tokens)
                   for p in await to_prompts(state, req.prompt, req.add_special_tokens)]
    if req.use_beam_search:
        return await beam_search_completion(state, req, model, prompts, f"cmpl-{base_id}")
    # As vLLM: echo with logprobs also asks for the prompt's, so the echoed tokens carry them.
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs
    # vLLM's prompt scoring: echo with max_tokens 0 runs one step (for the prompt's logprobs)
    # and answers with the prompt alone.
    max_tokens = 1 if _scoring_only(req) else req.max_tokens
    params = [build_params(lambda p=p: req.sampling_params(
        max_tokens_for(state, len(p.token_ids), max_tokens), req.logprobs,
        prompt_logprobs, state.generation_defaults)) for p in prompts]
    if req.echo:
        for p in prompts:
            if p.text is None:
                p.text = state.decode(p.token_ids) if state.tokenizer is not None else ""
    request_id = f"cmpl-{base_id}"
    streams = await submit(state, prompts, params, request_id, req.priority,
                           state.lora_request(model))
    if req.stream:
        return _stream(state, req, model, request_id, prompts, streams)
    final = await collect(streams)
    choices = [_choice(state, req, i, prompts[i], out, o)
               for i, out in enumerate(final) for o in out.outputs]
    return CompletionResponse(id=request_id, model=model,
                              choices=sorted(choices, key=lambda c: c.index),
                              usage=_usage(req, prompts, final))


def embeds_prompts(state: ServingState, req: CompletionRequest) -> list[Prompt]:
    """The request's prompt_embeds, decoded and cut to truncate_prompt_tokens (the engine
    checks their shape against the model); their token ids are placeholders, one per row."""
    items = [req.prompt_embeds] if isinstance(req.prompt_embeds, str) else req.prompt_embeds
    if not items:
        raise APIError("prompt_embeds cannot be empty.", param="prompt_embeds")
    keep = req.truncate_prompt_tokens
    keep = state.max_model_len if keep == -1 else keep
    out = []
    for item in items:
        emb = decode_prompt_embeds(item)
        emb = emb[-keep:] if keep is not None and emb.ndim else emb
        out.append(Prompt([0] * (len(emb) if emb.ndim else 1), None, {"prompt_embeds": emb}))
    return out


def _scoring_only(req: CompletionRequest) -> bool:
    return req.echo and req.max_tokens == 0


def _usage(req: CompletionRequest, prompts: list[Prompt], outputs) -> UsageInfo:
    generated = 0 if _scoring_only(req) else sum(len(o.token_ids) for out in outputs
                                                  for o in out.outputs)
    return UsageInfo.of(sum(len(p.token_ids) for p in prompts), generated)


def _piece(req: CompletionRequest, prompt: Prompt, out: RequestOutput, o: CompletionOutput,
           sent_tokens: int, sent_chars: int, first: bool) -> tuple[str, list[int], list]:
    """Text, token ids and logprobs of `o` not sent yet; with echo, the prompt goes in front of
    a choice's first piece."""
    text = o.text[sent_chars:]
    token_ids, positions = o.token_ids[sent_tokens:], list(o.logprobs or [])[sent_tokens:]
    if _scoring_only(req):
        text, token_ids, positions = "", [], []
    if req.echo and first:
        text = prompt.text + text
        token_ids = prompt.token_ids + token_ids
        positions = list(out.prompt_logprobs or [None] * len(prompt.token_ids)) + positions
    return text, token_ids, positions


def _choice(state: ServingState, req: CompletionRequest, i: int, prompt: Prompt,
            out: RequestOutput, o: CompletionOutput) -> CompletionResponseChoice:
    text, token_ids, positions = _piece(req, prompt, out, o, 0, 0, first=True)
    logprobs = None
    if req.logprobs is not None:
        logprobs = completion_logprobs(state, token_ids, positions,
                                       as_ids=bool(req.return_tokens_as_token_ids))
    return CompletionResponseChoice(
        index=i * req.n + o.index, text=text, logprobs=logprobs,
        finish_reason=o.finish_reason, stop_reason=o.stop_reason,
        prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs)
        if req.prompt_logprobs is not None else None)


async def _stream(state: ServingState, req: CompletionRequest, model: str, request_id: str,
                  prompts: list[Prompt], streams) -> AsyncIterator[str]:
    created = int(time.time())
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts.continuous_usage_stats)
    dump = {} if include_usage else {"exclude": {"usage"}}
    sent_tokens: dict[tuple, int] = {}  # (prompt, sample) -> tokens already sent
    sent_text: dict[tuple, int] = {}    # ... and characters of the engine's text
    offset: dict[tuple, int] = {}       # characters sent, echo included (logprobs text_offset)
    finished: set[tuple] = set()
    last: dict[int, RequestOutput] = {}
    try:
        async with aclosing(merge(streams)) as outputs:
            async for i, out in outputs:
                last[i] = out
                for o in out.outputs:
                    key = (i, o.index)
                    if key in finished:
                        continue
                    text, token_ids, positions = _piece(
                        req, prompts[i], out, o, sent_tokens.get(key, 0), sent_text.get(key, 0),
                        first=key not in sent_tokens)
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs = completion_logprobs(
                            state, token_ids, positions, offset.get(key, 0),
                            as_ids=bool(req.return_tokens_as_token_ids))
                    sent_tokens[key], sent_text[key] = len(o.token_ids), len(o.text)
                    offset[key] = offset.get(key, 0) + len(text)
                    if o.finish_reason is not None:
                        finished.add(key)
                    if not text and o.finish_reason is None and not _has_tokens(logprobs):
                        continue
                    chunk = CompletionStreamResponse(
                        id=request_id, created=created, model=model,
                        choices=[CompletionResponseStreamChoice(
                            index=i * req.n + o.index, text=text, logprobs=logprobs,
                            finish_reason=o.finish_reason, stop_reason=o.stop_reason)])
                    if continuous:
                        chunk.usage = _usage(req, prompts, last.values())
                    yield sse(chunk, **dump)
        if include_usage:
            usage = _usage(req, prompts, last.values())
            yield sse(CompletionStreamResponse(id=request_id, created=created, model=model,
                                               choices=[], usage=usage))
    except Exception as e:  # the response has started: report in-band, as vLLM does
        logger.exception("Error while streaming %s", request_id)
        yield sse(error_body(str(e), stream_error_status(e)))
    yield DONE


def _has_tokens(logprobs: CompletionLogProbs | None) -> bool:
    return bool(logprobs and logprobs.tokens)
