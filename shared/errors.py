"""Typed errors raised at the boundaries; one place (shared/rpc.py) maps them to gRPC status codes."""

from __future__ import annotations


class TandemError(Exception):
    """Base class of the errors tandem raises on purpose."""


class InvalidRequestError(TandemError, ValueError):
    """A request field is invalid. `field` names it, so the client can fix it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class OverloadedError(TandemError):
    """The service is at its concurrency or queue limit; retry later or elsewhere."""


class UnavailableError(TandemError):
    """No worker can serve the request now."""


class DeadlineExceededError(TandemError):
    """The request's deadline passed before it could be served."""


class LayoutMismatchError(TandemError):
    """Two workers' KV layouts (dtype, shapes, model fingerprint) differ: pages cannot move between them."""


class KVTransportError(TandemError):
    """A KV transport cannot be used between two workers (e.g. a cuda-ipc handle that does not open)."""
