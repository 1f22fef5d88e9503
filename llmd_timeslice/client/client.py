"""TimeSlice client: acquire/yield a group's accelerators from inside an RL loop.

Names match the upstream llm-d client where they overlap: ``TimeSliceOrchestratorClient(target,
job_id=None, group_id=None, channel_options=None)``, ``acquire()`` -> ``AcquireResult(success,
waited_ms, context_restored)``, ``release()`` -> ``YieldResult(success, pending_waiters,
snapshot_deferred)`` (``yield`` is a keyword), ``on_accelerators(job_id, group_id, timeout_sec)``
as context manager and decorator. Configuration falls back to the environment:
``TIMESLICE_ORCH_ADDR``, ``TIMESLICE_JOB_ID``, ``TIMESLICE_TRAINER_GROUP``, ``TIMESLICE_SAMPLER_GROUP``
(for ``on_both_groups``, which takes the trainer group before the sampler group); the bearer token to
``LLMD_TIMESLICE_TOKEN(_FILE)``. A refused token raises :class:`AuthError`, whose message says where the
client took its token from (or where it looked when it found none).
Calls are retried on UNAVAILABLE (service config on the upstream service
name, exponential back-off, 5 attempts); ``channel_options`` take precedence over the client's own
(``[("grpc.enable_retries", 0)]``: one attempt).

A ``state`` offloader (e.g. :class:`~llmd_timeslice.client.torch_offload.TorchStateOffloader`)
passed to ``on_accelerators`` is restored right after the grant and offloaded right before the
yield, so trainer state is resident exactly while the lease is held.

Yield requests (issue 26): while held traffic of a priority band nears its hold deadline, the orchestrator
marks the holder's lease (``Lease.yield_requested``). The client learns it from the heartbeat answers it
already gets (every ``min(ttl/3, 1 s)``): :meth:`~_JobAndGroup.yield_requested` reads it,
:meth:`~_JobAndGroup.on_yield_requested` registers a callback called once per request, and
``wait_yield_requested`` blocks (sync) or awaits (asyncio) until one comes. Yielding stays the holder's call:
release at the next safe point (the phase callback does it at its next step boundary).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
from collections.abc import Coroutine, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from llmd_timeslice import auth, tls
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import lease_pb2, lease_pb2_grpc, weights_pb2, weights_pb2_grpc
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as pb
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as pb_grpc
from llmd_timeslice.client import loop_thread
from llmd_timeslice.client.errors import (
    AcquireTimeout,
    AuthError,
    InvalidArgument,
    LeaseError,
    LeaseLost,
    LockOrderViolation,
    NotHolder,
    OrchestratorUnavailable,
    StaleFencingToken,
    StaleWeightVersion,
    SwitchFailed,
    TimeSliceError,
    UnknownGroup,
)
from llmd_timeslice.client.errors import translate as _translate
from llmd_timeslice.client.lease_renewal import (  # noqa: F401 - YieldRequested, YIELD_POLL_S: public here
    YIELD_POLL_S,
    YieldCallback,
    YieldRequested,
    _AsyncHeartbeat,
    _LeaseRenewal,
)
from llmd_timeslice.weights.update import WeightUpdate

_log = logging.getLogger(__name__)

__all__ = [
    "AcquireResult",
    "AcquireTimeout",
    "AsyncTimeSliceOrchestratorClient",
    "AuthError",
    "InvalidArgument",
    "LeaseError",
    "LeaseLost",
    "LockOrderViolation",
    "NotHolder",
    "OrchestratorUnavailable",
    "StaleFencingToken",
    "StaleWeightVersion",
    "SwitchFailed",
    "TimeSliceError",
    "TimeSliceOrchestratorClient",
    "UnknownGroup",
    "YieldRequested",
    "YieldResult",
]

DEFAULT_TARGET = "127.0.0.1:50051"
FENCING_TOKEN_METADATA = "x-llmd-timeslice-fencing-token"  # same as llmd_timeslice.orchestrator.service
WEIGHT_SYNC_ERROR_METADATA = "x-llmd-timeslice-weight-sync-error"  # same as llmd_timeslice.orchestrator.service
# An acquire's phase-profile hints (same as llmd_timeslice.orchestrator.placement_watch; docs/placement.md)
PHASE_METADATA = "x-llmd-timeslice-phase"
ACCELERATORS_METADATA = "x-llmd-timeslice-accelerators"
STATE_BYTES_METADATA = "x-llmd-timeslice-state-bytes"
PHASES = ("rollout", "train")
"""The phases an acquire may name (the accelerator phases of a job's phase profile)."""


def _hints(phase: str | None, accelerators: int | None, state_bytes: int | None) -> tuple[tuple[str, str], ...]:
    """An acquire's metadata: what the job says of the phase it acquires for (raises ValueError for a bad phase)."""
    if phase is not None and phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    pairs = ((PHASE_METADATA, phase), (ACCELERATORS_METADATA, accelerators), (STATE_BYTES_METADATA, state_bytes))
    return tuple((k, str(v)) for k, v in pairs if v is not None)


@dataclass
class AcquireResult:
    success: bool
    waited_ms: int
    context_restored: bool
    weight_sync_error: str = ""
    """Non-empty when the weight version this job published last did not load on every sampler (those
    stay out of service at their old version): publish a good version again."""


def _weight_sync_error(trailing) -> str:
    for key, value in trailing or ():
        if key == WEIGHT_SYNC_ERROR_METADATA:
            _log.error("the last published weight version did not load: %s", value)
            return value
    return ""


@dataclass
class YieldResult:
    success: bool
    pending_waiters: int
    snapshot_deferred: bool


class StateOffloader(Protocol):
    offloaded: bool

    def offload(self): ...
    def restore(self): ...


def _token_with_source(
    token: str | None, token_file: str | os.PathLike | None, token_file_source: str | None = None
) -> tuple[str | None, str]:
    """The bearer token to send, and a sentence saying where it came from (for :class:`AuthError`); a
    ``token_file`` the caller found elsewhere is named by ``token_file_source`` (``$LLMD_TIMESLICE_TOKEN_FILE``,
    ``--token-file``, a running stack), else as the ``token_file=`` argument.

    Raises:
        FileNotFoundError: the token file does not exist.
        ValueError: the token file is empty.
    """
    if token is not None:
        return token, "the client's token came from the token= argument" + ("" if token else " (empty: none sent)")
    if token_file is not None:
        source = token_file_source or "the token_file= argument"
        return auth.load_token(token_file), f"the client's token came from {source}: file {token_file}"
    path = os.environ.get(auth.TOKEN_FILE_ENV)
    if path:
        return auth.load_token(path), f"the client's token came from ${auth.TOKEN_FILE_ENV}: file {path}"
    if os.environ.get(auth.TOKEN_ENV):
        return os.environ[auth.TOKEN_ENV], f"the client's token came from ${auth.TOKEN_ENV}"
    return None, (
        f"the client sent no token: it looked at the token= and token_file= arguments, "
        f"${auth.TOKEN_FILE_ENV} and ${auth.TOKEN_ENV} (none set)"
    )


# Retries on the upstream service name (transient UNAVAILABLE: orchestrator restarting, connection reset).
# Acquire is safe to retry: a waiter whose call died is dropped from the queue by the orchestrator.
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [
                    {"service": "timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService"},
                    {"service": "llmd_timeslice.v1alpha1.LeaseService"},
                ],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.2s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
    }
)


