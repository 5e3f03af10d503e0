"""vLLM's development routes for sleep mode and new weights (RL loops): `POST /sleep`,
`POST /wake_up`, `GET /is_sleeping`, and jaxllm's `POST /update_weights` (a checkpoint folder
read into the running model).

vLLM registers them only with $VLLM_SERVER_DEV_MODE=1; here they answer a 404 saying so
without it (and stay out of /openapi.json). Sleeping also needs --enable-sleep-mode (a 400
naming it); requests that arrive while the engine sleeps get a 503.
"""

from __future__ import annotations

import os
from typing import Optional

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from jaxllm.loader.hf import iter_weight_files, weight_files
from serving.errors import APIError
from serving.protocol import RequestBody

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def dev_mode(environ=os.environ) -> bool:
    """$VLLM_SERVER_DEV_MODE as vLLM reads it ("1"; "true" accepted too)."""
    return environ.get(DEV_MODE_ENV, "0").strip().lower() in ("1", "true")


def _dev_mode_on(request: Request) -> None:
    if not request.app.state.dev_mode:
        raise APIError(f"{request.url.path} is a development route: start the server with "
                       f"{DEV_MODE_ENV}=1 to use it.", 404)


router = APIRouter(dependencies=[Depends(_dev_mode_on)])


def _engine(request: Request):
    return request.app.state.serving.engine


async def _run(call):
    try:
        return await call
    except ValueError as e:  # sleep mode off, a bad level, mode or tag, a bad checkpoint
        raise APIError(str(e), 400) from e


@router.post("/sleep")
async def sleep(request: Request, level: int = Query(1), mode: str = Query("abort")):
    """level 1: the weights to host memory, the KV cache freed; 2: both freed. mode: what
    becomes of the requests in flight: 'abort' them, 'wait' for them, or 'keep' them (they
    resume after /wake_up)."""
    done = await _run(_engine(request).sleep(level, mode))
    return JSONResponse({"status": "sleeping", **done})


@router.post("/wake_up")
async def wake_up(request: Request, tags: Optional[list[str]] = Query(None)):
    """tags: what to take back ('weights', 'kv_cache'; default both)."""
    await _run(_engine(request).wake_up(tags))
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(request: Request):
    return {"is_sleeping": await _engine(request).is_sleeping()}


class UpdateWeightsRequest(RequestBody):
    model_path: str  # a folder of the model's Hugging Face checkpoint (safetensors)


@router.post("/update_weights")
async def update_weights(body: UpdateWeightsRequest, request: Request):
    """Read the checkpoint in `model_path` (same architecture and shapes) into the running
    model, once the requests in flight finish (new ones wait meanwhile)."""
    try:
        fmt, files = weight_files(body.model_path, "auto")
    except (OSError, ValueError) as e:
        raise APIError(f"model_path {body.model_path!r}: {e}", 400, "model_path") from e
    await _run(_engine(request).update_weights(iter_weight_files(files, fmt, {})))
    return Response(status_code=200)
