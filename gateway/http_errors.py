"""The HTTP API's errors, in OpenAI's body shape: typed errors and pydantic's complaints to status codes, and each
field named as the client named it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tandem.common.errors import InvalidRequestError, OverloadedError, TandemError, UnavailableError
from tandem.gateway.openai_protocol import error_body

log = logging.getLogger(__name__)


@contextlib.contextmanager
def openai_params(renames: dict[str, str]) -> Iterator[None]:
    """Re-raise an InvalidRequestError under the field name this request used."""
    try:
        yield
    except InvalidRequestError as error:
        name = renames.get(error.field, error.field)
        if name == error.field:
            raise
        raise InvalidRequestError(name, error.message) from None


def _param(loc: Sequence[int | str], is_unknown: bool = False) -> str | None:
    """A pydantic error location as OpenAI's `param` ("messages.0.content"): without the body, and without what
    follows a union member's tag ("str", "list[int]"), which names a type, not a field (unless it is the name of
    an unknown field the client sent)."""
    parts = []
    loc = loc[1:] if loc[:1] == ("body",) else loc
    for i, part in enumerate(loc):
        is_key = is_unknown and i == len(loc) - 1
        if isinstance(part, str) and ("[" in part or part in _TYPE_TAGS) and not is_key:
            break
        # A key the client sent may be anything, a lone surrogate included: escaped, so the answer encodes.
        parts.append(str(part).encode("utf-8", "backslashreplace").decode("utf-8"))
    return ".".join(parts) or None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})


def error_response(error: TandemError) -> tuple[int, dict[str, Any]]:
    if isinstance(error, InvalidRequestError):
        if error.field == "model":
            return 404, error_body(error.message, "invalid_request_error", "model", "model_not_found")
        return 400, error_body(str(error), "invalid_request_error", error.field)
    if isinstance(error, OverloadedError):
        return 429, error_body(str(error), "rate_limit_error", None, "rate_limit_exceeded")
    if isinstance(error, UnavailableError):
        return 503, error_body(str(error), "server_error", None, "service_unavailable")
    log.error("unmapped %s: %s", type(error).__name__, error)
    return 500, error_body(str(error), "server_error")


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TandemError)
    async def tandem_error(request: Request, error: TandemError) -> Response:
        status, body = error_response(error)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> Response:
        # Pydantic's first complaint, with its location as OpenAI's `param` ("messages.0.role").
        first = error.errors()[0]
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return JSONResponse(error_body(f"the body is not valid JSON: {detail}", "invalid_request_error"),
                                status_code=400)
        is_unknown = first.get("type") == "extra_forbidden"
        param = _param(first.get("loc", ()), is_unknown)
        if is_unknown:
            message = f"{param or repr('')}: unsupported parameter"
        else:
            msg = first.get("msg", "")
            if msg.startswith("Value error, "):  # pydantic's prefix for a validator's own message
                msg = msg[len("Value error, "):]
            message = f"{param}: {msg}" if param else msg
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        return JSONResponse(error_body(str(error.detail), "invalid_request_error"), status_code=error.status_code,
                            headers=error.headers)
