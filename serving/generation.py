"""A generation request on the server's side, from its prompt to its streams.

The prompt: prompts in every shape OpenAI allows, turned into checked token ids before the engine sees them:
a text, token ids, lists of either (/v1/completions), and a chat conversation rendered with its
template (/v1/chat/completions, /tokenize).

Checking here (not only in the engine) lets the server give vLLM's messages, with both numbers,
and pick the default max_tokens, which depends on the prompt length.

Chat templates render under a time budget. Jinja compiles a template to Python code (its frames'
file name is "<template>"), so a trace function on the rendering thread can stop a template that
loops too long: nested `{% for %}` loops would otherwise hold the tokenizer thread, and every
text request behind it, for as long as they like. Only template frames are traced line by line;
other calls cost one check each. What one operation does is beyond its reach:
`{{ 'a' * 10**10 }}` allocates before any line ends, which is why request-supplied templates need
--trust-request-chat-template.

The streams, from the engine to the client, with abort on every way out. Each prompt of a request is one engine request. `submit` waits for every first output, so an
engine ValueError becomes a 400 before any response byte is sent. Closing or cancelling the
streams returned here (client gone) closes the engine generators, which aborts the requests.

The other end of the same streams is here too: the server-sent events that carry them, and the
disconnect watch that closes them. Starlette's StreamingResponse notices a disconnect only
through an anyio cancel scope, where any `await` in the stream's clean-up is cancelled again;
here the stream runs as a plain asyncio task and is closed explicitly, so the engine generators'
clean-up (the abort) runs to completion.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import sys
import time
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial
from typing import AsyncIterator, Awaitable, Callable, Optional, TypeVar, Union

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from jaxllm.engine.input_processor import normalize_messages, render_chat_prompt
from jaxllm.entrypoints.media import load_image
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams
from serving.errors import APIError
from serving.state import ServingState, Ticket

# --- the prompt: checked token ids --------------------------------------------------------------

T = TypeVar("T")
TEMPLATE_FILE = "<template>"


@dataclass
class Prompt:
    token_ids: list[int]
    text: Optional[str]  # None for token-id prompts until decoded (only echo needs it)
    # With images: what the engine gets (the ids with one placeholder per image, and the
    # images); token_ids are then the expanded ids, as the engine will count them.
    engine_prompt: Optional[dict] = None


def split_prompts(prompt: Union[str, list[str], list[int], list[list[int]]]) -> list:
    """'a' -> ['a']; [1, 2] -> [[1, 2]]; lists of either stay lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt cannot be empty.", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


async def to_prompts(state: ServingState, prompt, add_special_tokens: bool) -> list[Prompt]:
    out = []
    for p in split_prompts(prompt):
        if isinstance(p, str):
            out.append(Prompt(await state.encode(p, add_special_tokens), p))
        else:
            out.append(Prompt(list(p), None))
        check_token_ids(state, out[-1].token_ids)
    return out


def check_token_ids(state: ServingState, token_ids: list[int]) -> None:
    if not token_ids:
        raise APIError("prompt cannot be empty.", param="prompt")
    bad = [t for t in token_ids if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(f"Token id {bad[0]} is out of vocabulary (size {state.vocab_size}).",
                       param="prompt")


def truncated(state: ServingState, prompt: Prompt, keep: Optional[int]) -> Prompt:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: max_model_len); a cut
    prompt's text is dropped (echo decodes the tokens kept)."""
    if keep is None:
        return prompt
    if keep > state.max_model_len:
        raise APIError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                       f"({state.max_model_len}). Please select a smaller truncation size.",
                       param="truncate_prompt_tokens")
    keep = state.max_model_len if keep == -1 else keep
    if prompt.engine_prompt is not None:
        raise APIError("truncate_prompt_tokens is not supported with images (it could cut an "
                       "image's tokens)", param="truncate_prompt_tokens")
    if len(prompt.token_ids) <= keep:
        return prompt
    return Prompt(prompt.token_ids[-keep:], None)


