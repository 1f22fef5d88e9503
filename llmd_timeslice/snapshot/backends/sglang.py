"""SGLang backend (upstream ``APP_SGLANG``): release / resume memory occupation over HTTP.

SGLang's dialect: ``POST /release_memory_occupation`` and ``POST /resume_memory_occupation``,
each with a JSON body ``{"tags": [...]}`` (``null``: all of ``weights``, ``kv_cache``,
``cuda_graph``); the server must run with ``--enable-memory-saver``. Whether released weights
are kept in host memory (offload) or dropped (discard, the RL framework pushes new weights) is
SGLang's own setting (``--enable-weights-cpu-backup``), not a per-call choice, so this backend
accepts both modes and sends only tags.

Requests still inside the engine at a release: SGLang's scheduler requires an idle engine
(``release_memory_occupation`` asserts ``is_fully_idle()``, "should be called only when server is idle":
``python/sglang/srt/managers/scheduler_update_weights_mixin.py`` in sgl-project/sglang; older versions free the
memory under the running requests). So before a release the backend waits, at most ``idle_timeout_s``, until
``sglang:num_running_reqs`` + ``sglang:num_queue_reqs`` are 0 (the scheduler's gauges on ``GET /metrics``,
``--enable-metrics``: ``python/sglang/srt/metrics/collector.py``); still busy then, or without metrics (404), it
sends ``POST /pause_generation {"mode": pause_mode}`` (``http_server.py``; ``abort``, the default, ends every
request still inside: the one mode after which every SGLang version's idle assertion holds; ``retract`` keeps them
queued, for versions whose assertion ignores a paused engine's queue) and checks the gauges again (still busy:
``POST /continue_generation`` and the release fails). A pause the backend made is lifted with ``POST
/continue_generation`` after the full resume, before the probe: a paused SGLang holds every new request.

SGLang exposes no "is sleeping" endpoint, so verification is: the HTTP answer, the device memory the engine
still holds after a release of every tag, polled until it settles within budget (the vLLM backend's check:
:mod:`~llmd_timeslice.snapshot.backends.sleep_memory`; SGLang answers its release before the memory is freed,
THUDM/slime#579), budget level 1 for an offload and 2 for a discard, and after a full resume the semantic
probe the vLLM backend has: greedy tokens
(``temperature`` 0, ``ignore_eos``) of the fixed :data:`~llmd_timeslice.snapshot.backends.vllm.PROBE_PROMPTS`
through ``POST /generate`` (``output_ids`` of each answer; its text where a version returns none), compared with a
reference for the weight version the engine reports (``GET /get_weight_version``; one reference where the route is
absent). The reference is recorded before the first release while the engine is idle (it has been serving that
version), else at the first verified resume. A mismatch releases the engine's memory again (out of service, not
serving garbage) and fails the resume with :class:`~llmd_timeslice.snapshot.backends.vllm.ProbeMismatch`; the next
restore probes again. Tested against a fake server implementing those endpoints (SGLang does not run on this
CPU-only machine).
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmd_timeslice.snapshot.backends.base import (
    BackendError,
    SnapshotBackend,
    SuspendMode,
    SuspendResult,
)
from llmd_timeslice.snapshot.backends.device_memory import engine_memory
from llmd_timeslice.snapshot.backends.engine_http import engine_http_client
from llmd_timeslice.snapshot.backends.sleep_memory import GIB, SleepMemoryCheck
from llmd_timeslice.snapshot.backends.vllm import (
    PROBE_PROMPTS,
    PROBE_TOKENS,
    MemoryReader,
    ProbeMismatch,
)

log = logging.getLogger(__name__)

SGLANG_PAUSE_MODES = ("abort", "retract")
VLLM_PAUSE_MODE_EQUIVALENT = {"wait": "abort", "keep": "retract"}
"""The sidecar's ``--pause-mode`` speaks vLLM's modes: ``wait`` (the wait for idle comes first anyway, then what is
left is ended) -> ``abort``; ``keep`` (requests survive) -> ``retract`` (back to the queue, recomputed after the
resume)."""
ALL_TAGS = ("weights", "kv_cache", "cuda_graph")


def parse_sglang_load(text: str) -> float:
    """``sglang:num_running_reqs`` + ``sglang:num_queue_reqs`` summed over their series (Prometheus text)."""
    load = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name in ("sglang:num_running_reqs", "sglang:num_queue_reqs"):
            load += sum(s.value for s in fam.samples if s.name == fam.name)
    return load


class SglangBackend(SnapshotBackend):
    """Release/resume one SGLang server's device memory.

    Args:
        base_url: e.g. ``http://127.0.0.1:30000``.
        probe: the semantic probe after a full resume (module doc).
        request_timeout_s: timeout of each HTTP call, in seconds.
        memory_reader, min_freed_fraction, residual_margin_bytes, memory_settle_timeout_s, memory_poll_s, nvml,
            engine_pids: as for :class:`~llmd_timeslice.snapshot.backends.vllm.VllmBackend`.
        idle_timeout_s, idle_poll_s: most seconds to wait for an idle engine before a release, and the poll period.
        pause_mode: ``/pause_generation`` mode when the engine is still busy (``abort`` | ``retract``; module doc).
        probe_prompts, probe_tokens, probe_max_mismatched_prompts: as for the vLLM backend.

    Raises:
        ValueError: an unknown pause mode, or a probe without prompts.
    """

    name = "sglang"
    supported_modes = (SuspendMode.OFFLOAD, SuspendMode.DISCARD)
    checks_residual = True

    def __init__(
        self,
        base_url: str,
        probe: bool = True,
        request_timeout_s: float = 120.0,
        memory_reader: MemoryReader | None = None,
        min_freed_fraction: float = 0.5,
        idle_timeout_s: float = 60.0,
        idle_poll_s: float = 0.05,
        pause_mode: str = "abort",
        probe_prompts: tuple[str, ...] = PROBE_PROMPTS,
        probe_tokens: int = PROBE_TOKENS,
        probe_max_mismatched_prompts: int = 0,
        residual_margin_bytes: int = GIB,
        memory_settle_timeout_s: float = 60.0,
        memory_poll_s: float = 0.25,
        nvml: object | None = None,
        engine_pids: list[int] | None = None,
        **_ignored,
    ) -> None:
        pause_mode = VLLM_PAUSE_MODE_EQUIVALENT.get(pause_mode, pause_mode)
        if pause_mode not in SGLANG_PAUSE_MODES:
            raise ValueError(f"SGLang pause_mode must be one of {SGLANG_PAUSE_MODES}, not {pause_mode!r}")
        if probe and (not probe_prompts or probe_tokens < 1):
            raise ValueError("the probe needs at least one prompt and probe_tokens >= 1")
        self.base_url = base_url.rstrip("/")
        self.probe = probe
        self.memory = SleepMemoryCheck(
            engine_memory(self.base_url, memory_reader, nvml, engine_pids),
            min_freed_fraction=min_freed_fraction,
            margin_bytes=residual_margin_bytes,
            settle_timeout_s=memory_settle_timeout_s,
            poll_s=memory_poll_s,
        )
        self.idle_timeout_s, self.idle_poll_s, self.pause_mode = idle_timeout_s, idle_poll_s, pause_mode
        self.probe_prompts, self.probe_tokens = tuple(probe_prompts), probe_tokens
        self.probe_max_mismatched_prompts = probe_max_mismatched_prompts
        self.probe_references: dict[str | None, list[list]] = {}
        """Weight version label (None: the engine reports none) -> greedy token ids per probe prompt."""
        self._http = engine_http_client(self.base_url, request_timeout_s)
        self._released: set[str] = set()  # SGLang cannot be asked; this is what we released
        self._paused = False  # this backend paused generation before its release

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        try:
            return await self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise BackendError(
                f"SGLang at {self.base_url} did not answer {method} {path}: {exc!r}; is the engine up? "
                "The endpoint stays out of service: restart the engine, then restore"
            ) from exc

    async def _post(self, path: str, body: dict) -> httpx.Response:
        r = await self._request("POST", path, body)
        if r.status_code != 200:
            raise BackendError(
                f"SGLang POST {path} answered {r.status_code}: {r.text[:300]}; is the server started "
                "with --enable-memory-saver? The endpoint stays out of service"
            )
        return r

    async def load(self) -> float | None:
        """Requests running + queued on the engine now (``/metrics``); None where the engine exports no metrics."""
        r = await self._request("GET", "/metrics")
        if r.status_code != 200:
            return None
        return parse_sglang_load(r.text)

    async def _wait_idle(self) -> float | None:
        """Wait (``idle_timeout_s``) for no request inside; returns the last load (0: idle; None: unknown)."""
        deadline = time.monotonic() + self.idle_timeout_s
        while True:
            load = await self.load()
            if load is None or load == 0 or time.monotonic() >= deadline:
                return load
            await asyncio.sleep(self.idle_poll_s)

    async def _pause_if_busy(self, load: float | None) -> None:
        """Before a release (module doc): pause generation when requests are still inside or the load is unknown;
        raise BackendError (generation continued) when the engine is still busy after the pause."""
        if load == 0:
            return
        log.warning(
            "SGLang %s: %s before the release; pausing generation (mode %s)",
            self.base_url,
            "no load metrics (--enable-metrics)" if load is None else f"{load:g} request(s) still inside",
            self.pause_mode,
        )
        await self._post("/pause_generation", {"mode": self.pause_mode})
        self._paused = True
        after = await self.load()
        if self.pause_mode == "abort" and after:
            await self._continue()
            raise BackendError(
                f"SGLang {self.base_url}: {after:g} request(s) still inside after POST /pause_generation "
                "(abort); not released (SGLang's scheduler requires an idle engine), generation continued: "
                "retry the switch"
            )

    async def _continue(self) -> None:
        await self._post("/continue_generation", {})
        self._paused = False

    async def suspend(self, mode: SuspendMode, tags: list[str], residual_budget_bytes: int | None = None) -> SuspendResult:
        """Wait for idle (or pause), record the probe reference if the version has none, release, check the memory
        left against its budget after a release of every tag (module doc; raises ``MemoryNotFreed`` over it)."""
        load = await self._wait_idle()
        if self.probe and load == 0 and not self._released:
            version = await self._weight_version()
            if version not in self.probe_references:
                self.probe_references[version] = await self._probe_tokens()
        await self._pause_if_busy(load)
        whole = not tags or set(tags) >= set(ALL_TAGS)
        before = await self.memory.before_sleep() if whole else None
        try:
            await self._post("/release_memory_occupation", {"tags": list(tags) or None})
        except BackendError:
            if self._paused:
                await self._continue()
            raise
        self._released |= set(tags) or set(ALL_TAGS)
        level = 2 if mode is SuspendMode.DISCARD else 1
        residual = await self.memory.after_sleep(before, level, residual_budget_bytes, f"SGLang {self.base_url}")
        return SuspendResult(device_bytes_freed=None if residual is None else residual.freed, residual=residual)

    async def resume(self, tags: list[str]) -> None:
        """Resume ``tags`` (empty: all released); after the last one, continue generation if paused, then probe."""
        await self._post("/resume_memory_occupation", {"tags": list(tags) or None})
        self._released -= set(tags) if tags else set(self._released)
        if self._released:
            return  # a partial resume; the caller resumes the rest next
        if self._paused:
            await self._continue()
        if self.probe:
            await self._probe()

    async def _weight_version(self) -> str | None:
        r = await self._request("GET", "/get_weight_version")
        try:
            return str(r.json()["weight_version"]) if r.status_code == 200 else None
        except (ValueError, KeyError, TypeError):
            return None

    async def _probe_tokens(self) -> list[list]:
        """Greedy output ids of each probe prompt (its text where the answer has no ids)."""
        r = await self._post(
            "/generate",
            {
                "text": list(self.probe_prompts),
                "sampling_params": {"max_new_tokens": self.probe_tokens, "temperature": 0, "ignore_eos": True},
            },
        )
        try:
            answers = r.json()
            answers = answers if isinstance(answers, list) else [answers]
            out = [list(a["output_ids"]) if a.get("output_ids") is not None else [a["text"]] for a in answers]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BackendError(
                f"SGLang {self.base_url} probe /generate gave no output: {r.text[:200]}; the endpoint stays out of service"
            ) from exc
        if len(out) != len(self.probe_prompts):
            raise BackendError(
                f"SGLang {self.base_url} probe /generate returned {len(out)} answers for {len(self.probe_prompts)} "
                f"prompts: {r.text[:200]}; the endpoint stays out of service"
            )
        return out

    async def _probe(self) -> None:
        """The semantic probe (module doc): compare with the reference of the version served, or record it."""
        version = await self._weight_version()
        got = await self._probe_tokens()
        ref = self.probe_references.get(version)
        if ref is None:
            self.probe_references[version] = got
            return
        wrong = [i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b]
        if len(wrong) <= self.probe_max_mismatched_prompts:
            return
        i = wrong[0]
        why = (
            f"SGLang {self.base_url} resumed but answers the probe prompts differently from weight version "
            f"{version or '(unlabelled)'}'s reference (recorded when it served before): {len(wrong)} of {len(ref)} "
            f"prompts differ, e.g. {self.probe_prompts[i]!r} -> {got[i]} instead of {ref[i]}"
        )
        try:  # out of service, its memory free again: never left serving garbage
            await self._post("/release_memory_occupation", {"tags": None})
            self._released = set(ALL_TAGS)
        except BackendError as exc:
            log.error("SGLang %s could not be released again after the failed probe: %s", self.base_url, exc)
        raise ProbeMismatch(
            f"{why}; its memory was released again and the endpoint stays out of service: restart the engine "
            "(or reload its weights), then restore"
        )

    async def is_suspended(self) -> bool:
        return bool(self._released)
