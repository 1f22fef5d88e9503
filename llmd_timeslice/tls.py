"""Optional mutual TLS for the control-plane gRPC APIs (orchestrator, sidecar, gate control port, and the
clients of each), on top of the bearer token.

Configured from the environment, so every component and client picks it up the same way (in Kubernetes,
mount a cert-manager Secret and set the variables): ``LLMD_TIMESLICE_TLS_CERT_FILE`` and
``LLMD_TIMESLICE_TLS_KEY_FILE`` (this component's certificate chain and key, PEM) and
``LLMD_TIMESLICE_TLS_CA_FILE`` (the CA that signs the peers). With all three set, servers require a
client certificate signed by that CA and clients verify the server against it; with none set, plain
TCP (the token still applies). Some but not all set is an error. The gate's data-plane ext_proc port is
not covered: Envoy's connection to it is configured in Envoy (docs/security.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc import aio

CERT_ENV = "LLMD_TIMESLICE_TLS_CERT_FILE"
KEY_ENV = "LLMD_TIMESLICE_TLS_KEY_FILE"
CA_ENV = "LLMD_TIMESLICE_TLS_CA_FILE"


@dataclass(frozen=True)
class TlsFiles:
    """PEM contents: this side's certificate chain and key, and the CA its peers are signed by."""

    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def load(cls, cert: str | os.PathLike, key: str | os.PathLike, ca: str | os.PathLike) -> TlsFiles:
        """Raises FileNotFoundError naming a missing file."""
        return cls(Path(cert).read_bytes(), Path(key).read_bytes(), Path(ca).read_bytes())


def from_env() -> TlsFiles | None:
    """The TLS files named by the environment, or None when none is set.

    Raises:
        ValueError: only some of the three variables are set.
        FileNotFoundError: a named file does not exist.
    """
    names = {CERT_ENV: os.environ.get(CERT_ENV), KEY_ENV: os.environ.get(KEY_ENV), CA_ENV: os.environ.get(CA_ENV)}
    given = {k: v for k, v in names.items() if v}
    if not given:
        return None
    if len(given) != 3:
        missing = sorted(set(names) - set(given))
        raise ValueError(f"mutual TLS needs {CERT_ENV}, {KEY_ENV} and {CA_ENV}; missing {missing}")
    return TlsFiles.load(given[CERT_ENV], given[KEY_ENV], given[CA_ENV])


def add_port(server: aio.Server, address: str, tls: TlsFiles | None) -> int:
    """Bind ``address`` with mTLS (client certificate required) when ``tls`` is given; returns the port."""
    if tls is None:
        return server.add_insecure_port(address)
    creds = grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=True)
    return server.add_secure_port(address, creds)


def _creds(tls: TlsFiles) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)


RECONNECT_BACKOFF_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5000),
)
"""gRPC's reconnect back-off grows to 120 s by default: a channel that keeps calling a dead peer (heartbeats, the
engine audit) then fails fast for up to that long after the peer is back. Every channel here caps it at 5 s."""


def _with_backoff(kwargs: dict) -> dict:
    options = list(kwargs.get("options") or ())
    given = {key for key, _ in options}
    return {**kwargs, "options": [*(o for o in RECONNECT_BACKOFF_OPTIONS if o[0] not in given), *options]}


def aio_channel(target: str, tls: TlsFiles | None = None, **kwargs) -> aio.Channel:
    """An asyncio channel to ``target``: mTLS when ``tls`` is given, else plain; reconnect back-off capped at 5 s
    (:data:`RECONNECT_BACKOFF_OPTIONS`, unless ``options`` sets them)."""
    kwargs = _with_backoff(kwargs)
    if tls is None:
        return aio.insecure_channel(target, **kwargs)
    return aio.secure_channel(target, _creds(tls), **kwargs)


def channel(target: str, tls: TlsFiles | None = None, **kwargs) -> grpc.Channel:
    """A blocking channel to ``target``: mTLS when ``tls`` is given, else plain; reconnect back-off capped at 5 s."""
    kwargs = _with_backoff(kwargs)
    if tls is None:
        return grpc.insecure_channel(target, **kwargs)
    return grpc.secure_channel(target, _creds(tls), **kwargs)