def max_tokens_for(state: ServingState, num_prompt_tokens: int, requested: Optional[int]) -> int:
    """vLLM's rule: the request's max_tokens if it fits; if unset, the rest of the context
    (capped by the generation config's max_new_tokens)."""
    limit = state.max_model_len
    if num_prompt_tokens >= limit:
        raise APIError(f"This model's maximum context length is {limit} tokens. However, your "
                       f"request has {num_prompt_tokens} input tokens. Please reduce the length "
                       f"of the input.", param="prompt")
    if requested is None:
        cap = state.generation_defaults.get("max_new_tokens")
        return min(limit - num_prompt_tokens, cap or limit)
    if requested >= 1 and num_prompt_tokens + requested > limit:
        raise APIError(f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This "
                       f"model's maximum context length is {limit} tokens and your request has "
                       f"{num_prompt_tokens} input tokens ({requested} > {limit} - "
                       f"{num_prompt_tokens}).", param="max_tokens")
    return requested


# --- chat conversations ---------------------------------------------------------------------------

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
    images = [] if state.images is not None else None  # a vision-language model's parts
    try:
        messages = normalize_messages(req.messages, images=None if images is None else [])
        # with images, the request's own parts (the normalized messages have none left)
        render = partial(render_chat_prompt, tokenizer,
                         messages if images is None else req.messages,
                         chat_template=req.chat_template or state.chat_template,
                         add_generation_prompt=req.add_generation_prompt,
                         continue_final_message=req.continue_final_message, tools=tools,
                         chat_template_kwargs=req.chat_template_kwargs,
                         content_format=state.chat_template_content_format,
                         template_source=_template_source(state, req), images=images,
                         image_placeholder=state.images.placeholder if images is not None
                         else "")
        text = await state.in_tokenizer_thread(call_with_deadline, render,
                                               limits.chat_template_timeout)
    except ValueError as e:
        raise APIError(str(e), param="messages") from None
    add_special = bool(req.add_special_tokens)
    prompt = Prompt(await state.encode(text, add_special), text)
    if images:  # read and preprocessed off the event loop and the tokenizer thread
        prompt = await asyncio.to_thread(_with_images, state, prompt, images)
    check_token_ids(state, prompt.token_ids)
    return prompt, messages


def _with_images(state: ServingState, prompt: Prompt, refs: list) -> Prompt:
    """The prompt with its images read (jaxllm/entrypoints/media.py), counted against
    --limit-mm-per-prompt and preprocessed: the engine's expansion of it, which the engine
    repeats from the processor's cache."""
    limit = state.images.max_images
    if limit is not None and len(refs) > limit:
        raise APIError(f"{len(refs)} images in one request; at most {limit} are allowed "
                       f"(--limit-mm-per-prompt)", param="messages")
    try:
        images = [load_image(r, state.media, where=f"image {i}") for i, r in enumerate(refs)]
        ids, _ = state.images.expand(prompt.token_ids, images)
    except ValueError as e:
        raise APIError(str(e), param="messages") from None
    return Prompt(ids, prompt.text, {"prompt_token_ids": prompt.token_ids,
                                     "multi_modal_data": {"image": images}})


def _template_source(state: ServingState, req) -> str:
    """Which template renders `req`, for the log (the warning about dropped tools)."""
    if req.chat_template is not None:
        return "the request's chat_template"
    if state.chat_template is not None:
        return "the --chat-template template"
    return f"the chat template of model {state.model_path}"


class RenderTimeout(Exception):
    """A chat template ran past its time budget."""


def call_with_deadline(fn: Callable[[], T], seconds: float) -> T:
    """fn() on this thread, raising RenderTimeout once template code runs past `seconds`."""
    deadline = time.monotonic() + seconds

    def on_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise RenderTimeout(f"the chat template took longer than {seconds:g} s to render")
        return on_line

    def on_call(frame, event, arg):
        if frame.f_code.co_filename == TEMPLATE_FILE:
            return on_line(frame, event, arg)
        return None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return fn()
    finally:
        sys.settrace(previous)


# --- the params and the engine streams ---------------------------------------------------------

_PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)}