def _channel_options(extra: list | None) -> list:
    # gRPC takes the first of two options with the same name: the caller's come first, so they win.
    return [*(extra or []), ("grpc.service_config", _SERVICE_CONFIG), ("grpc.enable_retries", 1)]


def _defaults(target, job_id, group_id):
    return (
        target or os.environ.get("TIMESLICE_ORCH_ADDR") or DEFAULT_TARGET,
        job_id or os.environ.get("TIMESLICE_JOB_ID"),
        group_id or os.environ.get("TIMESLICE_TRAINER_GROUP"),
    )


class _JobAndGroup:
    """The job and default group a client acts for, and its leases' renewals (shared by the sync and asyncio
    clients)."""

    job_id: str | None
    group_id: str | None
    _beats: Mapping[tuple[str, str], _LeaseRenewal]
    _yield_callbacks: list[YieldCallback]

    def _ids(self, job_id: str | None, group_id: str | None) -> tuple[str, str]:
        job, group = job_id or self.job_id, group_id or self.group_id
        if not job or not group:
            raise TimeSliceError("job_id and group_id are required (arguments or TIMESLICE_JOB_ID / TIMESLICE_TRAINER_GROUP)")
        return job, group

    def lease_lost(self, job_id: str | None = None, group_id: str | None = None) -> str | None:
        """Why this job's lease on the group was lost (the orchestrator refused a heartbeat: its lease expired), or
        is not confirmed now (no heartbeat answered for longer than the TTL: the orchestrator unreachable, or this
        process was paused), or None while it holds (or without heartbeats). Lets a caller stop before acting on
        accelerators it may no longer hold; an unconfirmed lease turns None again once a heartbeat is answered."""
        beat = self._beats.get(self._ids(job_id, group_id))
        return beat.why_not_held() if beat else None

    def yield_requested(self, job_id: str | None = None, group_id: str | None = None) -> YieldRequested | None:
        """The yield request the last lease answer for this job's grant of the group carried, or None (none, not
        held, or an orchestrator without the lease extension). Local state: no call."""
        beat = self._beats.get(self._ids(job_id, group_id))
        return beat.yield_request if beat else None

    def on_yield_requested(self, callback: YieldCallback) -> None:
        """Call ``callback(YieldRequested)`` once per request, for every group this client holds, when a lease
        answer first carries it (from the heartbeat thread, or the heartbeat task of the asyncio client: keep it
        short, e.g. set a flag the training loop reads at its next step). An exception it raises is logged."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        self._yield_callbacks.append(callback)


class AsyncTimeSliceOrchestratorClient(_JobAndGroup):
    """asyncio variant of :class:`TimeSliceOrchestratorClient`: the same public methods with the same parameters
    (``tests/client/test_client_parity.py`` fails when they drift), awaitable where they call the orchestrator;
    ``on_accelerators`` and ``on_both_groups`` are async context managers (``on_accelerators`` also a decorator of
    coroutine functions), and ``async with client:`` closes it.

    Like the sync client it renews the lease in the background (an asyncio task per held group) and
    passes its fencing token on yield; ``release()`` raises :class:`LeaseLost` when the lease was lost.

    Args: as :class:`TimeSliceOrchestratorClient`.
    """

    def __init__(
        self,
        target: str | None = None,
        job_id: str | None = None,
        group_id: str | None = None,
        channel_options: list | None = None,
        token: str | None = None,
        heartbeats: bool = True,
        sampler_group_id: str | None = None,
        tls_files: tls.TlsFiles | None = None,
        token_file: str | os.PathLike | None = None,
        token_file_source: str | None = None,
    ) -> None:
        self.target, self.job_id, self.group_id = _defaults(target, job_id, group_id)
        self.sampler_group_id = sampler_group_id or os.environ.get("TIMESLICE_SAMPLER_GROUP")
        tok, self._token_source = _token_with_source(token, token_file, token_file_source)
        self._channel = tls.aio_channel(
            self.target,
            tls_files or tls.from_env(),
            options=_channel_options(channel_options),
            interceptors=auth.client_interceptors(tok),
        )
        self._stub = pb_grpc.TimeSliceOrchestratorServiceStub(self._channel)
        self._leases_stub = lease_pb2_grpc.LeaseServiceStub(self._channel)
        self._weights_stub = weights_pb2_grpc.WeightVersionServiceStub(self._channel)
        self.heartbeats = heartbeats
        self._beats: dict[tuple[str, str], _AsyncHeartbeat] = {}
        self._yield_callbacks: list[YieldCallback] = []

    async def acquire(
        self,
        job_id: str | None = None,
        group_id: str | None = None,
        timeout_sec: float | None = None,
        phase: str | None = None,
        accelerators: int | None = None,
        state_bytes: int | None = None,
    ) -> AcquireResult:
        """Until this job holds the group (FIFO). Raises AcquireTimeout, LeaseError, OrchestratorUnavailable.

        ``phase`` (``rollout`` or ``train``), ``accelerators`` and ``state_bytes`` (host bytes of that phase's worker
        while put aside) feed the job's phase profile (docs/placement.md); None: not said."""
        job, group = self._ids(job_id, group_id)
        md = _hints(phase, accelerators, state_bytes)
        try:
            call = self._stub.Acquire(pb.AcquireRequest(job_id=job, group_id=group), timeout=timeout_sec, metadata=md or None)
            r = await call
            sync_error = _weight_sync_error(await call.trailing_metadata())
        except grpc.RpcError as exc:
            raise _translate(exc, f"acquire {group!r} as {job!r}", self._token_source) from None
        if self.heartbeats:
            try:
                lease = await self._leases_stub.GetLease(lease_pb2.GetLeaseRequest(job_id=job, group_id=group), timeout=10)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # upstream orchestrator: nothing to renew
                    raise _translate(exc, f"lease of {group!r} as {job!r}", self._token_source) from None
            else:
                old = self._beats.pop((job, group), None)
                if old is not None:
                    old.stop()
                beat = _AsyncHeartbeat(self._leases_stub, job, group, lease.fencing_token, lease.ttl_s, self._yield_callbacks)
                beat.observe(lease)
                self._beats[(job, group)] = beat
                if beat._task is not None:  # the lease's expiry is armed by its first heartbeat
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(beat.first_answered.wait(), beat.rpc_timeout)
        return AcquireResult(r.success, r.waited_ms, r.context_restored, sync_error)

    def fencing_token(self, job_id: str | None = None, group_id: str | None = None) -> int | None:
        """The fencing token of this job's current grant (None without heartbeats). Local state: no call."""
        beat = self._beats.get(self._ids(job_id, group_id))
        return beat.token if beat else None

    async def wait_yield_requested(
        self, timeout_s: float | None = None, job_id: str | None = None, group_id: str | None = None
    ) -> YieldRequested | None:
        """Until a lease answer for this job's grant of the group carries a yield request (returned at once if one
        is set), or ``timeout_s`` passes (None), or the group is not held with heartbeats (None at once)."""
        beat = self._beats.get(self._ids(job_id, group_id))
        if beat is None:
            return None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(beat.asked.wait(), timeout_s)
        return beat.yield_request

    async def publish_weights(
        self, weights: WeightUpdate, job_id: str | None = None, group_id: str | None = None
    ) -> weights_pb2.WeightVersionStatus:
        """Publish weight version ``weights`` on a sampler group this job holds; its samplers load it when
        the group is yielded (wake weights -> load -> wake kv_cache -> reset prefix cache -> verify).

        Raises:
            LeaseError: not the holder, a version not newer than the group's, a malformed update, a
                group without samplers (the message says which); LeaseLost; OrchestratorUnavailable.
        """
        job, group = self._ids(job_id, group_id)
        beat = self._beats.get((job, group))
        req = weights_pb2.PublishWeightVersionRequest(
            job_id=job, group_id=group, weights=weights.to_pb(), fencing_token=beat.token if beat else 0
        )
        try:
            return await self._weights_stub.PublishWeightVersion(req, timeout=30)
        except grpc.RpcError as exc:
            if beat is not None and beat.lost is not None:
                raise LeaseLost(f"publish weights on {group!r} as {job!r}: the lease was lost: {beat.lost}") from None
            raise _translate(
                exc, f"publish weight version {weights.version} on {group!r} as {job!r}", self._token_source
            ) from None

    async def weight_status(self, group_id: str | None = None) -> weights_pb2.WeightVersionStatus:
        """Weight versions of the group's samplers (serving, pending, failures)."""
        try:
            return await self._weights_stub.GetWeightVersion(
                weights_pb2.GetWeightVersionRequest(group_id=group_id or self.sampler_group_id or self.group_id or ""),
                timeout=10,
            )
        except grpc.RpcError as exc:
            raise _translate(exc, "weight status", self._token_source) from None

    async def release(
        self, job_id: str | None = None, group_id: str | None = None, weights: WeightUpdate | None = None
    ) -> YieldResult:
        """Yield the group (returns at once); with ``weights``, publish that weight version first
        (see :meth:`publish_weights`), so the samplers wake with it.

        Raises:
            LeaseLost: the lease was reclaimed before this call (heartbeats failed or stopped).
            LeaseError: not the holder; OrchestratorUnavailable.
        """
        job, group = self._ids(job_id, group_id)
        if weights is not None:
            await self.publish_weights(weights, job, group)
        beat = self._beats.pop((job, group), None)
        md = None
        if beat is not None:
            beat.stop()
            md = ((FENCING_TOKEN_METADATA, str(beat.token)),)
        try:
            r = await self._stub.Yield(pb.YieldRequest(job_id=job, group_id=group), timeout=30, metadata=md)
        except grpc.RpcError as exc:
            if beat is not None and (beat.lost is not None or exc.code() == grpc.StatusCode.FAILED_PRECONDITION):
                raise LeaseLost(f"yield {group!r} as {job!r}: the lease was lost: {beat.lost or exc.details()}") from None
            raise _translate(exc, f"yield {group!r} as {job!r}", self._token_source) from None
        return YieldResult(r.success, r.pending_waiters, r.snapshot_deferred)

    yield_ = release

    async def group_status(self, group_id: str | None = None) -> pb.GetGroupStatusResponse:
        """Raw ``GetGroupStatusResponse`` of the group."""
        try:
            return await self._stub.GetGroupStatus(pb.GetGroupStatusRequest(group_id=group_id or self.group_id or ""), timeout=10)
        except grpc.RpcError as exc:
            raise _translate(exc, "group status", self._token_source) from None

    async def list_groups(self) -> list[str]:
        """The orchestrator's group ids."""
        try:
            return list((await self._stub.ListGroups(pb.ListGroupsRequest(), timeout=10)).group_ids)
        except grpc.RpcError as exc:
            raise _translate(exc, "list groups", self._token_source) from None

    def on_accelerators(
        self,
        job_id: str | None = None,
        group_id: str | None = None,
        timeout_sec: float | None = None,
        state: StateOffloader | None = None,
    ) -> _AsyncHeld:
        """Hold the group for a block or a function: ``async with c.on_accelerators(...):`` or
        ``@c.on_accelerators(...)`` on a coroutine function (``with`` / a plain function on the blocking face).

        With ``state``, trainer state is restored after the grant and offloaded before the yield (on the blocking
        face in the calling thread: the client loop keeps renewing the lease meanwhile).
        """
        return _AsyncHeld(self, _HeldSteps(self, job_id, group_id, timeout_sec, state))

    @contextlib.asynccontextmanager
    async def on_both_groups(self, job_id: str | None = None, timeout_sec: float | None = None):
        """Hold the trainer group, then the sampler group (the lock order), e.g. for a weight sync; yields in
        reverse order. Groups from the client (``group_id``, ``sampler_group_id`` / ``$TIMESLICE_SAMPLER_GROUP``).
        Raises TimeSliceError when no sampler group is configured."""
        if not self.sampler_group_id:
            raise TimeSliceError("no sampler group: pass sampler_group_id or set TIMESLICE_SAMPLER_GROUP")
        async with (
            self.on_accelerators(job_id, self.group_id, timeout_sec),
            self.on_accelerators(job_id, self.sampler_group_id, timeout_sec),
        ):
            yield self

    async def close(self) -> None:
        for beat in self._beats.values():
            beat.stop()
        self._beats.clear()
        await self._channel.close()

    async def __aenter__(self) -> AsyncTimeSliceOrchestratorClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def _build_core(*args, **kwargs) -> AsyncTimeSliceOrchestratorClient:
    return AsyncTimeSliceOrchestratorClient(*args, **kwargs)


