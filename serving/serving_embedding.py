"""POST /v1/embeddings (OpenAI's shape) and /pooling (vLLM's), on a --runner pooling engine.

Each input is tokenized on the tokenizer thread (bounded as every prompt is), admitted as one
sequence, and pooled on the engine thread between steps. base64 is the float32 vector's
little-endian bytes, as OpenAI's clients decode it.
"""

from __future__ import annotations

import base64
from typing import Optional, Union

import numpy as np

from jaxllm.pooling_params import PoolingParams
from serving.errors import APIError
from serving.protocol import UsageInfo
from serving.protocol_pooling import (EmbeddingData, EmbeddingRequest, EmbeddingResponse,
                                      PoolingData, PoolingRequest, PoolingResponse)
from serving.state import ServingState


def _inputs(req: EmbeddingRequest) -> list[Union[str, list[int]]]:
    inp = req.input
    if isinstance(inp, str) or (inp and isinstance(inp[0], int)):
        inp = [inp]
    if not inp or any(len(x) == 0 for x in inp):
        raise APIError("input cannot be empty.", param="input")
    return list(inp)


def _params(req: EmbeddingRequest) -> PoolingParams:
    if "normalize" in (req.model_extra or {}):
        raise APIError("Parameter `normalize` was removed (as in vLLM); use `use_activation` "
                       "instead.", param="normalize")
    try:
        return PoolingParams(use_activation=req.use_activation, dimensions=req.dimensions,
                             truncate_prompt_tokens=req.truncate_prompt_tokens,
                             task=getattr(req, "task", None))
    except ValueError as e:
        raise APIError(str(e), param=str(e).split()[0].split("=")[0]) from None


def _encode(data: np.ndarray, fmt: str):
    if fmt == "base64":
        return base64.b64encode(data.astype("<f4").tobytes()).decode("ascii")
    return data.tolist()


async def _pool(state: ServingState, req: EmbeddingRequest, base_id: str,
                params: Optional[PoolingParams] = None):
    """(name, [PoolingRequestOutput], prompt tokens) for every input of the request (params:
    the request's pooling, when it is not an embedding request's)."""
    state.warn_ignored_fields(req)
    name = state.model_name(req.model, adapters=False)  # pooling runs no adapter
    params = _params(req) if params is None else params
    inputs = _inputs(req)
    if len(inputs) > state.limits.max_n_sequences:
        raise APIError(f"{len(inputs)} inputs is more than the {state.limits.max_n_sequences} "
                       f"this server allows per request (--max-n-sequences).", param="input")
    ticket = state.admission.enter(len(inputs))
    try:
        outs = []
        for i, item in enumerate(inputs):
            ids = (await state.encode(item, req.add_special_tokens) if isinstance(item, str)
                   else item)
            try:
                outs.append(await state.engine.encode({"prompt_token_ids": ids}, params,
                                                      f"{base_id}-{i}"))
            except ValueError as e:
                raise APIError(str(e), param="input") from None
    finally:
        ticket.release()
    return name, outs, sum(len(o.prompt_token_ids) for o in outs)


async def create_embedding(state: ServingState, req: EmbeddingRequest,
                           base_id: str) -> EmbeddingResponse:
    if getattr(req, "task", None) not in (None, "embed"):
        raise APIError("/v1/embeddings returns one vector per input: use /pooling for "
                       "task token_embed.", param="task")
    name, outs, tokens = await _pool(state, req, base_id)
    data = [EmbeddingData(index=i, embedding=_encode(o.outputs.data, req.encoding_format))
            for i, o in enumerate(outs)]
    return EmbeddingResponse(id=f"embd-{base_id}", model=name, data=data,
                             usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))


async def create_pooling(state: ServingState, req: PoolingRequest,
                         base_id: str) -> PoolingResponse:
    name, outs, tokens = await _pool(state, req, base_id)
    data = [PoolingData(index=i, data=_encode(o.outputs.data, req.encoding_format))
            for i, o in enumerate(outs)]
    return PoolingResponse(id=f"pool-{base_id}", model=name, data=data,
                           usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))