def _bad_request(e: ValueError) -> APIError:
    """A 400 for a SamplingParams error (its message starts with the field's name) or one the
    engine's input processor raised (checked against the model there, once)."""
    field = re.match(r"(?:Requested )?(\w+)", str(e))
    return APIError(str(e), param=field.group(1) if field and field.group(1) in _PARAM_NAMES
                    else None)


def build_params(make) -> SamplingParams:
    """Run a SamplingParams factory; a ValueError (it names the field) becomes a 400."""
    try:
        return make()
    except ValueError as e:
        raise _bad_request(e) from None


async def _first(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await gen.__anext__()


async def submit(state: ServingState, prompts: list[Prompt], params: list[SamplingParams],
                 request_id: str, priority: int, lora_request=None
                 ) -> list[AsyncIterator[RequestOutput]]:
    """Start one engine request per prompt (with the LoRA adapter the request's `model` named,
    if any); return their output streams once all have begun.

    The request's sequences are admitted first (503 when the server is full); each stream
    gives its sequences back when it ends, however it ends."""
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    adapter = {} if lora_request is None else {"lora_request": lora_request}
    tickets = [state.admission.enter(sp.n) for sp in params]
    gens = []
    firsts = []
    try:
        for rid, prompt, sp in zip(ids, prompts, params):
            state.log_request(rid, prompt.text, prompt.token_ids, sp)
            gens.append(state.engine.generate(getattr(prompt, "engine_prompt", None)
                                              or prompt.token_ids, sp,
                                              rid, priority=priority, **adapter))
        firsts = [asyncio.ensure_future(_first(g)) for g in gens]
        await asyncio.wait(firsts, return_when=asyncio.FIRST_EXCEPTION)
        for task in firsts:
            if task.done() and task.exception() is not None:
                raise task.exception()
    except BaseException as e:
        for task in firsts:
            task.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for g in gens:
            await g.aclose()
        for ticket in tickets:
            ticket.release()
        if isinstance(e, ValueError):
            raise _bad_request(e) from None
        raise
    return [_tracked(state, t.result(), g, ticket) for t, g, ticket in zip(firsts, gens, tickets)]


async def _tracked(state: ServingState, first: RequestOutput, gen: AsyncIterator[RequestOutput],
                   ticket: Ticket) -> AsyncIterator[RequestOutput]:
    """Yield the outputs; record metrics and leave admission once the request ends."""
    last = first
    try:
        yield first
        if not first.finished:
            async for out in gen:
                last = out
                yield out
    finally:
        ticket.release()
        state.metrics.record(last, aborted=not last.finished)
        await gen.aclose()


async def merge(streams: list[AsyncIterator[RequestOutput]]
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as (stream index, output), in arrival order."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, stream):
        try:
            async with aclosing(stream):
                async for out in stream:
                    await queue.put((i, out))
            await queue.put((i, done))
        except Exception as e:  # handed to the consumer, which re-raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(streams: list[AsyncIterator[RequestOutput]]) -> list[Optional[RequestOutput]]:
    """The final output of every stream (non-streaming responses)."""
    final: list[Optional[RequestOutput]] = [None] * len(streams)
    async with aclosing(merge(streams)) as outputs:
        async for i, out in outputs:
            final[i] = out
    return final


# --- the client's end: server-sent events, and the disconnect that aborts the work ----------------

DONE = "data: [DONE]\n\n"


def sse(chunk: Union[BaseModel, dict], **dump_kwargs) -> str:
    if isinstance(chunk, BaseModel):
        return f"data: {chunk.model_dump_json(**dump_kwargs)}\n\n"
    return f"data: {json.dumps(chunk)}\n\n"


class EventStreamResponse(StreamingResponse):
    def __init__(self, events: AsyncIterator[str]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watch):
                task.cancel()
            await asyncio.gather(stream, watch, return_exceptions=True)
            await self.body_iterator.aclose()


async def until_disconnect(request: Request, work: Awaitable) -> Union[object, Response]:
    """Await `work`, cancelling it if the client disconnects first (a non-streamed request)."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    return task.result()
