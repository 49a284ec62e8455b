"""Service-to-service authentication: a token shared by the processes of one stack.

Every call a service makes to a prefill or decode worker carries the stack's internal token in the metadata
key `tandem-internal-token`; a worker configured with a token ends any other call `UNAUTHENTICATED`
(`InternalTokenInterceptor`; health checking and reflection stay open, for probes). The token comes from
`$TANDEM_INTERNAL_TOKEN` or from a file (`--internal-token-file`, `$TANDEM_INTERNAL_TOKEN_FILE`); `tandem up`
draws one per run and hands it to its children in their environment, compose writes one into its shared volume.

The clients' side is `TokenChannel`: a channel whose every call adds the token to its metadata. Not a gRPC
client interceptor: grpc.aio routes every message written to an intercepted stream through a queue and two
tasks, a cost per token on the gateway's sessions. Not call credentials either: gRPC sends those only over TLS
(or local connections), and the token must work over plaintext too.

A worker that listens beyond loopback with neither a token nor mutual TLS refuses to start unless it is told
`--insecure` (`require_auth_beyond_loopback`).
"""

from __future__ import annotations

import hmac
import inspect
import ipaddress
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

from tandem.common.config import ConfigError

log = logging.getLogger(__name__)

INTERNAL_TOKEN_ENV = "TANDEM_INTERNAL_TOKEN"
INTERNAL_TOKEN_FILE_ENV = "TANDEM_INTERNAL_TOKEN_FILE"
METADATA_KEY = "tandem-internal-token"
MIN_TOKEN_CHARS = 16
# Open without the token: probes (`tandem healthcheck`, the gateway's health checks, load balancers) and discovery.
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
UNAUTHENTICATED_MESSAGE = (f"missing or invalid internal token: this port serves tandem's own services (give the "
                           f"caller the stack's token: ${INTERNAL_TOKEN_ENV} or --internal-token-file)")


def generate_token() -> str:
    """A fresh random token: 32 bytes as 64 hex characters (as `openssl rand -hex 32`)."""
    return secrets.token_hex(32)


def validate_token(token: str, source: str) -> str:
    """`token` with surrounding whitespace dropped; ConfigError (naming `source`, never the token) unless it is
    at least MIN_TOKEN_CHARS printable ASCII characters (it travels as a gRPC metadata value)."""
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"internal token ({source}): at least {MIN_TOKEN_CHARS} characters are needed, got "
                          f"{len(token)} (generate one: `openssl rand -hex 32` or `tandem internal-token`)")
    if not all("!" <= c <= "~" for c in token):
        raise ConfigError(f"internal token ({source}): only printable ASCII without spaces is allowed")
    return token


