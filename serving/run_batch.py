"""`jaxllm run-batch -i in.jsonl -o out.jsonl`: an OpenAI batch file through the engine.

Every line is submitted at once (the engine batches them) through the same code as the server's
endpoints, so a line's response body is exactly what the server would answer. A bad line gets
its error in its own output line ("response": null); it never stops the file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Optional

from pydantic import ValidationError

from jaxllm.config import EngineArgs
from jaxllm.engine.input_processor import load_chat_template
from serving.cli_args import chat_output_settings
from serving.errors import APIError, describe_validation_errors, error_body
from serving.protocol import (BatchRequestInput, BatchRequestOutput, BatchResponseData,
                              ChatCompletionRequest, random_id)
from serving.protocol_completion import CompletionRequest
from serving.protocol_pooling import EmbeddingRequest
from serving.protocol_responses import ResponsesRequest
from serving.protocol_score import RerankRequest, ScoreRequest
from serving.serving_chat import create_chat_completion
from serving.serving_completion import create_completion
from serving.serving_embedding import create_embedding
from serving.serving_responses import create_response
from serving.serving_score import create_rerank, create_score
from serving.state import ServingState

logger = logging.getLogger("jaxllm.run_batch")


HANDLERS = {"/v1/completions": (CompletionRequest, create_completion),
            "/v1/chat/completions": (ChatCompletionRequest, create_chat_completion),
            "/v1/responses": (ResponsesRequest, create_response)}
# A pooling model's lines (--runner pooling), as vLLM's run-batch takes them: the server's
# routes for embeddings, scores and reranking.
POOLING_HANDLERS = {"/v1/embeddings": (EmbeddingRequest, create_embedding),
                    **{url: (ScoreRequest, create_score) for url in ("/score", "/v1/score")},
                    **{url: (RerankRequest, create_rerank)
                       for url in ("/rerank", "/v1/rerank", "/v2/rerank")}}


def run(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    try:  # read the input before the slow model load, so a wrong path fails at once
        with open(args.input_file, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        chat_template = load_chat_template(args.chat_template)
        settings = chat_output_settings(args)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    results = asyncio.run(run_with_engine(engine_args, lines, args.response_role, chat_template,
                                          settings))
    with open(args.output_file, "w", encoding="utf-8") as f:
        for result in results:
            f.write(result.model_dump_json() + "\n")
    failed = sum(r.error is not None for r in results)
    print(f"{len(results)} requests, {len(results) - failed} succeeded, {failed} failed; "
          f"results in {args.output_file}", file=sys.stderr)
    return 0


async def run_with_engine(engine_args, lines: list[str], response_role: str = "assistant",
                          chat_template=None, settings: Optional[dict] = None):
    """The lines' results from an engine started for them (and shut down after)."""
    from jaxllm.deploy.data_parallel import make_engine  # JAX loads here, not at import
    from jaxllm.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(make_engine(engine_args))
    state = ServingState.from_engine(engine, chat_template=chat_template,
                                     response_role=response_role, log_requests=False,
                                     **(settings or {}))
    try:
        return await run_lines(state, lines)
    finally:
        state.close()
        engine.shutdown()


async def run_lines(state: ServingState, lines: list[str]) -> list[BatchRequestOutput]:
    """All lines concurrently; results in input order."""
    return await asyncio.gather(*(run_line(state, line) for line in lines))


async def run_line(state: ServingState, line: str) -> BatchRequestOutput:
    custom_id = _custom_id(line)
    base_id = random_id()
    try:
        try:
            request = BatchRequestInput.model_validate_json(line)
            handlers = (HANDLERS if "generate" in state.engine.supported_tasks
                        else POOLING_HANDLERS)
            if request.url not in handlers:
                raise APIError(f"url {request.url!r} is not supported by this model "
                               f"({_kind(state)}); use {' or '.join(handlers)}.", param="url")
            if request.method.upper() != "POST":
                raise APIError(f"method {request.method!r} is not supported; use POST.",
                               param="method")
            model, create = handlers[request.url]
            body = model.model_validate(request.body)
        except ValidationError as e:
            raise APIError(describe_validation_errors(e.errors())[0]) from None
        if getattr(body, "stream", False):
            raise APIError("stream is not supported in batch files.", param="stream")
        response = await create(state, body, base_id)
    except APIError as e:
        return _failed(custom_id, error_body(e.message, e.status, e.param))
    except Exception as e:  # one line's internal failure must not lose the other lines
        logger.exception("Batch line %s failed", custom_id)
        return _failed(custom_id, error_body(f"Internal error: {type(e).__name__}: {e}", 500))
    return BatchRequestOutput(
        id=f"batch_req_{random_id()}", custom_id=custom_id, error=None,
        response=BatchResponseData(status_code=200, request_id=base_id,
                                   body=response.model_dump()))


def _kind(state: ServingState) -> str:
    return ("a generative model" if "generate" in state.engine.supported_tasks
            else "a pooling model, --runner pooling")


def _failed(custom_id, body: dict) -> BatchRequestOutput:
    return BatchRequestOutput(id=f"batch_req_{random_id()}", custom_id=custom_id, response=None,
                              error=body["error"])


def _custom_id(line: str):
    """The line's custom_id if it can be read at all (so even a bad line can be matched)."""
    try:
        value = json.loads(line).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
