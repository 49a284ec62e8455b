"""The HTTP API's first stops (pure ASGI, in front of the FastAPI app): the API key, the drain and the body limit,
checked before a request costs the gateway anything (its body read, parsed, tokenized)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from tandem.gateway.auth import UNAUTHENTICATED_MESSAGE, ApiKeys
from tandem.gateway.openai_protocol import error_body

if TYPE_CHECKING:
    from tandem.gateway.router import Router


class RequestGuard:
    """Pure ASGI, in front of the app. While the gateway drains, a request to `/v1/` gets 503 (and the
    connection is closed, so the client reconnects, to another replica if there is one). A body larger than
    `--max-request-bytes` gets 413 before it is read whole: its Content-Length is checked first, then its
    bytes as they arrive (a chunked body has no length), so no request makes the gateway hold more."""

    def __init__(self, app: Any, router: Router) -> None:
        self.app = app
        self.router = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.router.draining and scope["path"].startswith("/v1/"):
            body = error_body("the gateway is draining (shutting down); retry on another replica", "server_error",
                              None, "service_unavailable")
            await JSONResponse(body, status_code=503, headers={"Connection": "close"})(scope, receive, send)
            return
        limit = self.router.limits.max_request_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _too_large(f"the body is {declared} bytes", limit)(scope, receive, send)
            return
        chunks: list[bytes] = []
        num_bytes = 0
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body arrived: nobody to answer
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > limit:
                await _too_large(f"the body is more than {limit} bytes", limit)(scope, receive, send)
                return
            chunks.append(chunk)
            more_body = message.get("more_body", False)
        body_message: dict[str, Any] | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Any:
            # The body once, as read; then the client's own messages (a disconnect).
            nonlocal body_message
            if body_message is not None:
                message, body_message = body_message, None
                return message
            return await receive()

        await self.app(scope, replay, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _too_large(what: str, limit: int) -> Response:
    message = f"{what}; at most {limit} bytes are accepted (--max-request-bytes)"
    return JSONResponse(error_body(message, "invalid_request_error", None, "request_too_large"), status_code=413,
                        headers={"Connection": "close"})


class RequireApiKey:
    """Pure ASGI (not BaseHTTPMiddleware, which would sit between a stream and its disconnect): a `/v1/`
    request without an accepted key gets 401 in OpenAI's error shape before it reaches the app."""

    def __init__(self, app: Any, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"]]
            if not self.keys.check(headers):
                body = error_body(UNAUTHENTICATED_MESSAGE, "invalid_request_error", None, "invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