class TimeSliceOrchestratorClient(_JobAndGroup):
    """Synchronous client: a blocking face over :class:`AsyncTimeSliceOrchestratorClient`, which it runs on the
    process's client event loop (:mod:`~llmd_timeslice.client.loop_thread`); every call blocks the calling thread
    until the orchestrator answers, the lease is renewed by the core's heartbeat task on that loop.

    Args:
        target: orchestrator ``host:port`` (default ``$TIMESLICE_ORCH_ADDR`` or 127.0.0.1:50051).
        job_id: this job's id (default ``$TIMESLICE_JOB_ID``).
        group_id: default group (default ``$TIMESLICE_TRAINER_GROUP``).
        channel_options: extra gRPC channel options; they take precedence over the client's own (its retries).
        token: bearer token (default from ``LLMD_TIMESLICE_TOKEN(_FILE)``): the control token, or this job's own
            token where the orchestrator has per-job tokens.
        tls_files: mutual TLS (default: from ``LLMD_TIMESLICE_TLS_*_FILE``, see :mod:`llmd_timeslice.tls`).
        token_file: file holding the bearer token (when ``token`` is not given).
        token_file_source: where ``token_file`` came from, named in an authentication error (e.g.
            ``$LLMD_TIMESLICE_TOKEN_FILE`` when a script read it from there); default: the ``token_file=`` argument.

    Raises:
        FileNotFoundError, ValueError: the token file is missing or empty.
    """

    @loop_thread.same_parameters(AsyncTimeSliceOrchestratorClient.__init__)
    def __init__(self, *args, **kwargs) -> None:
        self._core = loop_thread.run(_build_core(*args, **kwargs))  # the grpc.aio channel belongs to the core loop

    @classmethod
    def _over(cls, core: AsyncTimeSliceOrchestratorClient) -> TimeSliceOrchestratorClient:
        """The blocking face of an asyncio client already built on the client loop (the role locks' own)."""
        face = cls.__new__(cls)
        object.__setattr__(face, "_core", core)
        return face

    _SHARED = frozenset({"target", "job_id", "group_id", "sampler_group_id", "heartbeats"})

    def __getattr__(self, name: str):
        """The identity, settings and lease state live on the core (one copy): ``job_id``, ``group_id``,
        ``sampler_group_id``, ``target``, ``heartbeats`` (settable) and the core's lease renewals."""
        if name == "_core":
            raise AttributeError(name)
        return getattr(self._core, name)

    def __setattr__(self, name: str, value) -> None:
        if name in self._SHARED:
            setattr(self._core, name, value)
        else:
            super().__setattr__(name, value)

    # Each call blocks the calling thread until the core's answers (the core's docstrings say what each does).
    acquire = loop_thread.blocking(AsyncTimeSliceOrchestratorClient.acquire)
    wait_yield_requested = loop_thread.blocking(AsyncTimeSliceOrchestratorClient.wait_yield_requested)
    publish_weights = loop_thread.blocking(AsyncTimeSliceOrchestratorClient.publish_weights)
    weight_status = loop_thread.blocking(AsyncTimeSliceOrchestratorClient.weight_status)
    release = loop_thread.blocking(AsyncTimeSliceOrchestratorClient.release)
    yield_ = release
    group_status = loop_thread.blocking(AsyncTimeSliceOrchestratorClient.group_status)
    list_groups = loop_thread.blocking(AsyncTimeSliceOrchestratorClient.list_groups)
    fencing_token = loop_thread.local(AsyncTimeSliceOrchestratorClient.fencing_token)

    @loop_thread.same_parameters(AsyncTimeSliceOrchestratorClient.on_accelerators)
    def on_accelerators(self, *args, **kwargs) -> _Held:
        """Hold the group for a block or a function: ``with c.on_accelerators(...):`` or ``@c.on_accelerators(...)``
        (:meth:`AsyncTimeSliceOrchestratorClient.on_accelerators`; the trainer state's steps in the calling thread)."""
        return _Held(self, self._core.on_accelerators(*args, **kwargs).steps)

    @loop_thread.same_parameters(AsyncTimeSliceOrchestratorClient.on_both_groups)
    @contextlib.contextmanager
    def on_both_groups(self, *args, **kwargs):
        """``with c.on_both_groups():`` (:meth:`AsyncTimeSliceOrchestratorClient.on_both_groups`)."""
        with loop_thread.blocking_context(self._core.on_both_groups(*args, **kwargs)):
            yield self

    def close(self) -> None:
        loop_thread.run(self._core.close())

    def __enter__(self) -> TimeSliceOrchestratorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _HeldSteps:
    """What holding a group around a block does, written once for both faces: acquire; restore the trainer's state
    if it is offloaded (released again if that fails); at the end offload the state if it is restored, then
    release. The steps are generators yielding the core's calls: a face runs each (awaited, or blocking on the client
    loop), and the state's own steps run in the face's thread."""

    def __init__(self, core: AsyncTimeSliceOrchestratorClient, job_id, group_id, timeout_sec, state) -> None:
        self.core, self.job_id, self.group_id, self.timeout_sec, self.state = core, job_id, group_id, timeout_sec, state

    def entering(self) -> Iterator[Coroutine[Any, Any, Any]]:
        yield self.core.acquire(self.job_id, self.group_id, self.timeout_sec)
        try:
            if self.state is not None and self.state.offloaded:
                self.state.restore()
        except BaseException:
            yield self.core.release(self.job_id, self.group_id)
            raise

    def leaving(self) -> Iterator[Coroutine[Any, Any, Any]]:
        try:
            if self.state is not None and not self.state.offloaded:
                self.state.offload()
        finally:
            yield self.core.release(self.job_id, self.group_id)


class _Held(contextlib.ContextDecorator):
    """Context manager and decorator of :meth:`TimeSliceOrchestratorClient.on_accelerators`."""

    def __init__(self, client: TimeSliceOrchestratorClient, steps: _HeldSteps) -> None:
        self.client, self.steps = client, steps

    def __enter__(self):
        for call in self.steps.entering():
            loop_thread.run(call)
        return self.client

    def __exit__(self, *exc) -> None:
        for call in self.steps.leaving():
            loop_thread.run(call)


class _AsyncHeld:
    """Async context manager and decorator of :meth:`AsyncTimeSliceOrchestratorClient.on_accelerators`."""

    def __init__(self, client: AsyncTimeSliceOrchestratorClient, steps: _HeldSteps) -> None:
        self.client, self.steps = client, steps

    async def __aenter__(self):
        for call in self.steps.entering():
            await call
        return self.client

    async def __aexit__(self, *exc) -> None:
        for call in self.steps.leaving():
            await call

    def __call__(self, fn):
        @functools.wraps(fn)
        async def wrapper(*a, **kw):
            async with self:
                return await fn(*a, **kw)

        return wrapper
