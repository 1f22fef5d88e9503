"""Bearer-token authentication for the project's control-plane gRPC APIs.

Servers take :func:`server_interceptor` (returns UNAUTHENTICATED for a missing or wrong token
and counts it); clients take :func:`client_interceptors` (adds ``authorization: Bearer ...``).
The token comes from a file (a mounted Kubernetes Secret) or ``LLMD_TIMESLICE_TOKEN``. With no
token configured, authentication is off and the component logs a warning at start-up.
"""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path

import grpc
from grpc import aio
from prometheus_client import Counter

log = logging.getLogger(__name__)

TOKEN_ENV = "LLMD_TIMESLICE_TOKEN"
TOKEN_FILE_ENV = "LLMD_TIMESLICE_TOKEN_FILE"

UNAUTHENTICATED_CALLS = Counter(
    "llmd_timeslice_unauthenticated_calls_total",
    "Control-plane calls refused for a missing or wrong bearer token.",
    ["method"],
)


def load_token(token_file: str | os.PathLike | None = None) -> str | None:
    """Token from ``token_file``, else ``$LLMD_TIMESLICE_TOKEN_FILE``, else ``$LLMD_TIMESLICE_TOKEN``.

    Raises:
        FileNotFoundError: the named token file does not exist.
        ValueError: the token file is empty.
    """
    path = token_file or os.environ.get(TOKEN_FILE_ENV)
    if path:
        token = Path(path).read_text().strip()
        if not token:
            raise ValueError(f"token file {path} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


class _BearerTokenInterceptor(aio.ServerInterceptor):
    def __init__(self, token: str, open_methods: frozenset[str]) -> None:
        self._expected = f"Bearer {token}".encode()
        self._open = open_methods

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method in self._open:
            return await continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(got, self._expected):
                    return await continuation(handler_call_details)
                break
        UNAUTHENTICATED_CALLS.labels(method=method).inc()
        return _deny_handler(method)


def _deny_handler(method: str) -> grpc.RpcMethodHandler:
    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong bearer token for {method}")

    # Streaming or unary, aborting before reading works for every shape.
    return grpc.unary_unary_rpc_method_handler(deny)


def server_interceptors(token: str | None, open_methods: tuple[str, ...] = ()) -> list[aio.ServerInterceptor]:
    """Interceptors for a control-plane server; empty (auth off, warned) when ``token`` is None."""
    if not token:
        log.warning("control API authentication is OFF: no token configured (set %s or --token-file)", TOKEN_FILE_ENV)
        return []
    open_methods = (*open_methods, "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")
    return [_BearerTokenInterceptor(token, frozenset(open_methods))]


class _AddToken(
    aio.UnaryUnaryClientInterceptor,
    aio.UnaryStreamClientInterceptor,
    aio.StreamUnaryClientInterceptor,
    aio.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self._md = ("authorization", f"Bearer {token}")

    def _details(self, d):
        md = [*list(d.metadata or ()), self._md]
        return d._replace(metadata=md) if hasattr(d, "_replace") else aio.ClientCallDetails(
            d.method, d.timeout, md, d.credentials, d.wait_for_ready
        )

    async def intercept_unary_unary(self, continuation, d, request):
        return await continuation(self._details(d), request)

    async def intercept_unary_stream(self, continuation, d, request):
        return await continuation(self._details(d), request)

    async def intercept_stream_unary(self, continuation, d, request_iterator):
        return await continuation(self._details(d), request_iterator)

    async def intercept_stream_stream(self, continuation, d, request_iterator):
        return await continuation(self._details(d), request_iterator)


def client_interceptors(token: str | None) -> list:
    """Interceptors for a ``grpc.aio`` channel that add the bearer token (none when ``token`` is None)."""
    return [_AddToken(token)] if token else []


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata to pass on each call of a synchronous ``grpc`` stub."""
    return (("authorization", f"Bearer {token}"),) if token else ()
