"""Thin FastAPI routes over `OpenAIServing`: translate HTTP to calls and results to responses.

Invariants:
- Every error leaves as an OpenAI-style body {"error": {"message", "type", "param", "code"}}:
  validation problems and invalid JSON -> 400, unknown routes -> 404, wrong method -> 405,
  bodies over the limit -> 413, full queue -> 429, anything unexpected -> 500 with a generic
  message (the traceback goes to the server log, never to the client).
- With an API key, every /v1 route needs `Authorization: Bearer KEY` (401 otherwise); `/`,
  `/health` and `/metrics` stay open.
- `blockpress_requests_total{endpoint,status}` counts every response (unknown paths -> "other").
"""

from __future__ import annotations

import hmac
import logging
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import CONTENT_TYPE, Metrics
from .protocol import (APIError, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                       ErrorResponse, ModelList, error_body)
from .serving import OpenAIServing

log = logging.getLogger("blockpress.server")
ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429)}
ENDPOINTS = {"/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/openapi.json",
             "/docs"}


def _error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


class Guard:
    """Pure ASGI middleware: body-size limit, API key, and the request counter."""

    def __init__(self, app, metrics: Metrics, max_body_bytes: int, api_key: str | None):
        self.app, self.metrics, self.max_body, self.api_key = app, metrics, max_body_bytes, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS or path.startswith("/static/") else "other"
        endpoint = "/static" if endpoint.startswith("/static/") else endpoint
        status_seen = {}

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status_seen["status"] = message["status"]
                self.metrics.requests.inc(1, endpoint, str(message["status"]))
            await send(message)

        async def reply(response: Response):
            await response(scope, receive, send_counted)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and path.startswith("/v1/"):
            auth = headers.get("authorization", "")
            if not (auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].strip(), self.api_key)):
                return await reply(_error(401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
                                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await reply(_error(400, "invalid Content-Length header"))
            if int(length) > self.max_body:
                return await reply(_error(413, f"request body is larger than {self.max_body} bytes",
                                          code="request_too_large"))
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send_counted)
        except _BodyTooLarge:
            if "status" not in status_seen:
                await reply(_error(413, f"request body is larger than {self.max_body} bytes",
                                   code="request_too_large"))
        except Exception:
            log.exception("unexpected error on %s", path)
            if "status" in status_seen:
                raise
            await reply(_error(500, "internal server error", type="server_error"))


class _BodyTooLarge(Exception):
    pass


# pydantic names the branch of a union field in the error's location ("stop.constrained-str",
# "prompt.list[constrained-int]"): not a path a client can act on
_BRANCH_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "function"}
# what a union field takes, said once instead of one complaint per branch
UNION_FIELDS = {
    "stop": "a string of 1-256 characters or a list of at most 4 such strings",
    "prompt": "a non-empty string or a non-empty list of token ids (one prompt per request: send a batch as "
              "separate requests, the server batches them)",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    "content": "a string or a list of content parts",
}


def _is_branch(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or "-" in part or part in _BRANCH_NAMES)


def validation_message(errs: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic errors: the errors of the first failing field, the most specific one
    first (a constraint before a wrong type, a deeper location before a shallower), union branch names
    dropped from the path; a wrong type for a union field says what the field takes."""
    if not errs:
        return "invalid request", None

    def path(err):
        return [str(x) for x in err.get("loc", ()) if x != "body" and not _is_branch(x)]

    top = path(errs[0])[:1]
    same = [err for err in errs if path(err)[:1] == top]
    best = min(same, key=lambda err: (str(err.get("type", "")).endswith("_type"), -len(path(err))))
    loc = path(best)
    where = ".".join(loc) or None
    field = loc[-1] if loc and not loc[-1].isdigit() else (loc[-2] if len(loc) > 1 else None)
    branched = any(_is_branch(x) for err in same for x in err.get("loc", ()))
    if branched and field in UNION_FIELDS and all(str(err.get("type", "")).endswith("_type") for err in same):
        loc = path(same[0])
        where = ".".join(loc) or None
        return f"{where}: expected {UNION_FIELDS[field]}", where
    msg = str(best.get("msg", "invalid request")).removeprefix("Value error, ")
    return (f"{where}: {msg}" if where else msg), where


def create_app(serving: OpenAIServing, metrics: Metrics, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="blockpress", version="0.1.0",
                  description="OpenAI-compatible API for block-diffusion language models (DiffusionGemma).")
    static = resources.files("blockpress.server") / "static"

    # ---------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        errs = list(e.errors())
        if errs and errs[0].get("type") == "json_invalid":
            return _error(400, "request body is not valid JSON", code="invalid_json")
        message, where = validation_message(errs)
        return _error(400, message, param=where, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        message = e.detail if isinstance(e.detail, str) else "request failed"
        return _error(e.status_code, message, code="not_found" if e.status_code == 404 else None,
                      headers=getattr(e, "headers", None))

    @app.exception_handler(RecursionError)
    async def _deep(request: Request, e: RecursionError):
        return _error(400, "request JSON is nested too deeply", code="invalid_json")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return _error(500, "internal server error", type="server_error")

    # ---------------------------------------------------------------- routes
    def _respond(result: Any):
        if hasattr(result, "__aiter__"):
            return StreamingResponse(result, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(result.model_dump())

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index():
        return HTMLResponse((static / "index.html").read_text(encoding="utf-8"))

    @app.get("/health")
    async def health() -> dict:
        s = serving.worker
        return {"status": "ok", "model": serving.model_name, "active": s.active, "queue_depth": s.queue_depth}

    @app.get("/metrics", response_class=Response)
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models():
        return serving.models()

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return _respond(await serving.chat(req, request.is_disconnected))

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def completions(req: CompletionRequest, request: Request):
        return _respond(await serving.completion(req, request.is_disconnected))

    def openapi() -> dict:
        """FastAPI's schema plus this server's limits, so the schema says what the server accepts."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            lim = serving.limits
            caps = {"max_tokens": lim.max_tokens, "max_completion_tokens": lim.max_tokens,
                    "steps": lim.max_steps, "max_denoising_steps": lim.max_steps}
            for name in ("ChatCompletionRequest", "CompletionRequest"):
                props = schema["components"]["schemas"][name]["properties"]
                for field, cap in caps.items():
                    for alt in props.get(field, {}).get("anyOf", []):
                        if alt.get("type") == "integer":
                            alt["maximum"] = cap
                if "messages" in props:
                    props["messages"]["maxItems"] = lim.max_messages
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    app.mount("/static", StaticFiles(directory=str(static)), name="static")
    app.add_middleware(Guard, metrics=metrics, max_body_bytes=serving.limits.max_body_bytes, api_key=api_key)
    return app

