"""The HTTP client a backend talks to its engine with (vLLM's and SGLang's OpenAI-compatible servers)."""

from __future__ import annotations

import httpx

from llmd_timeslice.http_tls import verify_for


def engine_http_client(base_url: str, timeout_s: float) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` for the engine at ``base_url`` (``http://host:port`` or ``https://...``), requests
    timing out after ``timeout_s`` seconds; TLS as :func:`~llmd_timeslice.http_tls.verify_for` says."""
    return httpx.AsyncClient(base_url=base_url, timeout=timeout_s, verify=verify_for(base_url))
