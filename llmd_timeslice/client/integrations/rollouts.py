"""Rollouts through the router with OpenAI-API clients: weight versions and the gate's refusals.

The gate (docs/gate.md) reads one request header and answers with three response headers:

* ``x-llmd-timeslice-min-weight-version: N`` (request): hold until an endpoint at weight version >= N serves;
* ``x-llmd-timeslice-weight-version`` (response): the weight version of the endpoint that served the request;
* ``x-llmd-timeslice-reason`` (response, on refusals): ``hold_queue_full`` (429, ``retry-after: 1``),
  ``hold_expired`` (503, ``retry-after: 5``), ``gate_shutting_down`` (503, ``retry-after: 1``),
  ``gate_unavailable`` (503, ``retry-after: 1``: Envoy could not reach the gate), ``unknown_pool`` (503, a
  configuration error), ``bad_min_weight_version`` (400).

:class:`TimeSliceRollouts` builds ``openai.OpenAI`` / ``openai.AsyncOpenAI`` clients (or plain ``httpx`` clients
for other libraries) whose HTTP transport

1. adds the minimum weight version of the current iteration to every request (a request that already carries
   the header keeps its own);
2. retries a request the gate refused for a *retryable* reason after the ``retry-after`` the gate sent, for as
   long as :attr:`GateRetryPolicy.budget_s` allows (a training phase may outlast the gate's hold limit many
   times), and marks the final answer to a gate refusal ``x-should-retry: false`` so the SDK does not add its own
   retries on top (the ``openai`` SDK obeys that header in ``_should_retry``; without this helper it retries a
   429/503 twice, waiting the ``retry-after`` up to 60 s, then raises: measured in docs/integrations.md); errors
   that are not the gate's (no reason header: a connection reset, an engine's 500) are left to the SDK's own
   retries;
3. repeats, with exponential back-off within the same budget, the llm-d EPP's answers that mean "wait"
   (``x-llm-d-request-dropped-reason``: ``rejected-ttl-expired``, 429 from llm-d-router v0.10.0 and 503 before;
   ``rejected-no-endpoints``; ``rejected-shutting-down``), and returns any other EPP refusal
   (``rejected-saturated``, an unknown reason) at once as a typed refusal, ``x-should-retry: false``, never
   repeated blindly (:mod:`~llmd_timeslice.client.integrations.refusals` has both vocabularies, by version);
4. records every request (:class:`RolloutRecord`): the version it asked for, the version that served it, the
   refusals it met, its final status and the typed refusal of a refused answer (:attr:`RolloutRecord.refusal`),
   grouped per rollout by :meth:`TimeSliceRollouts.rollout`.

The ``openai`` SDK takes an ``httpx`` client as ``http_client`` (openai 2.x is built on ``httpx``; openai 3.x on
``httpx2`` and still accepts ``httpx`` clients: ``openai/_httpx2.py``), so nothing of the SDK is patched.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
from tenacity import AsyncRetrying, RetryCallState, Retrying

from llmd_timeslice.client.integrations.refusals import ROUTER_KNOWN_REASONS, ROUTER_RETRYABLE_REASONS, Refusal, refusal_of
from llmd_timeslice.protocol import HOLD_MS_HEADER, MIN_WEIGHT_VERSION_HEADER, WEIGHT_VERSION_HEADER

log = logging.getLogger(__name__)

SHOULD_RETRY_HEADER = "x-should-retry"
"""Read by the ``openai`` SDK (``_base_client.py``, ``_should_retry``): ``false`` means do not retry."""

RETRYABLE_REASONS = frozenset({"hold_expired", "hold_queue_full", "gate_shutting_down", "gate_unavailable", "drain_deadline"})
"""Gate refusals worth repeating: the pool is busy or training, this gate replica is stopping, Envoy could not
reach the gate (``gate_unavailable``: written by Envoy's local-reply mapping, docs/gate.md "When the gate is down"),
or a drain deadline cut the request before its response started (``drain_deadline``: never forwarded to the engine,
docs/gate.md "Drain deadline")."""
KNOWN_REASONS = RETRYABLE_REASONS | {"unknown_pool", "bad_min_weight_version"}


@dataclass(frozen=True)
class GateRetryPolicy:
    """How long to keep repeating requests the gate refused.

    Args:
        budget_s: seconds from a request's first attempt after which a refusal is returned to the caller (the
            caller's deadline for riding out refusals).
        reasons: gate refusal reasons that are retried (default :data:`RETRYABLE_REASONS`).
        router_reasons: the EPP's ``x-llm-d-request-dropped-reason`` values that are retried (default
            :data:`~llmd_timeslice.client.integrations.refusals.ROUTER_RETRYABLE_REASONS`); any other EPP refusal
            is returned at once.
        default_delay_s: wait when a gate refusal carries no ``retry-after``; the first wait after an EPP refusal.
        backoff_multiplier: each further EPP refusal of one request waits this many times longer (the EPP sends no
            ``retry-after``).
        max_delay_s: upper bound of one wait, whatever ``retry-after`` or the back-off says.
    """

    budget_s: float = 900.0
    reasons: frozenset[str] = RETRYABLE_REASONS
    router_reasons: frozenset[str] = ROUTER_RETRYABLE_REASONS
    default_delay_s: float = 1.0
    backoff_multiplier: float = 2.0
    max_delay_s: float = 30.0

    def __post_init__(self) -> None:
        if self.budget_s < 0 or self.default_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("budget_s, default_delay_s and max_delay_s are seconds >= 0")
        if not self.backoff_multiplier >= 1:
            raise ValueError(f"backoff_multiplier must be >= 1, got {self.backoff_multiplier!r}")
        unknown = set(self.reasons) - KNOWN_REASONS
        if unknown:
            raise ValueError(f"unknown gate refusal reason(s) {sorted(unknown)}; known: {', '.join(sorted(KNOWN_REASONS))}")
        unknown = set(self.router_reasons) - ROUTER_KNOWN_REASONS
        if unknown:
            raise ValueError(
                f"unknown router refusal reason(s) {sorted(unknown)}; known: {', '.join(sorted(ROUTER_KNOWN_REASONS))}"
            )

    def delay(self, response: httpx.Response, started: float, now: float, router_refusals: int = 1) -> float | None:
        """Seconds to wait before repeating a refused request, or None to return the refusal. ``router_refusals``:
        how many EPP refusals this request met so far, this one included (the back-off's exponent)."""
        refusal = refusal_of(response)
        if refusal is None:
            return None
        if refusal.source == "gate":
            if refusal.reason not in self.reasons:
                return None
            fallback = self.default_delay_s
        else:
            if refusal.reason not in self.router_reasons:
                return None
            fallback = self.default_delay_s * self.backoff_multiplier ** max(0, router_refusals - 1)
        try:
            wait = float(response.headers.get("retry-after", ""))
        except ValueError:
            wait = fallback
        wait = min(max(wait, 0.0), self.max_delay_s)
        return wait if now - started + wait <= self.budget_s else None


@dataclass
class RolloutRecord:
    """One request through the router (after the helper's retries). Times in seconds."""

    rollout: str | None
    method: str
    path: str
    min_weight_version: int | None
    served_weight_version: int | None = None
    status: int = 0
    attempts: int = 0
    refusals: list[str] = field(default_factory=list)
    hold_ms: int | None = None
    retry_wait_s: float = 0.0
    error: str = ""
    refusal: Refusal | None = None
    """The final answer's refusal (gate or router; None when it was not refused), to report."""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def below_requested(self) -> bool:
        """Served by an endpoint older than the version the request asked for."""
        return (
            self.ok
            and self.min_weight_version is not None
            and (self.served_weight_version is None or self.served_weight_version < self.min_weight_version)
        )


class RolloutScope:
    """The requests of one rollout (see :meth:`TimeSliceRollouts.rollout`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.records: list[RolloutRecord] = []

    @property
    def weight_versions(self) -> list[int | None]:
        return [r.served_weight_version for r in self.records]

    @property
    def served_weight_version(self) -> int | None:
        """The oldest weight version that answered any request of this rollout (None: none answered)."""
        versions = [v for v in self.weight_versions if v is not None]
        return min(versions) if versions else None


_SCOPE: contextvars.ContextVar[RolloutScope | None] = contextvars.ContextVar("llmd_timeslice_rollout", default=None)


class TimeSliceRollouts:
    """OpenAI-API clients for rollouts through the router, aware of weight versions and gate refusals.

    Args:
        router_url: the router (Envoy) URL, e.g. ``http://127.0.0.1:8080``; ``/v1`` is appended for the SDK.
        min_weight_version: the weight version every request asks for: an int, a callable read at each request
            (e.g. ``lambda: callback.weight_version``), or None (no header). Change it per iteration with
            :attr:`min_weight_version`.
        retry: the gate retry policy.
        api_key: sent as bearer token by the SDK (vLLM ignores it unless started with ``--api-key``).
        timeout_s: per-attempt HTTP timeout (a held request waits up to the gate's hold limit).
        max_retries: the SDK's own retry count for errors that are not gate refusals.

    Raises:
        ValueError: a negative or non-integer minimum weight version.
    """

    def __init__(
        self,
        router_url: str,
        *,
        min_weight_version: int | Callable[[], int] | None = None,
        retry: GateRetryPolicy | None = None,
        api_key: str = "EMPTY",
        timeout_s: float = 600.0,
        max_retries: int = 2,
    ) -> None:
        base = router_url.rstrip("/")
        self.router_url = base.removesuffix("/v1")
        self.base_url = self.router_url + "/v1"
        self.retry = retry or GateRetryPolicy()
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self._min: int | Callable[[], int] | None = None
        self.min_weight_version = min_weight_version
        self._lock = threading.Lock()
        self.records: list[RolloutRecord] = []
        self._ids = itertools.count()

    @property
    def min_weight_version(self) -> int | None:
        """The weight version requests ask for now (None: no header)."""
        value = self._min() if callable(self._min) else self._min
        return None if value is None else _check_version(value)

    @min_weight_version.setter
    def min_weight_version(self, value: int | Callable[[], int] | None) -> None:
        if value is not None and not callable(value):
            _check_version(value)
        self._min = value

    @contextlib.contextmanager
    def rollout(self, name: str | None = None) -> Iterator[RolloutScope]:
        """Group the requests made inside the block (this thread or asyncio task and what it starts) as one
        rollout: ``with rollouts.rollout("ex-3") as r: ...; r.served_weight_version``."""
        scope = RolloutScope(name or f"rollout-{next(self._ids)}")
        token = _SCOPE.set(scope)
        try:
            yield scope
        finally:
            _SCOPE.reset(token)

    def by_rollout(self) -> dict[str | None, list[RolloutRecord]]:
        out: dict[str | None, list[RolloutRecord]] = {}
        with self._lock:
            for r in self.records:
                out.setdefault(r.rollout, []).append(r)
        return out

    def failed(self) -> list[RolloutRecord]:
        with self._lock:
            return [r for r in self.records if not r.ok]

    def below_requested(self) -> list[RolloutRecord]:
        with self._lock:
            return [r for r in self.records if r.below_requested]

    # -- clients ---------------------------------------------------------------------------------------------
    def http_client(self, **kw) -> httpx.Client:
        """A plain ``httpx.Client`` with the gate-aware transport (for libraries that take one)."""
        return httpx.Client(transport=GateTransport(self, httpx.HTTPTransport()), timeout=self.timeout_s, **kw)

    def async_http_client(self, **kw) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=AsyncGateTransport(self, httpx.AsyncHTTPTransport()), timeout=self.timeout_s, **kw)

    def openai(self, **kw):
        """An ``openai.OpenAI`` client on the router (extra keyword arguments go to its constructor)."""
        import openai

        return openai.OpenAI(
            base_url=self.base_url, api_key=self.api_key, max_retries=self.max_retries, http_client=self.http_client(), **kw
        )

    def async_openai(self, **kw):
        """An ``openai.AsyncOpenAI`` client on the router."""
        import openai

        return openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, max_retries=self.max_retries, http_client=self.async_http_client(), **kw
        )

    # -- transport side --------------------------------------------------------------------------------------
    def _prepare(self, request: httpx.Request) -> RolloutRecord:
        asked = request.headers.get(MIN_WEIGHT_VERSION_HEADER)
        if asked is None:
            version = self.min_weight_version
            if version is not None:
                request.headers[MIN_WEIGHT_VERSION_HEADER] = str(version)
        else:
            version = _parse_int(asked)
        scope = _SCOPE.get()
        return RolloutRecord(
            rollout=scope.name if scope else None, method=request.method, path=request.url.path, min_weight_version=version
        )

    def _finish(self, record: RolloutRecord, response: httpx.Response | None, error: BaseException | None) -> None:
        if response is not None:
            record.status = response.status_code
            record.served_weight_version = _parse_int(response.headers.get(WEIGHT_VERSION_HEADER))
            record.hold_ms = _parse_int(response.headers.get(HOLD_MS_HEADER))
            record.refusal = refusal_of(response, read_body=True)
            if record.refusal is not None:
                response.headers[SHOULD_RETRY_HEADER] = "false"  # the helper already retried what was worth it
        if error is not None:
            record.error = f"{type(error).__name__}: {error}"
        scope = _SCOPE.get()
        if scope is not None:
            scope.records.append(record)
        with self._lock:
            self.records.append(record)
        if record.refusals:
            log.info(
                "%s %s: %d refusal(s) %s, then %s",
                record.method,
                record.path,
                len(record.refusals),
                ",".join(record.refusals),
                record.status or record.error,
            )


def _check_version(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"min_weight_version must be an integer >= 0, got {value!r}")
    return value


def _parse_int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _refusal(response: httpx.Response) -> str | None:
    refusal = refusal_of(response)
    return refusal.reason if refusal is not None else None


class _Refusals:
    """tenacity's ``retry`` and ``wait`` for one request: repeat a gate refusal for as long as the policy gives a
    wait (the ``retry-after`` the gate sent, within the budget), then wait that long."""

    def __init__(self, policy: GateRetryPolicy, record: RolloutRecord) -> None:
        self.policy, self.record = policy, record
        self.started = time.monotonic()
        self.next_wait = 0.0
        self.router_refusals = 0

    def attempted(self, response: httpx.Response) -> httpx.Response:
        self.record.attempts += 1
        refusal = refusal_of(response)
        if refusal is not None:
            self.record.refusals.append(refusal.reason)
            self.router_refusals += refusal.source == "router"
        return response

    def retry(self, state: RetryCallState) -> bool:
        if state.outcome is None or state.outcome.failed:
            return False  # a transport error: raised to the caller as it is
        response = state.outcome.result()
        wait = self.policy.delay(response, self.started, time.monotonic(), self.router_refusals) if _refusal(response) else None
        if wait is None:
            return False
        self.next_wait = wait
        return True

    def wait(self, state: RetryCallState) -> float:
        self.record.retry_wait_s += self.next_wait
        return self.next_wait


class GateTransport(httpx.BaseTransport):
    """Synchronous ``httpx`` transport: weight-version header, gate-aware retries, records (see module doc)."""

    def __init__(self, owner: TimeSliceRollouts, inner: httpx.BaseTransport) -> None:
        self.owner, self.inner = owner, inner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        record = self.owner._prepare(request)
        refusals = _Refusals(self.owner.retry, record)

        def discard(state: RetryCallState) -> None:  # a refused answer about to be repeated
            if state.outcome is not None:
                response = state.outcome.result()
                response.read()
                response.close()

        try:
            response = Retrying(retry=refusals.retry, wait=refusals.wait, before_sleep=discard, reraise=True)(
                lambda: refusals.attempted(self.inner.handle_request(request))
            )
            if _refusal(response) is not None:
                response.read()
        except BaseException as exc:
            self.owner._finish(record, None, exc)
            raise
        self.owner._finish(record, response, None)
        return response

    def close(self) -> None:
        self.inner.close()


class AsyncGateTransport(httpx.AsyncBaseTransport):
    """asyncio variant of :class:`GateTransport`."""

    def __init__(self, owner: TimeSliceRollouts, inner: httpx.AsyncBaseTransport) -> None:
        self.owner, self.inner = owner, inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        record = self.owner._prepare(request)
        refusals = _Refusals(self.owner.retry, record)

        async def discard(state: RetryCallState) -> None:  # a refused answer about to be repeated
            if state.outcome is not None:
                response = state.outcome.result()
                await response.aread()
                await response.aclose()

        async def attempt() -> httpx.Response:
            return refusals.attempted(await self.inner.handle_async_request(request))

        try:
            response: httpx.Response = await AsyncRetrying(
                retry=refusals.retry, wait=refusals.wait, before_sleep=discard, reraise=True
            )(attempt)
            if _refusal(response) is not None:
                await response.aread()
        except BaseException as exc:
            self.owner._finish(record, None, exc)
            raise
        self.owner._finish(record, response, None)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()
