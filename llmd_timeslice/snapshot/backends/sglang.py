"""SGLang backend (upstream ``APP_SGLANG``): release / resume memory occupation over HTTP.

SGLang's dialect: ``POST /release_memory_occupation`` and ``POST /resume_memory_occupation``,
each with a JSON body ``{"tags": [...]}`` (``null``: all of ``weights``, ``kv_cache``,
``cuda_graph``); the server must run with ``--enable-memory-saver``. Whether released weights
are kept in host memory (offload) or dropped (discard, the RL framework pushes new weights) is
SGLang's own setting (``--enable-weights-cpu-backup``), not a per-call choice, so this backend
accepts both modes and sends only tags.

SGLang exposes no "is sleeping" endpoint, so verification is: the HTTP answer, device memory
freed (same ``memory_reader`` / ``min_freed_fraction`` as the vLLM backend, NVML where present)
after a release, and a one-token ``POST /generate`` probe after a full resume. Tested against a
fake server implementing those endpoints (SGLang does not run on this CPU-only machine).
"""

from __future__ import annotations

import httpx

from llmd_timeslice.snapshot.backends.base import (
    BackendError,
    SnapshotBackend,
    SuspendMode,
    SuspendResult,
    freed_too_little,
    register_backend,
)
from llmd_timeslice.snapshot.backends.vllm import MemoryReader, nvml_memory_reader


@register_backend
class SglangBackend(SnapshotBackend):
    """Release/resume one SGLang server's device memory.

    Args:
        base_url: e.g. ``http://127.0.0.1:30000``.
        probe: send a one-token ``/generate`` after a full resume and fail it on error.
        request_timeout_s: timeout of each HTTP call, in seconds.
        memory_reader / min_freed_fraction: as for :class:`~llmd_timeslice.snapshot.backends.vllm.VllmBackend`.
    """

    name = "sglang"
    supported_modes = (SuspendMode.OFFLOAD, SuspendMode.DISCARD)

    def __init__(
        self,
        base_url: str,
        probe: bool = True,
        request_timeout_s: float = 120.0,
        memory_reader: MemoryReader | None = None,
        min_freed_fraction: float = 0.0,
        **_ignored,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.probe = probe
        self.memory_reader = memory_reader if memory_reader is not None else nvml_memory_reader()
        self.min_freed_fraction = min_freed_fraction
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=request_timeout_s)
        self._released: set[str] = set()  # SGLang cannot be asked; this is what we released

    async def close(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: dict) -> httpx.Response:
        try:
            r = await self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise BackendError(
                f"SGLang at {self.base_url} did not answer POST {path}: {exc!r}; is the engine up? "
                "The endpoint stays out of service: restart the engine, then restore"
            ) from exc
        if r.status_code != 200:
            raise BackendError(
                f"SGLang POST {path} answered {r.status_code}: {r.text[:300]}; is the server started "
                "with --enable-memory-saver? The endpoint stays out of service"
            )
        return r

    async def suspend(self, mode: SuspendMode, tags: list[str]) -> SuspendResult:
        before = self.memory_reader() if self.memory_reader else None
        await self._post("/release_memory_occupation", {"tags": list(tags) or None})
        self._released |= set(tags) or {"weights", "kv_cache", "cuda_graph"}
        after = self.memory_reader() if self.memory_reader else None
        freed, fraction = freed_too_little(before, after, self.min_freed_fraction)
        if fraction is not None:
            raise BackendError(
                f"SGLang {self.base_url} answered release with 200 but device memory went from {before} "
                f"to {after} bytes (< {self.min_freed_fraction:.0%} freed); the endpoint stays out of "
                "service"
            )
        return SuspendResult(device_bytes_freed=freed)

    async def resume(self, tags: list[str]) -> None:
        await self._post("/resume_memory_occupation", {"tags": list(tags) or None})
        self._released -= set(tags) if tags else set(self._released)
        if self._released or not self.probe:
            return  # a partial resume; the caller resumes the rest next
        r = await self._post("/generate", {"text": "ok", "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        try:
            ok = "text" in r.json()
        except ValueError:
            ok = False
        if not ok:
            raise BackendError(
                f"SGLang {self.base_url} probe /generate gave no text: {r.text[:200]}; the endpoint stays out of service"
            )

    async def is_suspended(self) -> bool:
        return bool(self._released)
