"""A generation request's streams, from the engine to the client, with abort on every way out.

Each prompt of a request is one engine request. `submit` waits for every first output, so an
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
from contextlib import aclosing
from typing import AsyncIterator, Awaitable, Optional, Union

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams
from serving.errors import APIError
from serving.prompts import Prompt
from serving.state import ServingState, Ticket

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
