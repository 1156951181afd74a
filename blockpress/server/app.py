"""Thin FastAPI routes over `OpenAIServing`: translate HTTP to calls and results to responses.

Invariants:
- Every error leaves as an OpenAI-style body {"error": {"message", "type", "param", "code"}}:
  validation problems and invalid JSON -> 400, a Host header not allowed -> 400, unknown routes ->
  404, wrong method -> 405, a body not sent within `Limits.body_timeout` -> 408, bodies over the
  limit (declared or chunked) -> 413, full queue -> 429, anything unexpected -> 500 with a generic
  message (the traceback goes to the server log, never to the client).
- With an API key, every /v1 route needs `Authorization: Bearer KEY` (401 otherwise, also for a key
  that is not ASCII); `/`, `/health` and `/metrics` stay open.
- Host check (against DNS rebinding): `allowed_hosts` (serve bound to loopback allows only loopback
  names by default). CORS: opt-in `allowed_origins`. Every response is counted, 5xx included, and a
  reply whose client hung up before it was complete as 499 (nginx's "client closed request"), never as a 200
  (middleware.py: the order and what each layer does).
- `/openapi.json` is the contract: true JSON Schema, streaming bodies documented as
  `text/event-stream`, and only the status codes the server answers.
"""

from __future__ import annotations

import logging
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import CONTENT_TYPE, Metrics
from .middleware import Counted, Guard, HostCheck, _error
from .protocol import (APIError, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, CompletionChunk,
                       CompletionRequest, CompletionResponse, ErrorResponse, ModelCard, ModelList)
from .responses import ResponsesServing
from .responses_protocol import ResponseObject, ResponsesRequest, ResponseStreamEvent
from .serving import ClientGone, OpenAIServing, Stream

log = logging.getLogger("blockpress.server")
ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 500, 503)}


# pydantic names the branch of a union field in the error's location ("stop.constrained-str",
# "prompt.list[constrained-int]"): not a path a client can act on
_BRANCH_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}
# what a union field takes, said once instead of one complaint per branch
UNION_FIELDS = {
    "stop": "a string of 1-256 characters or a list of at most 4 such strings",
    "prompt": "a non-empty string, a non-empty list of token ids, or a non-empty list of either (a batch)",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    "content": "a string or a list of content parts",
}


def _is_branch(part: Any) -> bool:
    # a union's branches are named by type ("list[...]", "constrained-str") or by model class ("InputMessage")
    return isinstance(part, str) and ("[" in part or "-" in part or part in _BRANCH_NAMES
                                      or (part[:1].isupper() and part.isidentifier()))


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


