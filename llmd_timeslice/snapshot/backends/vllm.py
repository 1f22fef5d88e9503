"""vLLM backend (upstream ``APP_VLLM``): sleep / wake-up over vLLM's HTTP dev endpoints, verified.

vLLM facts used here (vLLM 0.32, server started with ``VLLM_SERVER_DEV_MODE=1``; checked on the
CPU build, DESIGN.md §7): ``POST /sleep?level=N&mode=wait`` (level 1 offloads weights to host,
level 2 discards them), ``POST /wake_up`` with optional ``?tags=weights`` / ``?tags=kv_cache``,
``GET /is_sleeping`` -> ``{"is_sleeping": bool}``, and on ``GET /metrics`` the gauges
``vllm:engine_sleep_state{sleep_state="awake"|"weights_offloaded"|"discard_all"}`` (1.0 on the
current state's series), ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``. The
default sleep mode is ``abort`` (requests in flight end with ``finish_reason: abort``), so this
backend always sends ``mode=wait`` (vLLM finishes them first). On the CPU build sleep frees no
memory (it pauses the scheduler), but the reported state and the hang of requests sent to a
sleeping engine are real.
An HTTP 200 from ``/sleep`` proves nothing by itself, so every step is verified afterwards: the
engine must report sleeping (``/is_sleeping``, and the sleep-state gauge where exported) after a
sleep; after a wake it must report awake and answer a one-token probe completion.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmd_timeslice.snapshot.backends.base import (
    BackendError,
    SnapshotBackend,
    SuspendMode,
    SuspendResult,
    register_backend,
)

log = logging.getLogger(__name__)


SLEEP_STATE_FOR_LEVEL = {1: "weights_offloaded", 2: "discard_all"}


@dataclass
class EngineMetrics:
    """What the backend reads from vLLM's ``/metrics``: request counts (summed over engines) and
    the engine sleep state (the ``sleep_state`` label whose series is 1; None if not exported)."""

    running: float = 0.0
    waiting: float = 0.0
    sleep_state: str | None = None


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Parse Prometheus text exposition from vLLM (prometheus-client's parser)."""
    m = EngineMetrics()
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:num_requests_running":
            m.running = sum(s.value for s in fam.samples if s.name == fam.name)
        elif fam.name == "vllm:num_requests_waiting":
            m.waiting = sum(s.value for s in fam.samples if s.name == fam.name)
        elif fam.name == "vllm:engine_sleep_state":
            for s in fam.samples:
                if s.value >= 1 and "sleep_state" in s.labels:
                    m.sleep_state = s.labels["sleep_state"]
    return m


@register_backend
class VllmBackend(SnapshotBackend):
    """Sleep/wake one vLLM OpenAI server.

    Args:
        base_url: the engine's URL, e.g. ``http://127.0.0.1:8000`` (localhost in the pod).
        idle_timeout_s: most seconds to wait for running + waiting requests to reach 0 before
            sleeping (the drain's last step; then ``mode=wait`` lets vLLM finish the rest).
        idle_poll_s: period of that metric poll, in seconds (a poll: vLLM has no idle event).
        probe: send a one-token completion after each wake and fail the wake if it errors.
        request_timeout_s: timeout of each HTTP call, in seconds.
    """

    name = "vllm"
    supported_modes = (SuspendMode.OFFLOAD, SuspendMode.DISCARD)

    def __init__(self, base_url: str, idle_timeout_s: float = 60.0, idle_poll_s: float = 0.05,
                 probe: bool = True, request_timeout_s: float = 120.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.idle_timeout_s = idle_timeout_s
        self.idle_poll_s = idle_poll_s
        self.probe = probe
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=request_timeout_s)
        self._model: str | None = None

    async def close(self) -> None:
        await self._http.aclose()

    async def _get(self, path: str) -> httpx.Response:
        try:
            return await self._http.get(path)
        except httpx.HTTPError as exc:
            raise BackendError(f"vLLM at {self.base_url} did not answer GET {path}: {exc!r}; is the engine up?") from exc

    async def _post(self, path: str, **kw) -> httpx.Response:
        try:
            r = await self._http.post(path, **kw)
        except httpx.HTTPError as exc:
            raise BackendError(f"vLLM at {self.base_url} did not answer POST {path}: {exc!r}; is the engine up?") from exc
        if r.status_code != 200:
            raise BackendError(f"vLLM POST {path} answered {r.status_code}: {r.text[:300]}; "
                               "is the server started with VLLM_SERVER_DEV_MODE=1 (and sleep mode enabled on GPU)?")
        return r

    async def metrics(self) -> EngineMetrics:
        """Current engine figures (see :func:`parse_engine_metrics`)."""
        r = await self._get("/metrics")
        return parse_engine_metrics(r.text)

    async def is_suspended(self) -> bool:
        r = await self._get("/is_sleeping")
        if r.status_code != 200:
            raise BackendError(f"vLLM GET /is_sleeping answered {r.status_code}: {r.text[:200]}")
        return bool(r.json().get("is_sleeping"))

    async def wait_idle(self) -> bool:
        """Wait until the engine runs and queues no request; False if ``idle_timeout_s`` passed."""
        deadline = time.monotonic() + self.idle_timeout_s
        while True:
            m = await self.metrics()
            if m.running + m.waiting == 0:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(self.idle_poll_s)

    async def suspend(self, mode: SuspendMode, tags: list[str]) -> SuspendResult:
        level = 2 if mode is SuspendMode.DISCARD else 1
        if not await self.wait_idle():
            log.warning("engine %s still busy after %.1f s; sleeping with mode=wait", self.base_url, self.idle_timeout_s)
        await self._post("/sleep", params={"level": level, "mode": "wait"})
        if not await self.is_suspended():
            raise BackendError(f"vLLM {self.base_url} answered /sleep with 200 but /is_sleeping says awake; "
                               "the engine is left out of service")
        m = await self.metrics()
        if m.sleep_state is not None and m.sleep_state != SLEEP_STATE_FOR_LEVEL[level]:
            raise BackendError(f"vLLM {self.base_url}: vllm:engine_sleep_state is {m.sleep_state!r} after sleep "
                               f"level {level} (expected {SLEEP_STATE_FOR_LEVEL[level]!r}); the engine is left out of "
                               "service")
        return SuspendResult()

    async def resume(self, tags: list[str]) -> None:
        params = [("tags", t) for t in tags] if tags else None
        await self._post("/wake_up", params=params)
        if tags and "kv_cache" not in tags:
            return  # a partial wake (weights only) is verified by the caller's next step
        if await self.is_suspended():
            raise BackendError(f"vLLM {self.base_url} answered /wake_up with 200 but /is_sleeping still says "
                               "asleep; the endpoint stays out of service")
        m = await self.metrics()
        if m.sleep_state is not None and m.sleep_state != "awake":
            raise BackendError(f"vLLM {self.base_url}: vllm:engine_sleep_state is {m.sleep_state!r} after wake-up; "
                               "the endpoint stays out of service")
        if self.probe:
            await self._probe()

    async def _probe(self) -> None:
        if self._model is None:
            r = await self._get("/v1/models")
            try:
                self._model = r.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError) as exc:
                raise BackendError(f"vLLM {self.base_url} /v1/models gave no model: {r.text[:200]}") from exc
        r = await self._post("/v1/completions", json={"model": self._model, "prompt": "ok", "max_tokens": 1,
                                                      "temperature": 0})
        if not r.json().get("choices"):
            raise BackendError(f"vLLM {self.base_url} probe completion returned no choices: {r.text[:200]}")
