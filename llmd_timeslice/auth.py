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


class TokenFileError(OSError):
    """A token file that cannot be read; ``str()`` is one line naming the flag or setting it came from and the path."""

    def __init__(self, setting: str, path: str | os.PathLike, exc: OSError) -> None:
        super().__init__(exc.errno, exc.strerror or str(exc))
        self.filename = str(path)
        self.setting = setting

    def __str__(self) -> str:
        return f"{self.setting} {self.filename}: cannot read the control-plane token file: {self.strerror}"


class TokenFileMissing(TokenFileError, FileNotFoundError):
    """The token file does not exist."""


class TokenFileNotText(TokenFileError):
    """The token file is not UTF-8 text."""


def load_token(token_file: str | os.PathLike | None = None, setting: str = "--token-file") -> str | None:
    """Token from ``token_file``, else ``$LLMD_TIMESLICE_TOKEN_FILE``, else ``$LLMD_TIMESLICE_TOKEN``.

    ``setting`` names where ``token_file`` came from (a flag, ``FILE: section.token_file``, a variable), for the
    errors; a path taken from ``$LLMD_TIMESLICE_TOKEN_FILE`` here is named so.

    Raises:
        TokenFileMissing: the token file does not exist (a ``FileNotFoundError``).
        TokenFileError: it cannot be read otherwise (an ``OSError``: permission, a directory...);
            :class:`TokenFileNotText` when it is not UTF-8 text.
        ValueError: the token file is empty.
    """
    path = token_file
    if not path and os.environ.get(TOKEN_FILE_ENV):
        path, setting = os.environ[TOKEN_FILE_ENV], f"${TOKEN_FILE_ENV}"
    if path:
        try:
            token = Path(path).read_text().strip()
        except FileNotFoundError as exc:
            raise TokenFileMissing(setting, path, exc) from None
        except OSError as exc:
            raise TokenFileError(setting, path, exc) from None
        except UnicodeDecodeError as exc:
            raise TokenFileNotText(setting, path, OSError(0, str(exc))) from None
        if not token:
            raise ValueError(f"{setting} {path}: the control-plane token file is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def load_job_tokens(path: str | os.PathLike) -> dict[str, str]:
    """Per-job tokens from a YAML/JSON mapping ``{job_id: token}`` (a mounted Secret).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a mapping of non-empty strings, or a token used by two jobs.
    """
    import yaml

    from llmd_timeslice import yaml_files

    try:
        data = yaml_files.load(Path(path).read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: {yaml_files.error_text(exc)}") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v.strip() for k, v in data.items()
    ):
        raise ValueError(f"{path}: expected a mapping of job id -> non-empty token")
    tokens = {k: v.strip() for k, v in data.items()}
    if len(set(tokens.values())) != len(tokens):
        raise ValueError(f"{path}: two jobs share a token; each job needs its own")
    return tokens


def bearer(context) -> str | None:
    """The bearer token of a call (None if absent)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            v = value.decode() if isinstance(value, bytes) else value
            return v[7:] if v.startswith("Bearer ") else None
    return None


class JobAuthorizer:
    """Who may act for a job on job-scoped calls (Acquire, Yield, GetLease, Heartbeat, PublishWeightVersion).

    With ``job_tokens``, a call carrying job B's token may act only for job B (PERMISSION_DENIED otherwise):
    one job cannot yield or renew another's lease. The control token may act for any job unless
    ``require_job_tokens`` (then jobs listed in ``job_tokens`` need their own token). Without job tokens
    every caller with the control token may act for any job (one trust domain).
    """

    def __init__(self, job_tokens: dict[str, str] | None = None, require_job_tokens: bool = False) -> None:
        self.job_tokens = dict(job_tokens or {})
        self._owner = {t: j for j, t in self.job_tokens.items()}
        self.require = require_job_tokens

    def job_of(self, context) -> str | None:
        """The job whose own token the call carries (None: the control token, or no job tokens configured)."""
        if not self.job_tokens:
            return None
        return self._owner.get(bearer(context) or "")

    def check(self, context, job_id: str) -> str | None:
        """None when the caller may act for ``job_id``; else the reason to refuse (PERMISSION_DENIED)."""
        if not self.job_tokens:
            return None
        token = bearer(context)
        owner = self._owner.get(token or "")
        if owner is not None:
            if owner == job_id:
                return None
            PERMISSION_DENIED_CALLS.labels(reason="other_job").inc()
            return f"the token of job {owner!r} cannot act for job {job_id!r}"
        if self.require and job_id in self.job_tokens:
            PERMISSION_DENIED_CALLS.labels(reason="job_token_required").inc()
            return f"job {job_id!r} must call with its own job token (require_job_tokens)"
        return None


PERMISSION_DENIED_CALLS = Counter(
    "llmd_timeslice_permission_denied_calls_total",
    "Job-scoped calls refused: a job's token used for another job, or a job token required.",
    ["reason"],
)


class _BearerTokenInterceptor(aio.ServerInterceptor):
    def __init__(self, token: str, open_methods: frozenset[str], extra_tokens: tuple[str, ...] = ()) -> None:
        self._expected = f"Bearer {token}".encode()
        self._extra = tuple(f"Bearer {t}".encode() for t in extra_tokens)
        self._open = open_methods

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method in self._open:
            return await continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                ok = hmac.compare_digest(got, self._expected)
                for extra in self._extra:  # every comparison runs: no timing hint of which token matched
                    ok |= hmac.compare_digest(got, extra)
                if ok:
                    return await continuation(handler_call_details)
                break
        UNAUTHENTICATED_CALLS.labels(method=method).inc()
        handler = await continuation(handler_call_details)
        return _deny_handler(method, handler)


def _deny_handler(method: str, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler that ends the call UNAUTHENTICATED, of the shape of the method's own ``handler`` (a unary-request
    handler reads the request first: a streaming client that waits for the server's answer before it sends would
    wait for ever)."""

    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong bearer token for {method}")

    # Aborting before reading works for every shape; the server reads a unary request before it runs the handler.
    streaming_in = handler is not None and handler.request_streaming
    streaming_out = handler is not None and handler.response_streaming
    if streaming_in and streaming_out:
        return grpc.stream_stream_rpc_method_handler(deny)
    if streaming_in:
        return grpc.stream_unary_rpc_method_handler(deny)
    if streaming_out:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


def server_interceptors(
    token: str | None, open_methods: tuple[str, ...] = (), extra_tokens: tuple[str, ...] = ()
) -> list[aio.ServerInterceptor]:
    """Interceptors for a control-plane server; empty (auth off, warned) when ``token`` is None.
    ``extra_tokens`` (e.g. per-job tokens) are accepted too; what each may do is checked by the service."""
    if not token:
        log.warning("control API authentication is OFF: no token configured (set %s or --token-file)", TOKEN_FILE_ENV)
        return []
    open_methods = (*open_methods, "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")
    return [_BearerTokenInterceptor(token, frozenset(open_methods), tuple(extra_tokens))]


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
        return (
            d._replace(metadata=md)
            if hasattr(d, "_replace")
            else aio.ClientCallDetails(d.method, d.timeout, md, d.credentials, d.wait_for_ready)
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
