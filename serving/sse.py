"""Server-sent events, and cancelling the work behind them when the client goes away.

Starlette's StreamingResponse notices a disconnect only through an anyio cancel scope, where any
`await` in the stream's clean-up is cancelled again; here the stream runs as a plain asyncio task
and is closed explicitly, so the engine generators' clean-up (the abort) runs to completion.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Awaitable, Union

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

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
