"""OpenAI-shaped errors: every failure leaves the server as {"error": {message, type, param, code}}.

vLLM answers request-validation failures with 400 (not FastAPI's 422 body), and so do we.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxllm.engine.errors import (EngineDeadError, EngineSleepingError, ReplicaLostError,
                                  RequestCancelledError)

logger = logging.getLogger("jaxllm.serving")


class APIError(Exception):
    """A request the server refuses; carries the HTTP status and the field at fault."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.message, self.status, self.param, self.headers = message, status, param, headers


def error_type(status: int) -> str:
    """vLLM's error types: 'BadRequestError', 'NotFoundError', 'InternalServerError'..."""
    phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    return phrase if phrase.endswith("Error") else phrase + "Error"


def stream_error_status(exc: BaseException) -> int:
    """The code of an error reported inside a started stream."""
    return 503 if isinstance(exc, (RequestCancelledError, EngineSleepingError)) else 500


def error_body(message: str, status: int = 400, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": status}}


def error_response(message: str, status: int = 400, param: Optional[str] = None,
                   headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def describe_validation_errors(errors: list[dict]) -> tuple[str, Optional[str]]:
    """Pydantic's error list as one readable line, plus the first offending field."""
    parts, params = [], []
    for err in errors[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = ".".join(loc)
        msg = err.get("msg", "invalid value")
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error")
            parts.append(f"Invalid JSON body: {detail}" if detail else "Invalid JSON body")
            continue
        parts.append(f"{field}: {msg}" if field else msg)
        if loc and not loc[0].isdigit():
            params.append(loc[0])
    if len(errors) > 5:
        parts.append(f"(and {len(errors) - 5} more)")
    return "; ".join(parts) or "Invalid request", (params[0] if params else None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.message, exc.status, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = describe_validation_errors(list(exc.errors()))
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError):
        return error_response(f"{exc}; the server is shutting down.", 500)

    @app.exception_handler(ReplicaLostError)
    async def _replica_lost(_: Request, exc: ReplicaLostError):
        return error_response(f"{exc}; retry: the other replicas serve on.", 500)

    @app.exception_handler(RequestCancelledError)
    async def _cancelled(_: Request, exc: RequestCancelledError):
        return error_response(str(exc), 503)

    @app.exception_handler(EngineSleepingError)
    async def _sleeping(_: Request, exc: EngineSleepingError):
        return error_response(str(exc), 503)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("Internal error while serving %s", request.url.path)
        return error_response(f"Internal server error: {type(exc).__name__}", 500)


_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}


_POST_ERRORS = {"404": "The model does not exist", "413": "Request body too large",
                "503": "Overloaded (Retry-After) or the engine is not running"}
_OPEN_ROUTES = ("/health", "/ping", "/metrics")  # answered without the API key


def document_errors(app: FastAPI) -> None:
    """Make /openapi.json say what the server answers: refused bodies are 400 (not FastAPI's
    422) and every error has the OpenAI shape; /health and /ping answer 200 with no body or
    503; /metrics is Prometheus text."""
    generate = app.openapi

    def openapi() -> dict:
        schema = generate()  # FastAPI caches it: patch it once
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        if "ErrorResponse" not in schemas:
            schemas["ErrorResponse"] = _ERROR_SCHEMA
            error = {"content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
            for path, operations in schema.get("paths", {}).items():
                for method, operation in operations.items():
                    responses = operation["responses"]
                    if responses.pop("422", None) is not None:
                        responses["400"] = {"description": "Invalid request", **error}
                    if method == "post":  # a body, with a model name, for the engine
                        for code, why in _POST_ERRORS.items():
                            responses[code] = {"description": why, **error}
                    if path not in _OPEN_ROUTES:
                        responses["401"] = {"description": "Missing or wrong API key (when "
                                                           "the server has one)", **error}
                    if path in ("/health", "/ping"):
                        responses["200"] = {"description": "Healthy (no body)"}
                        responses["503"] = {"description": "Engine not healthy", **error}
                    if path == "/metrics":
                        responses["200"] = {"description": "Prometheus metrics", "content": {
                            "text/plain": {"schema": {"type": "string"}}}}
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
        return schema

    app.openapi = openapi
