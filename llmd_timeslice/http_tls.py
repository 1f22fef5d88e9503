"""TLS verification for the project's own HTTP clients (a backend to its engine, ``up``'s readiness probes)."""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying TLS context per process (httpx's default: the certifi bundle)."""
    return httpx.create_ssl_context()


def verify_for(url: str) -> ssl.SSLContext | bool:
    """httpx's ``verify`` for a client of ``url``: False for ``http://`` (no TLS on the connection), else the
    process's one verifying context. httpx builds a new context for every client by default, loading the CA bundle
    each time (once per sampler in a sidecar host, up to 20 times a second per starting child in ``up``'s probes; its cost:
    docs/benchmarks.md#code-figures)."""
    return _tls_context() if url.startswith("https://") else False
