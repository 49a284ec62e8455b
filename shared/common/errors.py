"""Typed errors raised at the boundaries; one place (`tandem.serving.rpc`) maps them to gRPC status codes and
back, so a worker's error reaches its caller as the same type (no matching on message strings)."""

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
    """A KV transport cannot be used between two workers."""


class UnknownPoolError(KVTransportError):
    """cuda-ipc: the prefill worker has not mapped this pool (yet, or any more): send its handle."""


class PoolOpenError(KVTransportError):
    """cuda-ipc: the prefill worker cannot map the pool (another GPU, no shared IPC namespace, a bad handle):
    this pair must use the grpc transport."""


class KVIntegrityError(KVTransportError):
    """KV pages arrived damaged (a checksum or size mismatch): they are never written into the pool."""


def error_type(name: str) -> type[TandemError] | None:
    """The TandemError subclass called `name` (how a typed error crosses a gRPC hop), or None."""
    todo: list[type[TandemError]] = [TandemError]
    while todo:
        cls = todo.pop()
        if cls.__name__ == name:
            return cls
        todo += cls.__subclasses__()
    return None