def create_app(serving: OpenAIServing, metrics: Metrics, api_key: str | None = None,
               allowed_hosts: list[str] | None = None, allowed_origins: list[str] | None = None) -> FastAPI:
    """allowed_hosts: Host header names served (None: any); allowed_origins: browser origins allowed by CORS
    (None: none, same-origin only; ["*"]: any)."""
    app = FastAPI(title="blockpress", version="0.1.0",
                  description="OpenAI-compatible API for block-diffusion language models (DiffusionGemma).")
    static = resources.files("blockpress.server") / "static"

    # ---------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        errs = list(e.errors())
        if errs and errs[0].get("type") == "json_invalid":
            return _error(400, "request body is not valid JSON", code="invalid_json")
        if errs and errs[0].get("type") == "missing" and tuple(errs[0].get("loc", ())) == ("body",):
            return _error(400, "request body is empty; send the request as a JSON object", code="invalid_json")
        message, where = validation_message(errs)
        return _error(400, message, param=where, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        message = e.detail if isinstance(e.detail, str) else "request failed"
        code = getattr(e, "code", None) or ("not_found" if e.status_code == 404 else None)
        if e.status_code == 400 and message == "There was an error parsing the body":  # FastAPI's, for a body that
            # is not UTF-8, or JSON Python's parser refuses (nested too deep, an integer of 5,000 digits)
            message, code = "request body is not JSON this server reads: send UTF-8 JSON, nested less than 1000 " \
                            "deep, with integers of at most 4300 digits", "invalid_json"
        return _error(e.status_code, message, code=code, headers=getattr(e, "headers", None))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone):  # nobody reads it: the metrics count it as 499
        return Response(status_code=499)

    @app.exception_handler(RecursionError)
    async def _deep(request: Request, e: RecursionError):
        return _error(400, "request JSON is nested too deeply", code="invalid_json")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return _error(500, "internal server error", type="server_error")

    # ---------------------------------------------------------------- routes
    def _respond(result: Any):
        if isinstance(result, Stream):  # (its runs freed however the response ends: `Stream.release`)
            return StreamingResponse(result, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(result.release))
        return JSONResponse(result.model_dump())

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index():
        return HTMLResponse((static / "index.html").read_text(encoding="utf-8"))

    @app.get("/health", responses={503: {"description": "the last generation failed (`error` says why)"}})
    async def health() -> dict:
        s = serving.worker
        body = {"status": "ok", "model": serving.model_name, "active": s.active, "queue_depth": s.queue_depth}
        if serving.engine_error is not None:
            return JSONResponse({**body, "status": "error", "error": serving.engine_error}, status_code=503)
        return body

    @app.get("/metrics", response_class=Response)
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models():
        return serving.models()

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=ERRORS)  # (Hub ids hold a "/")
    async def model(model: str):
        return serving.model(model)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=streamed(ChatCompletionChunk))
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return _respond(await serving.chat(req, request.is_disconnected))

    @app.post("/v1/completions", response_model=CompletionResponse, responses=streamed(CompletionChunk))
    async def completions(req: CompletionRequest, request: Request):
        return _respond(await serving.completion(req, request.is_disconnected))

    responses = ResponsesServing(serving)

    @app.post("/v1/responses", response_model=ResponseObject, responses=streamed(ResponseStreamEvent))
    async def create_response(req: ResponsesRequest, request: Request):
        return _respond(await responses.create(req, request.is_disconnected))

    def openapi() -> dict:
        """FastAPI's schema plus this server's limits, so the schema says what the server accepts, without
        the 422 FastAPI documents for every body (validation errors are 400s here)."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for item in schema["paths"].values():
                for op in item.values():
                    op.get("responses", {}).pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schema["components"]["schemas"].pop(unused, None)
            for model in STREAMED:  # the events' schemas, which the streamed responses refer to
                event = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
                for name, sub in {**event.pop("$defs", {}), model.__name__: event}.items():
                    schema["components"]["schemas"].setdefault(name, sub)
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
    # add_middleware wraps: the last added is the outermost
    app.add_middleware(Guard, max_body_bytes=serving.limits.max_body_bytes, api_key=api_key,
                       body_timeout=serving.limits.body_timeout)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["*"])
    if allowed_hosts is not None and "*" not in allowed_hosts:
        app.add_middleware(HostCheck, allowed_hosts=allowed_hosts)
    app.add_middleware(Counted, metrics=metrics)
    return app


STREAMED = (ChatCompletionChunk, CompletionChunk, ResponseStreamEvent)


def streamed(event) -> dict:
    """The responses of a generation route: its JSON body, or with `stream: true` server-sent events, each
    described by `schema` (OpenAPI 3.1's reading of an event stream): `data` is an `event` model as JSON, an
    error body, or `[DONE]` (chat and completions end with it; /v1/responses names each event's type in `event`)."""
    ref = {"$ref": f"#/components/schemas/{event.__name__}"}
    data = {"type": "string", "anyOf": [{"const": "[DONE]"}, {
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [ref, {"$ref": "#/components/schemas/ErrorResponse"}]}}]}
    sse = {"type": "object", "required": ["data"], "properties": {"data": data, "event": {"type": "string"}}}
    return {**ERRORS, 200: {"description": f"the result; with `stream: true` server-sent events of {event.__name__}",
                            "content": {"text/event-stream": {"schema": sse}}}}

