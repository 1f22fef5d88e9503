"""The HTTP client a backend talks to its engine with (vLLM's and SGLang's OpenAI-compatible servers)."""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying TLS context per process (httpx's default: the certifi bundle)."""
    return httpx.create_ssl_context()


def engine_http_client(base_url: str, timeout_s: float) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` for the engine at ``base_url`` (``http://host:port`` or ``https://...``), requests
    timing out after ``timeout_s`` seconds.

    An ``http://`` engine gets no TLS context at all, an ``https://`` one the process's one verifying context: httpx
    builds a new context for every client by default, loading the CA bundle each time (48 ms of CPU per client here,
    once per sampler in a sidecar host and 128 times per run of benchmarks.scale)."""
    verify: ssl.SSLContext | bool = _tls_context() if base_url.startswith("https://") else False
    return httpx.AsyncClient(base_url=base_url, timeout=timeout_s, verify=verify)
