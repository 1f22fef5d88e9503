"""vLLM backend (upstream ``APP_VLLM``): sleep / wake-up over vLLM's HTTP dev endpoints, verified.

The engine facts it relies on (routes, pause modes, level-2 wake sequence, weight sync, engine versions, device
memory, verification, the semantic probe, LoRA adapters, a paused or dead engine core, the prefix cache after a
wake, requests parked in a sleeping engine), each with its vLLM source or measurement, are in docs/snapshot.md,
"vLLM facts the backend relies on". Its parts: :mod:`~llmd_timeslice.snapshot.backends.vllm_http` (HTTP calls and
their errors), :mod:`~llmd_timeslice.snapshot.backends.vllm_metrics` (``/metrics`` parsing),
:mod:`~llmd_timeslice.snapshot.backends.vllm_probe` (the semantic probe); this module keeps the sleep/wake procedure.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from llmd_timeslice.snapshot.backends import deadlines
from llmd_timeslice.snapshot.backends.base import (
    BackendError,
    EnginePaused,
    SnapshotBackend,
    SuspendMode,
    SuspendResult,
    WeightVersionRejected,
)
from llmd_timeslice.snapshot.backends.device_memory import engine_memory
from llmd_timeslice.snapshot.backends.engine_http import engine_http_client
from llmd_timeslice.snapshot.backends.sleep_memory import GIB, SleepMemoryCheck
from llmd_timeslice.snapshot.backends.vllm_capabilities import VllmCapabilities
from llmd_timeslice.snapshot.backends.vllm_capabilities import probe as probe_capabilities
from llmd_timeslice.snapshot.backends.vllm_metrics import (
    SLEEP_STATE_FOR_LEVEL,
    EngineMetrics,
    describe_engines,
    needed_metric_lines,
    parse_engine_metrics,
)
from llmd_timeslice.snapshot.backends.vllm_probe import (
    PROBE_PROMPTS,
    PROBE_TOKENS,
    ProbeMismatch,
    SemanticProbe,
    SpecDecodeCollapsed,
)
from llmd_timeslice.snapshot.backends.vllm_spec_decode import AcceptanceCheck
from llmd_timeslice.snapshot.backends.vllm_weights import WeightLoader, default_loaders
from llmd_timeslice.weights.manifest import WeightManifestError, verify_weights

log = logging.getLogger(__name__)

__all__ = [
    "PAUSE_MODES",
    "PROBE_PROMPTS",
    "PROBE_TOKENS",
    "SLEEP_STATE_FOR_LEVEL",
    "EngineMetrics",
    "MemoryReader",
    "ProbeMismatch",
    "SpecDecodeCollapsed",
    "VllmBackend",
    "needed_metric_lines",
    "parse_engine_metrics",
]

if TYPE_CHECKING:
    from llmd_timeslice.weights.update import WeightUpdate


PAUSE_MODES = ("wait", "keep", "abort")

MemoryReader = Callable[[], "int | None"]
"""Returns the device memory in use, in bytes (None: unknown)."""


@dataclass(eq=False)
class _Reload:
    """A ``reload_weights`` sent to the engine: its HTTP call (a task that outlives an operation that ran out of
    time), the weights it loads (None: the model's own path), when it was sent, whether an operation took its result."""

    task: asyncio.Future
    path: str | None
    started: float = field(default_factory=time.monotonic)
    used: bool = False

    def __post_init__(self) -> None:
        self.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no "never retrieved"

    def finished_unused(self, path: str | None) -> bool:
        """Finished well, loading ``path``, and no operation counted it yet."""
        t = self.task
        return t.done() and not t.cancelled() and t.exception() is None and not self.used and self.path == path

    def __str__(self) -> str:
        return f"weights {self.path or '(the model path)'}"


class VllmBackend(SemanticProbe, SnapshotBackend):
    """Sleep/wake one vLLM OpenAI server.

    Args:
        base_url: the engine's URL, e.g. ``http://127.0.0.1:8000`` (localhost in the pod).
        idle_timeout_s: most seconds to wait for running + waiting requests to reach 0 before
            sleeping (the drain's last step; then ``mode=wait`` lets vLLM finish the rest).
        idle_poll_s: period of that metric poll, in seconds (a poll: vLLM has no idle event).
        probe: the semantic probe after each full wake (docs/snapshot.md, vLLM facts); off: no check of what the engine answers.
        request_timeout_s: timeout of each HTTP call, in seconds.
        pause_mode: ``/sleep?mode=`` (``wait``: finish requests in flight; ``keep``: freeze them
            until wake; ``abort``: end them with ``finish_reason: abort``).
        reload_weights: after a level-2 sleep, reload weights (``collective_rpc reload_weights``)
            between the weights and kv_cache wake-ups.
        reset_prefix_cache: after a level-2 wake, ``POST /reset_prefix_cache``.
        memory_reader: device memory in use, bytes (default: NVML where it answers, per process of ``engine_pids``,
            else none: not checked, said once).
        min_freed_fraction: with memory read, a sleep must free at least this fraction of the memory the engine
            held before it (0 disables that part of the check; the freed bytes are still reported).
        residual_margin_bytes: a sleep's default budget is the residual of the engine's first verified sleep at
            that level plus this (bytes).
        memory_settle_timeout_s, memory_poll_s: how long, and how often, the memory is read after a sleep until it
            settles within budget (:class:`~llmd_timeslice.snapshot.backends.sleep_memory.SleepMemoryCheck`).
        spec_decode_min_acceptance_ratio: with speculative decoding on, a wake whose probe's draft acceptance is
            below this fraction of the version's reference fails (:class:`SpecDecodeCollapsed`; 0: off).
        nvml: a module shaped like ``pynvml`` (default: ``import pynvml``); engine_pids: the engine's processes
            (default: the listener on ``base_url``'s port and its children, read at each sleep).
        weight_loaders: weight source name -> loader (default:
            :func:`~llmd_timeslice.snapshot.backends.vllm_weights.default_loaders`).
        probe_prompts, probe_tokens: the semantic probe's prompts and greedy tokens per prompt (docs/snapshot.md, vLLM facts).
        probe_max_mismatched_prompts: prompts whose tokens may differ from the reference before the probe fails
            (0: exact; raise it on GPUs where bf16 near-ties can flip a continuation).

    Raises:
        ValueError: an unknown pause mode, a fraction outside [0, 1], or a probe without prompts.
    """

    name = "vllm"
    supported_modes = (SuspendMode.OFFLOAD, SuspendMode.DISCARD)
    checks_residual = True
    supports_weight_sync = True

    def __init__(
        self,
        base_url: str,
        idle_timeout_s: float = 60.0,
        idle_poll_s: float = 0.05,
        probe: bool = True,
        request_timeout_s: float = 120.0,
        pause_mode: str = "wait",
        reload_weights: bool = True,
        reset_prefix_cache: bool = True,
        memory_reader: MemoryReader | None = None,
        min_freed_fraction: float = 0.5,
        weight_loaders: dict[str, WeightLoader] | None = None,
        probe_prompts: tuple[str, ...] = PROBE_PROMPTS,
        probe_tokens: int = PROBE_TOKENS,
        probe_max_mismatched_prompts: int = 0,
        residual_margin_bytes: int = GIB,
        memory_settle_timeout_s: float = 60.0,
        memory_poll_s: float = 0.25,
        nvml: object | None = None,
        engine_pids: list[int] | None = None,
        spec_decode_min_acceptance_ratio: float = 0.5,
    ) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, not {pause_mode!r}")
        if not 0.0 <= min_freed_fraction <= 1.0:
            raise ValueError("min_freed_fraction must be in [0, 1]")
        if probe and (not probe_prompts or probe_tokens < 1):
            raise ValueError("the probe needs at least one prompt and probe_tokens >= 1")
        if not 0 <= probe_max_mismatched_prompts < max(1, len(probe_prompts)):
            raise ValueError(
                f"probe_max_mismatched_prompts must be in [0, {len(probe_prompts)}), got {probe_max_mismatched_prompts}"
            )
        self.probe_prompts, self.probe_tokens = tuple(probe_prompts), probe_tokens
        self.probe_max_mismatched_prompts = probe_max_mismatched_prompts
        self.probe_references: dict[int, dict[str, list[list[int]]]] = {}
        """Weight version -> served model name (base, then LoRA adapters) -> greedy token ids per probe prompt,
        recorded when that version first served."""
        self.pause_mode = pause_mode
        self.reload = reload_weights
        self.reset_prefix_cache = reset_prefix_cache
        self.level: int | None = None  # level of the current sleep (None: awake or unknown)
        self.base_url = base_url.rstrip("/")
        self.memory = SleepMemoryCheck(
            engine_memory(self.base_url, memory_reader, nvml, engine_pids),
            min_freed_fraction=min_freed_fraction,
            margin_bytes=residual_margin_bytes,
            settle_timeout_s=memory_settle_timeout_s,
            poll_s=memory_poll_s,
        )
        self.idle_timeout_s = idle_timeout_s
        self.idle_poll_s = idle_poll_s
        self.probe = probe
        self.request_timeout_s = request_timeout_s
        self._http = engine_http_client(self.base_url, request_timeout_s)
        self._reload: _Reload | None = None  # the last weight reload sent to the engine (one in flight at most)
        if weight_loaders is None:
            weight_loaders = default_loaders()
        self.weight_loaders = weight_loaders
        self.weight_version = 0  # the version this engine serves (0: the one it started with)
        self.weights_location: str | None = None  # directory of the last good ``files`` version
        self.weights_unusable: str | None = None  # why the weights in the engine cannot be served
        self.last_sync: dict[str, float] = {}  # figures of the last weight sync (seconds, bytes)
        self._capabilities: VllmCapabilities | None = None
        self.spec_decode = AcceptanceCheck(spec_decode_min_acceptance_ratio)
        self._spec_decode_off = False

    async def close(self) -> None:
        await self._http.aclose()

    async def capabilities(self) -> VllmCapabilities:
        """What this engine serves (probed once, each gap logged with what the sidecar does about it:
        :mod:`~llmd_timeslice.snapshot.backends.vllm_capabilities`)."""
        if self._capabilities is None:
            self._capabilities = await probe_capabilities(self._http)
            for line in self._capabilities.problems():
                log.warning("engine %s: %s", self.base_url, line)
        return self._capabilities

    async def reload_weights(self, weights_path: str | None = None, nbytes: int | None = None) -> None:
        """``POST /collective_rpc reload_weights`` (from ``weights_path``, or the model's own path; ``nbytes``: the
        weights' size where known), under the operation's reload deadline (:mod:`~llmd_timeslice.snapshot.backends.deadlines`),
        not the per-call HTTP timeout.

        One reload in flight per engine: a reload still running (its operation ran out of time) is waited for first,
        and one of the same weights that finished after its operation gave up counts for this call instead of a
        second reload. The HTTP call itself has no read timeout: it ends when the engine answers or its connection
        drops (an engine restart), so the engine never gets a second reload while it is still busy with the first.
        Raises BackendError; TimeoutError / cancellation at the operation's deadline leaves the reload running."""
        await self.wait_reload_in_flight(nbytes)
        prior = self._reload
        if prior is not None and prior.finished_unused(weights_path):
            prior.used = True
            log.info("engine %s: the reload of %s outlived its operation and finished: not sent again", self.base_url, prior)
            return
        body: dict = {"method": "reload_weights"}
        if weights_path is not None:
            body["kwargs"] = {"weights_path": weights_path}
        timeout = httpx.Timeout(self.request_timeout_s, read=None)
        # Its own (empty) context: the call outlives this operation and must not write steps into the next one's clock.
        sent = asyncio.get_running_loop().create_task(
            self._post("/collective_rpc", json=body, timeout=timeout), context=contextvars.Context()
        )
        reload = self._reload = _Reload(sent, weights_path)
        with deadlines.current().reloading(nbytes, f"POST /collective_rpc reload_weights ({reload})"):
            await asyncio.shield(reload.task)
        reload.used = True

    async def wait_reload_in_flight(self, nbytes: int | None = None) -> None:
        """Wait (under the reload deadline) for a reload an earlier operation left running; its failure is logged,
        not raised (the caller's own steps find out what state the engine is in)."""
        reload = self._reload
        if reload is None or reload.task.done():
            return
        step = f"waiting for the reload in flight ({reload}, sent {time.monotonic() - reload.started:.1f} s ago)"
        log.warning("engine %s: %s before anything else", self.base_url, step)
        with deadlines.current().reloading(nbytes, step):
            try:
                await asyncio.shield(reload.task)
            except BackendError as exc:
                log.warning("engine %s: the reload in flight failed: %s", self.base_url, exc)

    async def served_weight_version(self) -> str | None:
        """``GET /weight_info`` -> the engine's weight version label (None where the route is absent)."""
        r = await self._get("/weight_info")
        if r.status_code == 404:
            return None
        try:
            return str(r.json()["weight_version"])
        except (ValueError, KeyError) as exc:
            raise BackendError(f"vLLM {self.base_url} /weight_info answered {r.status_code}: {r.text[:200]}") from exc

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
        return (await self._wait_idle())[0]

    async def _wait_idle(self) -> tuple[bool, EngineMetrics]:
        """:meth:`wait_idle`, with the last metrics read."""
        deadline = time.monotonic() + self.idle_timeout_s
        while True:
            m = await self.metrics()
            if m.running + m.waiting == 0:
                return True, m
            if time.monotonic() >= deadline:
                return False, m
            await asyncio.sleep(self.idle_poll_s)

    async def sleep(self, level: int, mode: str | None = None) -> None:
        """``POST /sleep?level=N&mode=M`` (no waiting for idle, no verification); a finished reload no longer counts
        for the next wake after it."""
        await self.wait_reload_in_flight()
        self._reload = None
        await self._post("/sleep", params={"level": level, "mode": mode or self.pause_mode})

    async def suspend(self, mode: SuspendMode, tags: list[str], residual_budget_bytes: int | None = None) -> SuspendResult:
        """Sleep (level 1 for OFFLOAD, 2 for DISCARD) and verify it on every engine core; then handle the requests
        found inside the sleeping engine (docs/snapshot.md, vLLM facts) and check the device memory it still holds against its
        budget
        (``residual_budget_bytes``: the group's for this level; None: the first verified sleep's + margin). Raises
        BackendError (the message says what to do), ``MemoryNotFreed`` over budget."""
        level = 2 if mode is SuspendMode.DISCARD else 1
        if (caps := await self.capabilities()).lora_sleep_unsafe:  # no safe level: refused before the engine is touched
            raise BackendError(f"vLLM {self.base_url}: sleep refused: {caps.lora_sleep_reason()}")
        if level == 2 and caps.lora_reload_broken:
            # Waking from level 2 needs a reload this engine cannot do (vllm_capabilities): level 1 keeps the weights.
            log.warning(
                "engine %s: sleep level 2 (discard) asked; sleeping at level 1 (weights offloaded) instead: %s",
                self.base_url,
                caps.lora_reload_reason(),
            )
            level = 1
        idle, idle_metrics = await self._wait_idle()
        if not idle:
            log.warning(
                "engine %s still busy after %.1f s; sleeping with mode=%s", self.base_url, self.idle_timeout_s, self.pause_mode
            )
        if (
            self.probe
            and idle
            and self.weight_version not in self.probe_references
            and not self.weights_unusable
            and not await self.is_suspended()
        ):
            # It has been serving this version: its answers are the reference. Only when idle: on a busy engine the
            # probe would wait for the running batch and delay the sleep (the next verified wake records it then).
            tokens, acceptance = await self._probe_tokens_measured()
            self.probe_references[self.weight_version] = tokens
            self.spec_decode.observe(self.weight_version, acceptance)  # the version's reference acceptance
        before = await self.memory.before_sleep()
        await self.sleep(level)
        self.level = level
        if not await self.is_suspended():
            raise BackendError(
                f"vLLM {self.base_url} answered /sleep with 200 but /is_sleeping says awake; "
                "the engine is left out of service: check its logs, then retry the snapshot"
            )
        if idle and self.pause_mode == "wait":
            # The usual switch: nothing ran when the sleep began, so the sleep aborted nothing and the abort counter
            # read before it is the baseline; one metrics read after the abort of parked requests then both verifies
            # every engine core's sleep state and counts what the abort ended (one engine call fewer).
            answer = await self._abort_parked()
            m = await self.metrics()
            self._check_sleep_state(m, level)
            parked, action = await self._count_parked(answer, int(m.waiting), idle_metrics.aborted_total, m)
        else:
            m = await self.metrics()
            self._check_sleep_state(m, level)
            parked, action = await self._handle_parked(m)
        residual = await self.memory.after_sleep(before, level, residual_budget_bytes, f"vLLM {self.base_url}")
        return SuspendResult(
            device_bytes_freed=None if residual is None else residual.freed,
            parked_requests=parked,
            parked_action=action,
            residual=residual,
        )

    def _check_sleep_state(self, m: EngineMetrics, level: int) -> None:
        """``vllm:engine_sleep_state`` of every engine core in ``m`` must be the state of sleep ``level``."""
        bad = m.engines_not_in(SLEEP_STATE_FOR_LEVEL[level])
        if bad:
            raise BackendError(
                f"vLLM {self.base_url}: vllm:engine_sleep_state after sleep level {level} (expected "
                f"{SLEEP_STATE_FOR_LEVEL[level]!r} on every engine): {describe_engines(bad)}; the "
                "engine is left out of service"
            )

    async def _handle_parked(self, m: EngineMetrics) -> tuple[int, str]:
        """Requests inside the engine right after its verified sleep (``m``: the metrics read then): ``(count,
        "aborted" | "kept" | "")`` (docs/snapshot.md, vLLM facts).
        Raises BackendError when requests are inside and cannot be aborted
        (the engine is woken again so they finish)."""
        # The engine's last published counts: its queue is exact for requests that arrived before its last step
        # (queued requests are not scheduled while paused); its running count may still show the batch the sleep
        # drained (counts are made before a step ends), so it counts only where requests are frozen (keep).
        queued = int(m.waiting)
        if self.pause_mode == "keep":
            frozen = int(m.running) + queued
            if frozen:
                log.warning(
                    "engine %s sleeps with %d request(s) frozen inside (pause mode keep): they resume on wake",
                    self.base_url,
                    frozen,
                )
            return frozen, "kept" if frozen else ""
        return await self._count_parked(await self._abort_parked(), queued, m.aborted_total, None)

    async def _abort_parked(self) -> httpx.Response:
        """``POST /pause?mode=abort&clear_cache=false`` on the sleeping engine (docs/snapshot.md, vLLM facts); its answer."""
        try:
            r = await self._http.post("/pause", params={"mode": "abort", "clear_cache": "false"})
        except httpx.HTTPError as exc:
            raise BackendError(
                f"vLLM {self.base_url} did not answer POST /pause?mode=abort after the sleep: {exc!r}; "
                "requests may be waiting inside the sleeping engine: the endpoint stays out of "
                "service"
            ) from exc
        await self._raise_if_core_dead("POST", "/pause", r)
        return r

    async def _count_parked(
        self, r: httpx.Response, queued: int, aborted_before: float, after: EngineMetrics | None
    ) -> tuple[int, str]:
        """What the abort (answer ``r``) ended: the rise of the abort counter over ``aborted_before``, read from
        ``after`` (metrics read after the abort; None: read them now), else ``queued``. Raises BackendError when the
        engine has no abort route and ``queued`` requests are inside (it is woken again so they finish)."""
        if r.status_code == 200:
            aborted = int((after or await self.metrics()).aborted_total - aborted_before)
            deadline = time.monotonic() + 0.5
            while aborted < queued and time.monotonic() < deadline:  # abort outputs still being processed
                await asyncio.sleep(self.idle_poll_s)
                aborted = int((await self.metrics()).aborted_total - aborted_before)
            count = aborted or queued  # the counter when it moved; else the queue (its outputs may still be on the way)
            if count:
                log.warning(
                    "engine %s: %d request(s) reached the engine after the drain and waited inside it while "
                    "asleep; aborted them (finish_reason abort) instead of leaving them hanging until the "
                    "next wake (abort counter +%d, engine queue %d)",
                    self.base_url,
                    count,
                    aborted,
                    queued,
                )
            return count, "aborted" if count else ""
        if r.status_code == 404 and queued == 0:
            return 0, ""  # no pause route (not dev mode), and nothing queued inside
        await self._post("/wake_up")  # they finish now rather than hang until the next wake
        self.level = None
        raise BackendError(
            f"vLLM {self.base_url}: {queued or 'some'} request(s) are queued inside the sleeping engine "
            f"and POST /pause?mode=abort answered {r.status_code} (VLLM_SERVER_DEV_MODE=1 serves it); "
            "woke the engine again so they finish, and the sleep fails: retry the switch"
        )

    async def _current_level(self) -> int | None:
        if self.level is None:  # e.g. the sidecar restarted while the engine slept: ask the engine
            state = (await self.metrics()).sleep_state  # None when the engine cores disagree: unknown
            self.level = {v: k for k, v in SLEEP_STATE_FOR_LEVEL.items()}.get(state or "")
        return self.level

    async def _verify_still_asleep(self, step: str) -> None:
        if not await self.is_suspended():
            raise BackendError(
                f"vLLM {self.base_url}: /is_sleeping says awake after {step}, but the kv cache is not "
                "woken yet; the endpoint stays out of service"
            )

    async def resume(self, tags: list[str]) -> None:
        """Wake up. ``tags`` empty: the whole sequence; ``["weights"]`` then ``["kv_cache"]``: in two steps.

        After a level-2 sleep, the weights step also reloads the weights and the kv_cache step resets
        the prefix cache (docs/snapshot.md, vLLM facts).
        """
        await self.wait_reload_in_flight()  # one reload in flight: the engine is busy with it until it ends
        tags = list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise BackendError(f"unknown vLLM wake-up tags {sorted(unknown)}; known: weights, kv_cache")
        level = await self._current_level()
        if level is None and not tags:
            await self._refuse_another_clients_pause()
        if (level == 2 or self.weights_unusable is not None) and not tags:
            tags = ["weights", "kv_cache"]  # a discarded engine needs its weights reloaded in between
        reloaded = False
        kv_discarded = level is not None  # asleep at level 1 or 2: its KV cache was freed (docs/snapshot.md, vLLM facts)
        if not tags:
            await self._post("/wake_up")
        if "weights" in tags:
            await self._post("/wake_up", params={"tags": "weights"})
            if self.weights_unusable is not None or (level == 2 and self.reload):
                await self._verify_still_asleep("wake_up?tags=weights")
                await self._reload_last_good()
                reloaded = True
            if "kv_cache" not in tags:
                await self._verify_still_asleep("wake_up?tags=weights")
                return  # a partial wake: the caller wakes kv_cache next
        if "kv_cache" in tags:
            await self._post("/wake_up", params={"tags": "kv_cache"})
        if (kv_discarded or reloaded) and self.reset_prefix_cache and (not tags or "kv_cache" in tags):
            await self._reset_after_wake()
        await self._verify_awake()

    async def _reload_last_good(self) -> None:
        """Reload the last good version (after a level-2 sleep or a failed load).

        A ``files`` version is checked against its manifest again first (its directory may have been rewritten
        since it loaded; on vLLM 0.32 a failed reload kills the engine core). Raises BackendError when no version
        can be reloaded from files or the last good version's files no longer match their manifest."""
        caps = await self.capabilities()
        if caps.lora_reload_broken:  # e.g. put to level 2 by another client: only a restart brings its weights back
            raise BackendError(
                f"vLLM {self.base_url} needs its weights reloaded (discarded by a level-2 sleep), but "
                f"{caps.lora_reload_reason()}; the engine stays out of service: restart it (or its pod)"
            )
        if self.weights_unusable is not None and self.weights_location is None and self.weight_version:
            raise BackendError(
                f"vLLM {self.base_url}: {self.weights_unusable}; no earlier version can be reloaded "
                "from files, so the engine stays out of service: publish a weight version again"
            )
        nbytes = None
        if self.weights_location is not None:
            try:
                nbytes = await asyncio.to_thread(verify_weights, self.weights_location, self.weight_version or None)
            except WeightManifestError as exc:
                raise BackendError(
                    f"vLLM {self.base_url}: the last good weight version's files changed since it "
                    f"loaded ({exc}); not reloaded, the engine stays out of service: publish a weight "
                    "version again"
                ) from None
        await self.reload_weights(self.weights_location, nbytes)
        self.weights_unusable = None

    async def resume_with_weights(self, tags: list[str], weights: WeightUpdate) -> None:
        """Wake, loading weight version ``weights`` between the weights and kv_cache wake-ups (docs/snapshot.md, vLLM facts).

        ``tags`` must be empty (the whole sequence). Raises :class:`WeightVersionRejected` when the version
        cannot be loaded (unknown source, its files fail verification, the load fails: the engine stays
        asleep, its weights marked unusable, and a plain :meth:`resume` reloads the last good version), or
        BackendError when a wake-up step fails or the engine does not serve the version afterwards.
        ``last_sync`` gets the figures (``load_s``, ``total_s``, ``bytes``).
        """
        if tags:
            raise BackendError("a weight sync wakes the whole engine; send no wake-up tags with it")
        loader = self.weight_loaders.get(weights.source)
        if loader is None:
            raise WeightVersionRejected(
                f"vLLM backend has no loader for weight source {weights.source!r}; known: {sorted(self.weight_loaders)}"
            )
        caps = await self.capabilities()
        if caps.lora_reload_broken:  # refused before the engine is touched: it keeps serving its weights on a wake
            raise WeightVersionRejected(
                f"vLLM {self.base_url}: weight version {weights.version} refused: {caps.lora_reload_reason()}"
            )
        t0 = time.perf_counter()
        await self.wait_reload_in_flight()
        if self.level is None:  # state unknown (a repair, a restarted sidecar): never lift another client's pause
            await self._refuse_another_clients_pause()
        if not await self.is_suspended():
            # Awake (e.g. reconciled after a restart): pause it the verified way first.
            await self.suspend(SuspendMode.OFFLOAD, [])
        await self._post("/wake_up", params={"tags": "weights"})
        await self._verify_still_asleep("wake_up?tags=weights")
        old = self.weight_version
        t1 = time.perf_counter()
        try:
            nbytes = await loader.load(self, weights)
        except BackendError as exc:
            self.weights_unusable = f"loading weight version {weights.version} failed ({exc})"
            raise WeightVersionRejected(
                f"vLLM {self.base_url}: loading weight version {weights.version} failed; "
                f"the engine stays asleep (last good version {old}, reloaded by a plain "
                f"restore): {exc}"
            ) from None
        load_s = time.perf_counter() - t1
        self.weights_unusable = None
        self.weight_version = weights.version
        if weights.source == "files":
            self.weights_location = weights.location
        r = await self._http.post("/update_weight_version", json={"new_version": str(weights.version)})
        if r.status_code not in (200, 404):  # 404: a vLLM without the RL routes; our record stands
            raise BackendError(f"vLLM POST /update_weight_version answered {r.status_code}: {r.text[:200]}")
        await self._post("/wake_up", params={"tags": "kv_cache"})
        await self._reset_prefix_cache()  # cached prefixes were computed with the old weights
        await self._verify_awake()
        served = await self.served_weight_version()
        if served is not None and served != str(weights.version):
            raise BackendError(
                f"vLLM {self.base_url} reports weight version {served!r} after loading "
                f"{weights.version}; the endpoint stays out of service"
            )
        self.last_sync = {"load_s": load_s, "total_s": time.perf_counter() - t0, "bytes": float(nbytes or 0)}

    async def _reset_after_wake(self) -> None:
        """After a wake whose KV cache was discarded: ``POST /reset_prefix_cache`` where the engine's route table has
        it (docs/snapshot.md, vLLM facts, "Prefix cache after a wake"); without the route, one warning."""
        if (await self.capabilities()).has("/reset_prefix_cache"):
            await self._reset_prefix_cache()
        else:
            log.warning(
                "engine %s serves no /reset_prefix_cache (start it with VLLM_SERVER_DEV_MODE=1): its prefix cache is "
                "not reset after the wake, cached prefixes may point at discarded KV blocks (vllm#17103)",
                self.base_url,
            )

    async def _reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache``, verified by its answer (docs/snapshot.md, vLLM facts):
        refused -> reset with running requests
        preempted; refused again -> BackendError (the endpoint stays out of service)."""
        answers = []
        for params in ({}, {"reset_running_requests": "true"}):
            r = await self._http.post("/reset_prefix_cache", params=params)
            try:
                body = r.json() if r.content else {}
            except ValueError:
                body = {}
            success = body.get("success", r.status_code == 200) if isinstance(body, dict) else r.status_code == 200
            if r.status_code == 200 and success:
                if params:
                    log.warning(
                        "engine %s: prefix cache reset refused while requests held cache blocks; reset with "
                        "those requests preempted (they recompute with the new weights)",
                        self.base_url,
                    )
                return
            answers.append(f"{r.status_code} {r.text[:120]!r}" + (" with reset_running_requests=true" if params else ""))
        raise BackendError(
            f"vLLM {self.base_url} refused to reset its prefix cache after the weights changed "
            f"({'; then '.join(answers)}): cached prefixes computed with the old weights would be served, "
            "so the endpoint stays out of service; retry the restore once its requests are done"
        )

    async def _verify_awake(self) -> None:
        """After a full wake: awake on every engine core, not paused (docs/snapshot.md, vLLM facts,
        "Paused after a wake"), probe."""
        sleeping = await self.is_suspended()
        m = await self.metrics()
        bad = m.engines_not_in("awake")
        if sleeping and (bad or not m.sleep_states):
            raise BackendError(
                f"vLLM {self.base_url} answered /wake_up with 200 but /is_sleeping still says "
                "asleep; the endpoint stays out of service: check the engine's logs, then retry the "
                "restore"
            )
        if bad:
            raise BackendError(
                f"vLLM {self.base_url}: vllm:engine_sleep_state after wake-up (expected 'awake' on every "
                f"engine): {describe_engines(bad)}; the endpoint stays out of service"
            )
        self.level = None  # awake on every engine core
        if sleeping:  # ... yet /is_sleeping says asleep: a paused scheduler?
            await self._check_not_paused()
        if self.probe:
            await self._probe()

    async def _is_paused(self) -> bool | None:
        """``GET /is_paused`` -> ``{"is_paused": bool}`` (vLLM 0.32 dev mode; None where the route is absent)."""
        r = await self._get("/is_paused")
        if r.status_code == 404:
            return None
        try:
            return bool(r.json()["is_paused"])
        except (ValueError, KeyError, TypeError) as exc:
            raise BackendError(f"vLLM {self.base_url} /is_paused answered {r.status_code}: {r.text[:200]}") from exc

    def _paused(self) -> EnginePaused:
        return EnginePaused(
            f"vLLM {self.base_url} is awake but its scheduler is paused (GET /is_paused: true): a POST /pause "
            "without the matching POST /resume, e.g. another client's weight update (vLLM 0.32 lifts the pause of "
            "its own sleep on a full wake-up); requests sent to it would wait. Not resumed here: resuming another "
            "client's pause could serve weights in the middle of its update. The endpoint stays out of service; "
            "the repair loop serves it again once that client sends POST /resume"
        )

    async def _check_not_paused(self) -> None:
        """Every engine core reports awake but ``/is_sleeping`` says asleep: on vLLM 0.32 a paused scheduler
        (``EngineCore.is_sleeping`` = scheduler paused or executor asleep, ``vllm/v1/engine/core.py``). Raises
        :class:`EnginePaused` when ``GET /is_paused`` confirms it, else BackendError (docs/snapshot.md, vLLM facts)."""
        paused = await self._is_paused()
        if paused:
            raise self._paused()
        raise BackendError(
            f"vLLM {self.base_url}: every engine core reports 'awake' but /is_sleeping says asleep and "
            f"/is_paused says {'not paused' if paused is False else 'nothing (no route)'}; the endpoint "
            "stays out of service: check the engine's logs, then retry the restore"
        )

    async def _refuse_another_clients_pause(self) -> None:
        """Before waking an engine of unknown state that reports awake: on vLLM 0.32 ``/wake_up`` resumes a paused
        scheduler (``EngineCore.wake_up``), so an engine paused by another client is left as it is
        (:class:`EnginePaused`) rather than resumed behind that client's back."""
        if (await self.metrics()).sleep_state == "awake" and await self._is_paused():
            raise self._paused()
