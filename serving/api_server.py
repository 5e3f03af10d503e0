"""The FastAPI app (routes, CORS, API key, request ids, HTTP limits) and the uvicorn runner of
`jaxllm serve`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from typing import Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

import jaxllm
from serving import dev_routes
from serving.cli_args import chat_output_settings, lora_modules
from serving.errors import APIError, document_errors, error_response, install_error_handlers
from serving.generation import EventStreamResponse, until_disconnect
from serving.lora_adapters import RUNTIME_UPDATING_ENV, runtime_updating_allowed
from serving.log_setup import setup_logging
from serving.middleware import APIKeyMiddleware, HTTPLimitsMiddleware, RequestIdMiddleware
from serving.protocol import (ChatCompletionRequest, DetokenizeRequest, LoadLoRAAdapterRequest,
                              ModelCard, ModelList, TokenizeRequest, UnloadLoRAAdapterRequest,
                              random_id)
from serving.protocol_completion import CompletionRequest
from serving.protocol_pooling import EmbeddingRequest, PoolingRequest
from serving.protocol_responses import ResponsesRequest
from serving.protocol_score import ClassificationRequest, RerankRequest, ScoreRequest
from serving.serving_chat import create_chat_completion
from serving.serving_completion import create_completion
from serving.serving_embedding import create_embedding, create_pooling
from serving.serving_responses import cancel_response, create_response, retrieve_response
from serving.serving_score import create_classify, create_rerank, create_score
from serving.serving_tokenization import detokenize, tokenize
from serving.state import RequestLimits, ServingState

logger = logging.getLogger("jaxllm.serving")
router = APIRouter()


def _state(request: Request) -> ServingState:
    return request.app.state.serving


def _base_id(request: Request) -> str:
    """The client's X-Request-Id only with --enable-request-id-headers (checked there)."""
    return request.scope.get("state", {}).get("request_id") or random_id()


async def _respond(request: Request, work) -> Response:
    result = await until_disconnect(request, work)
    if isinstance(result, Response):
        return result
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    return EventStreamResponse(result)


# vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S: a loop pass slower than this makes /health 503.
STALL_SECONDS = float(os.environ.get("VLLM_ENGINE_ITERATION_TIMEOUT_S", 60))


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine loop is alive and passing; 503 with the reason otherwise."""
    problem = _state(request).engine.health(STALL_SECONDS)
    if problem is not None:
        return error_response(f"Unhealthy: {problem}.", 503)
    return Response(status_code=200)


@router.get("/ping")
async def ping(request: Request) -> Response:
    """vLLM's (SageMaker's) health route, GET or POST."""
    return await health(request)


@router.post("/ping")
async def ping_post(request: Request) -> Response:
    return await health(request)


@router.get("/version")
async def version():
    return {"version": jaxllm.__version__}


@router.get("/v1/models")
async def models(request: Request):
    """The served names, then each LoRA adapter (root: its path, parent: its base model)."""
    s = _state(request)
    cards = [ModelCard(id=name, root=s.model_path, max_model_len=s.max_model_len)
             for name in s.served_model_names]
    adapters = s.lora.requests.values() if getattr(s, "lora", None) is not None else ()
    cards += [ModelCard(id=r.lora_name, root=r.lora_path, parent=r.base_model_name,
                        max_model_len=s.max_model_len) for r in adapters]
    return ModelList(data=cards).model_dump()


def _runtime_lora_updating(request: Request) -> None:
    """vLLM registers the adapter routes only with $VLLM_ALLOW_RUNTIME_LORA_UPDATING true (a 404
    without); here they answer that 404 themselves, before reading the body, saying what turns
    them on (and stay out of /openapi.json)."""
    lora = getattr(_state(request), "lora", None)
    if lora is None or not lora.runtime_updating:
        raise APIError(f"Loading and unloading LoRA adapters at run time is off: start the "
                       f"server with {RUNTIME_UPDATING_ENV}=True (and --enable-lora).", 404)


lora_router = APIRouter(dependencies=[Depends(_runtime_lora_updating)])


@lora_router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
    s = _state(request)
    return PlainTextResponse(await s.lora.load(s.engine, body.lora_name, body.lora_path))


@lora_router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
    s = _state(request)
    return PlainTextResponse(await s.lora.unload(s.engine, body.lora_name, body.lora_int_id))


# What a route answers with "stream": true, besides its JSON: server-sent events, each event's
# data a JSON object (a chunk, or an error).
STREAMED = {200: {"content": {"text/event-stream": {"schema": {"type": "object"}}}}}


@router.post("/v1/completions", responses=STREAMED)
async def completions(body: CompletionRequest, request: Request):
    return await _respond(request, create_completion(_state(request), body, _base_id(request)))


@router.post("/v1/chat/completions", responses=STREAMED)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await _respond(request,
                          create_chat_completion(_state(request), body, _base_id(request)))


@router.post("/v1/responses", responses=STREAMED)
async def responses(body: ResponsesRequest, request: Request):
    return await _respond(request, create_response(_state(request), body, _base_id(request)))


# What the stored-response routes answer besides 200: an OpenAI error body.
_ERROR = {"content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
STORED = {404: {"description": "No stored response has this id", **_ERROR},
          400: {"description": "The response cannot be cancelled", **_ERROR}}


@router.get("/v1/responses/{response_id}", responses={404: STORED[404]})
async def retrieve_responses(response_id: str, request: Request):
    return retrieve_response(_state(request), response_id)


@router.post("/v1/responses/{response_id}/cancel", responses=STORED)
async def cancel_responses(response_id: str, request: Request):
    return cancel_response(_state(request), response_id)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    return (await create_embedding(_state(request), body, _base_id(request))).model_dump()


@router.post("/pooling")
async def pooling(body: PoolingRequest, request: Request):
    return (await create_pooling(_state(request), body, _base_id(request))).model_dump()


@router.post("/classify")
async def classify(body: ClassificationRequest, request: Request):
    return (await create_classify(_state(request), body, _base_id(request))).model_dump()


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request):
    return (await create_score(_state(request), body, _base_id(request))).model_dump()


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request):
    return (await create_rerank(_state(request), body, _base_id(request))).model_dump()


@router.post("/tokenize")
async def tokenize_route(body: TokenizeRequest, request: Request):
    return (await tokenize(_state(request), body)).model_dump()


@router.post("/detokenize")
async def detokenize_route(body: DetokenizeRequest, request: Request):
    return (await detokenize(_state(request), body)).model_dump()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def build_app(state: ServingState, args: argparse.Namespace) -> FastAPI:
    docs = {} if not args.disable_fastapi_docs else dict(openapi_url=None, docs_url=None,
                                                          redoc_url=None)
    app = FastAPI(title="jaxllm OpenAI-compatible API", version=jaxllm.__version__, **docs)
    app.state.serving = state
    install_error_handlers(app)
    app.include_router(router)
    lora = getattr(state, "lora", None)
    app.include_router(lora_router,
                       include_in_schema=lora is not None and lora.runtime_updating)
    app.state.dev_mode = dev_routes.dev_mode()
    app.include_router(dev_routes.router, include_in_schema=app.state.dev_mode)
    document_errors(app)
    # Added last = outermost: CORS answers preflights and decorates 401s too.
    app.add_middleware(HTTPLimitsMiddleware, max_body=args.max_request_body_size,
                       max_headers=args.h11_max_header_count,
                       max_header_bytes=args.h11_max_incomplete_event_size,
                       read_timeout=args.http_read_timeout)
    api_key = (args.api_key or os.environ.get("VLLM_API_KEY")
               or os.environ.get("JAXLLM_API_KEY"))
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if args.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                       allow_credentials=args.allow_credentials,
                       allow_methods=args.allowed_methods, allow_headers=args.allowed_headers)
    return app


def bind_socket(host: Optional[str], port: int) -> socket.socket:
    """Take the port before loading the model, so a busy port fails in a second, not minutes."""
    family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host or "", port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"error: cannot listen on {host or '0.0.0.0'}:{port}: {e.strerror}. "
                         f"Is another server running there? Choose another --port.") from None
    return sock


def run_server(args: argparse.Namespace) -> None:
    from jaxllm.config import ConfigError, EngineArgs
    from jaxllm.engine.input_processor import load_chat_template
    from serving.vllm_flags import check_vllm_flags

    setup_logging(args.log_level)
    if args.disable_log_requests:
        logger.warning("--disable-log-requests is deprecated (as in vLLM): requests are not "
                       "logged unless --enable-log-requests is given.")
    try:
        settings = chat_output_settings(args)
        check_vllm_flags(args)
        engine_args = EngineArgs.from_cli_args(args)
        modules = lora_modules(args, list(engine_args.served_model_name or [engine_args.model]),
                               engine_args.enable_lora)
        chat_template = load_chat_template(args.chat_template)
    except (ConfigError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    sock = bind_socket(args.host, args.port)
    asyncio.run(_serve(args, engine_args, chat_template, settings, sock, modules))


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(max_n_sequences=args.max_n_sequences,
                         max_stop_strings=args.max_stop_strings,
                         max_logit_bias=args.max_logit_bias,
                         chat_template_timeout=args.chat_template_timeout,
                         trust_request_chat_template=args.trust_request_chat_template,
                         max_waiting_requests=args.max_waiting_requests)


async def _serve(args, engine_args, chat_template, settings: dict,
                 sock: socket.socket, modules: list) -> None:
    import uvicorn

    from jaxllm.deploy.data_parallel import make_engine
    from jaxllm.engine.async_engine import AsyncLLMEngine
    from serving.http_server import Server, h11_protocol

    engine = AsyncLLMEngine(make_engine(engine_args))
    state = ServingState.from_engine(engine, limits=request_limits(args),
                                     chat_template=chat_template,
                                     response_role=args.response_role,
                                     log_requests=args.enable_log_requests,
                                     max_log_len=args.max_log_len,
                                     **settings)
    try:
        await _register_adapters(state, modules)
        config = uvicorn.Config(build_app(state, args), log_level=args.uvicorn_log_level,
                                access_log=not args.disable_uvicorn_access_log,
                                ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                                ssl_ca_certs=args.ssl_ca_certs, root_path=args.root_path or "",
                                http=h11_protocol(args.http_read_timeout),
                                h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                                timeout_keep_alive=int(os.environ.get(
                                    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", 5)),
                                # ours (cancel_after_shutdown_timeout) answers first
                                timeout_graceful_shutdown=args.shutdown_timeout + 5)
        server = Server(config)
        scheme = "https" if args.ssl_certfile else "http"
        url = f"{scheme}://{args.host or '0.0.0.0'}:{sock.getsockname()[1]}"  # --port 0 too
        docs = "" if args.disable_fastapi_docs else f"; docs at {url}/docs"
        background = [asyncio.ensure_future(_announce(
            server, f"{url} (model: {', '.join(state.served_model_names)}{docs})")),
            asyncio.ensure_future(server.watch_engine(engine)),
            asyncio.ensure_future(server.cancel_after_shutdown_timeout(
                engine, args.shutdown_timeout))]
        await server.serve(sockets=[sock])
        for task in background:
            task.cancel()
    finally:
        state.close()
        engine.shutdown()
    if server.engine_failed:
        raise SystemExit(1)


async def _register_adapters(state: ServingState, modules: list) -> None:
    """The --lora-modules into the engine (ids 1, 2, ... in order); the runtime routes on if
    $VLLM_ALLOW_RUNTIME_LORA_UPDATING is true. A module that cannot load stops the start-up."""
    state.lora.runtime_updating = runtime_updating_allowed()
    if state.lora.runtime_updating:
        logger.warning("LoRA adapters may be loaded and unloaded at run time "
                       "(%s): only for local development, as in vLLM.", RUNTIME_UPDATING_ENV)
    try:
        await state.lora.register(state.engine, modules)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


async def _announce(server, where: str) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    logger.info("jaxllm API server ready at %s", where)