def load_internal_token(file: str | Path | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The stack's internal token, or None (no token configured): from `file` (else `$TANDEM_INTERNAL_TOKEN_FILE`)
    or from `$TANDEM_INTERNAL_TOKEN`; giving both is an error (which one would the other services have?)."""
    environ: Mapping[str, str] = os.environ if env is None else env
    path = file or environ.get(INTERNAL_TOKEN_FILE_ENV) or None
    value = environ.get(INTERNAL_TOKEN_ENV) or None
    if path and value:
        raise ConfigError(f"internal token: both ${INTERNAL_TOKEN_ENV} and a token file ({path}) are set; give one")
    if value:
        return validate_token(value, f"${INTERNAL_TOKEN_ENV}")
    if path:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"internal token file {path}: cannot read it ({error})") from None
        return validate_token(text, f"file {path}")
    return None


def write_token_file(path: str | Path, token: str) -> None:
    """Writes `token` to `path`, readable by its owner only (0600), replacing any file there atomically."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(token + "\n")
        os.chmod(temporary, 0o600)  # whatever the umask
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a port on this machine: `localhost` or a loopback address. Any other name
    (it might resolve anywhere), a wildcard (0.0.0.0, ::, empty) or another address is beyond loopback."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_auth_beyond_loopback(role: str, host: str, token: str | None, mutual_tls: bool, insecure: bool) -> None:
    """ConfigError for a worker that would serve beyond loopback to anyone who reaches its port."""
    if token or mutual_tls or insecure or is_loopback(host):
        return
    raise ConfigError(
        f"a {role} worker listening on {host or 'every interface'} (beyond loopback) needs service-to-service "
        f"authentication: give every service of the stack the same internal token (`export {INTERNAL_TOKEN_ENV}="
        f"$(openssl rand -hex 32)`, or --internal-token-file PATH), or mutual TLS (--tls-cert, --tls-key, --tls-ca); "
        f"or pass --insecure to serve without it (then any caller that reaches the port can use this worker)")


# -- the server side ---------------------------------------------------------------------------------------------
class InternalTokenInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call that does not carry the internal token with UNAUTHENTICATED, before its handler runs
    (health checking and reflection stay open). The token is compared in constant time and never logged."""

    _LOG_EVERY_S = 10.0

    def __init__(self, token: str) -> None:
        self._token = validate_token(token, "server").encode()
        self._rejected = 0
        self._logged_at = float("-inf")

    def accepts(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == METADATA_KEY:
                presented = value if isinstance(value, bytes) else value.encode()
                return hmac.compare_digest(presented, self._token)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""  # type: ignore[attr-defined]
        if handler is None or method.startswith(OPEN_METHODS):
            return handler
        if self.accepts(handler_call_details.invocation_metadata):  # type: ignore[attr-defined]
            return handler
        self._rejected += 1
        now = time.monotonic()
        if now - self._logged_at >= self._LOG_EVERY_S:  # a scanner must not flood the log
            log.warning("refused %s without the internal token (%d refused so far)", method, self._rejected)
            self._logged_at = now
        return unauthenticated_handler(handler, UNAUTHENTICATED_MESSAGE)


def unauthenticated_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED at once."""

    async def reject(context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    behavior: Callable[..., Any]
    if handler.response_streaming:
        async def reject_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await reject(context)
            yield  # pragma: no cover  (abort raises)

        behavior = reject_stream
    else:
        async def reject_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await reject(context)

        behavior = reject_unary
    factory = {(False, False): grpc.unary_unary_rpc_method_handler,
               (False, True): grpc.unary_stream_rpc_method_handler,
               (True, False): grpc.stream_unary_rpc_method_handler,
               (True, True): grpc.stream_stream_rpc_method_handler}[(handler.request_streaming,
                                                                     handler.response_streaming)]
    assert inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)
    return factory(behavior, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)


# -- the client side ---------------------------------------------------------------------------------------------
class _WithMetadata:
    """A multi-callable whose every call carries `pairs` ahead of the caller's own metadata."""

    __slots__ = ("_call", "_pairs")

    def __init__(self, call: Any, pairs: tuple[tuple[str, str], ...]) -> None:
        self._call = call
        self._pairs = pairs

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        return self._call(*args, metadata=self._pairs + tuple(metadata) if metadata else self._pairs, **kwargs)


class TokenChannel(grpc.aio.Channel):
    """A grpc.aio channel whose every call carries the internal token (the stubs' calls, health checks alike)."""

    def __init__(self, channel: grpc.aio.Channel, token: str) -> None:
        self._channel = channel
        self._pairs = ((METADATA_KEY, validate_token(token, "client")),)

    async def __aenter__(self) -> TokenChannel:
        return self

    async def __aexit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        await self._channel.close(None)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _WithMetadata(self._channel.unary_unary(*args, **kwargs), self._pairs)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _WithMetadata(self._channel.unary_stream(*args, **kwargs), self._pairs)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _WithMetadata(self._channel.stream_unary(*args, **kwargs), self._pairs)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _WithMetadata(self._channel.stream_stream(*args, **kwargs), self._pairs)
