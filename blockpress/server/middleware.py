"""The server's ASGI middleware (pure ASGI, no FastAPI): counting, host check, API key, body limits.

Order, outermost first (`app.create_app` installs them): `Counted` (counts every response, 5xx
included, in `blockpress_requests_total{endpoint,status}`, unknown paths -> "other"; turns anything
unexpected, here or inside, into a counted 500) -> `HostCheck` (starlette's TrustedHostMiddleware
matching, against DNS rebinding) -> CORS (starlette's, opt-in) -> `Guard` (API key, body size,
body time) -> routes. CORS sits outside the key check so that a browser's preflight is answered.

Invariants: every POST body is read as JSON, whatever Content-Type the client sent (`curl -d` sends
application/x-www-form-urlencoded; the API takes nothing else); every refusal is an OpenAI-style error
body that names the fix; the key is compared as
bytes, so a client's non-ASCII key is a 401, never a 500; a body stream that passes the size limit
(declared or chunked) is 413, one not in within `body_timeout` seconds (all of it, however it trickles in) is
408; the wait for a client's disconnect after its body has no deadline. HEAD on the open GET routes (`/`,
`/health`, `/metrics`: what uptime checkers send) is their GET's status and headers.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from fastapi import HTTPException
from fastapi.middleware.trustedhost import TrustedHostMiddleware
from fastapi.responses import JSONResponse

from .metrics import Metrics
from .protocol import error_body

log = logging.getLogger("blockpress.server")
ENDPOINTS = {"/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses",
             "/openapi.json", "/docs"}
LOOPBACK_HOSTS = ["localhost", "127.0.0.1", "::1", "[::1]"]
HEAD_ROUTES = {"/", "/health", "/metrics"}  # GET routes a HEAD is answered on


def _error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def _endpoint(path: str) -> str:
    """The metrics label of a path: known endpoints as they are, static files as one, the rest "other"."""
    if path.startswith("/static/"):
        return "/static"
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return path if path in ENDPOINTS else "other"


class Counted:
    """Pure ASGI middleware, the outermost: counts every response by endpoint and status, and turns an
    exception from anything inside (middleware included) into a counted 500 with a generic message."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint, started = _endpoint(scope["path"]), False

        async def send_counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.requests.inc(1, endpoint, str(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:
            log.exception("unexpected error on %s", scope["path"])
            if started:
                raise
            await _error(500, "internal server error", type="server_error")(scope, receive, send_counted)


class HostCheck:
    """starlette's TrustedHostMiddleware (the matching), answering a refused Host with an OpenAI-style 400
    that names the fix instead of its plain-text one."""

    def __init__(self, app, allowed_hosts: list[str]):
        self.app, self.allowed_hosts = app, allowed_hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        passed = False

        async def inner(scope, receive, _send):
            nonlocal passed
            passed = True
            await self.app(scope, receive, send)

        async def drop(message):  # the middleware's own plain-text refusal
            pass

        await TrustedHostMiddleware(inner, allowed_hosts=self.allowed_hosts, www_redirect=False)(scope, receive, drop)
        if not passed:
            host = dict(scope.get("headers", [])).get(b"host", b"").decode("latin-1")
            await _error(400, f"the Host header {host!r} is not allowed here (this server answers to "
                              f"{', '.join(self.allowed_hosts)}); add it with --allowed-hosts",
                         code="invalid_host")(scope, receive, send)


class Guard:
    """Pure ASGI middleware, the innermost: API key, body-size limit (declared or chunked) and body time limit."""

    def __init__(self, app, max_body_bytes: int, api_key: str | None, body_timeout: float = 30.0):
        self.app, self.max_body, self.body_timeout = app, max_body_bytes, body_timeout
        self.key = api_key.encode("utf-8") if api_key else None

    def _authorized(self, auth: bytes) -> bool:
        # bytes against bytes: a key the client sends in any encoding is just a wrong key (401), never a TypeError
        # the scheme's name is case-insensitive (RFC 7235): "bearer KEY" is the same credential
        return auth[:7].lower() == b"bearer " and hmac.compare_digest(auth[7:].strip(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "HEAD" and scope["path"] in HEAD_ROUTES:
            scope, send = {**scope, "method": "GET"}, _headers_only(send)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self.key and scope["path"].startswith("/v1/") and not self._authorized(headers.get(b"authorization", b"")):
            return await _error(401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if scope["method"] == "POST" and not _json_type(headers.get(b"content-type")):
            scope = _as_json(scope)  # `curl -d '{...}'` sends a form type: every body here is JSON
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await _error(400, "invalid Content-Length header")(scope, receive, send)
            if int(length) > self.max_body:
                return await _too_large(self.max_body)(scope, receive, send)
        received, body_done, started = 0, False, False
        deadline = asyncio.get_running_loop().time() + self.body_timeout  # for the whole body, not each part

        async def limited_receive():
            nonlocal received, body_done
            if body_done:  # the body is in: what follows is the wait for a disconnect, which has no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - asyncio.get_running_loop().time(), 0))
            except asyncio.TimeoutError:
                raise _BodyTimeout(self.body_timeout) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_body:
                    raise _BodyTooLarge(self.max_body)
            return message

        async def send_seen(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, send_seen)
        except (_BodyTooLarge, _BodyTimeout) as e:  # raised outside FastAPI's body parsing (its handler answers there)
            if not started:
                await _error(e.status_code, e.detail, code=e.code)(scope, receive, send)


def _headers_only(send):
    """`send` for a HEAD answered as a GET: the status and headers, an empty body."""
    async def send_head(message):
        if message["type"] == "http.response.body":
            message = {**message, "body": b"", "more_body": False} if not message.get("more_body") else None
        if message is not None:
            await send(message)
    return send_head


def _json_type(value: bytes | None) -> bool:
    """A Content-Type FastAPI reads as JSON (application/json, application/...+json; not none at all)."""
    if value is None:
        return False
    kind = value.split(b";")[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))


def _as_json(scope: dict) -> dict:
    """The scope with its Content-Type replaced by application/json (its charset kept)."""
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
    old = dict((k.lower(), v) for k, v in scope["headers"]).get(b"content-type", b"")
    charset = [p.strip() for p in old.split(b";")[1:] if p.strip().lower().startswith(b"charset=")]
    return {**scope, "headers": headers + [(b"content-type", b"; ".join([b"application/json", *charset]))]}


def _too_large(limit: int) -> JSONResponse:
    return _error(413, f"request body is larger than {limit} bytes", code="request_too_large")


class _BodyTooLarge(HTTPException):
    """Raised from the body stream: FastAPI passes an HTTPException from there on to its handler."""

    code = "request_too_large"

    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than {limit} bytes")


class _BodyTimeout(HTTPException):
    code = "request_timeout"

    def __init__(self, seconds: float):
        super().__init__(408, f"the request body did not arrive within {seconds:g} s; send it at once")
