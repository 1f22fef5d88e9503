"""The snapshot sidecar: upstream ``SnapshotAgentService`` + the project's ``WaitOperation``.

One sidecar per pod serves the jobs of that pod (a vLLM server, usually one job). Snapshot and Restore return an
operation id at once (upstream semantics) and run the backend in the background; ``GetOperation`` reads the result
and ``WaitOperation`` (project extension) returns as soon as the operation ends. ``RunOperations`` (project extension,
the orchestrator's path) carries both on one long-lived stream: a command starts an operation, one event answers it
when it ended (docs/decisions/sidecar-operation-stream.md).

Job states follow the Snapshot Agent's vocabulary: RUNNING, TRANSITIONING, SAVED, FAULTED; every change goes through
the table of :mod:`llmd_timeslice.snapshot.job_states`.

The backend of each operation is resolved per request (:mod:`llmd_timeslice.snapshot.resolve`): explicit request
config, then a workload registered on ``WorkloadChannel`` (:mod:`~llmd_timeslice.snapshot.channel`), then the pod's
annotations, then the job's default.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter, Gauge

from llmd_timeslice import auth, tls
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2_grpc as xpb_grpc
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from llmd_timeslice.grpc_server import SERVER_OPTIONS
from llmd_timeslice.snapshot.accelerators import AcceleratorReader, nvml_accelerators
from llmd_timeslice.snapshot.backends.base import (
    BackendError,
    EngineUnreachable,
    SleepResidual,
    SnapshotBackend,
    SuspendMode,
    WeightVersionRejected,
)
from llmd_timeslice.snapshot.backends.deadlines import OperationClock, OperationDeadlines, operation_clock
from llmd_timeslice.snapshot.backends.sleep_memory import MemoryNotFreed
from llmd_timeslice.snapshot.channel import WorkloadRegistry
from llmd_timeslice.snapshot.job_states import JobState, move
from llmd_timeslice.snapshot.resolve import BackendResolver, ResolveError
from llmd_timeslice.weights.update import InvalidWeightUpdate, WeightUpdate

log = logging.getLogger(__name__)

PARKED_REQUESTS = Counter(
    "llmd_timeslice_sidecar_parked_requests_total",
    "Requests found inside an engine after its verified sleep (they reached it after the drain), by what was done: "
    "aborted (finish_reason abort at once) or kept (pause mode keep: they resume on wake).",
    ["job_id", "action"],
)

SLEEP_RESIDUAL = Gauge(
    "llmd_timeslice_sidecar_sleep_residual_bytes",
    "Device memory the engine still held after its last sleep at this level, once settled (bytes; NVML per process "
    "where it lists the engine's pids, else the device's used memory). Set by every sleep, verified or not.",
    ["job_id", "level"],
)
SLEEP_RESIDUAL_BUDGET = Gauge(
    "llmd_timeslice_sidecar_sleep_residual_budget_bytes",
    "The budget the last sleep's residual at this level was checked against (bytes): the group's "
    "residual_budget_bytes, else the first verified sleep's residual plus the margin.",
    ["job_id", "level"],
)
SLEEPS_OVER_BUDGET = Counter(
    "llmd_timeslice_sidecar_sleeps_over_budget_total",
    "Sleeps not verified because the engine still held more device memory than its budget (or freed too little).",
    ["job_id", "level"],
)

ENGINES_MARKED_FAILED = Counter(
    "llmd_timeslice_sidecar_engines_marked_failed_total",
    "Engines marked failed because their wake failed the same way max_identical_wake_failures times in a row.",
    ["job_id"],
)

FENCED_COMMANDS = Counter(
    "llmd_timeslice_sidecar_fenced_commands_total",
    "Snapshot/Restore calls refused because their leader_term was below the highest seen (a deposed orchestrator).",
)
FENCED_TERM_KEY = "x-llmd-timeslice-fenced-term"
"""Trailing metadata of a fenced refusal: the highest leader term the sidecar has seen (decimal)."""

MAX_OPERATIONS_KEPT = 1000
MAX_WAIT_S = 3600.0

_JOB_STATE = {
    JobState.IDLE: pb.JOB_STATE_IDLE,
    JobState.RUNNING: pb.JOB_STATE_RUNNING,
    JobState.TRANSITIONING: pb.JOB_STATE_TRANSITIONING,
    JobState.SAVED: pb.JOB_STATE_SAVED,
    JobState.FAULTED: pb.JOB_STATE_FAULTED,
}


class Refused(Exception):
    """A command the sidecar does not start: the gRPC status of its refusal (``fenced_term``: the highest leader
    term seen, on a fenced one)."""

    def __init__(self, code: grpc.StatusCode, details: str, fenced_term: int = 0) -> None:
        super().__init__(details)
        self.code, self.details, self.fenced_term = code, details, fenced_term

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        """End a unary call with this refusal (raises, as ``context.abort`` does)."""
        trailing = ((FENCED_TERM_KEY, str(self.fenced_term)),) if self.fenced_term else ()
        await context.abort(self.code, self.details, trailing_metadata=trailing)

    def to_pb(self) -> xpb.OperationRefusal:
        return xpb.OperationRefusal(code=self.code.value[0], details=self.details, fenced_term=self.fenced_term)


@dataclass(eq=False)
class Operation:
    """One snapshot or restore; ``done`` is set when it ends."""

    id: str
    job_id: str
    kind: str
    started: float = field(default_factory=time.monotonic)
    status: pb.OperationStatus = pb.OPERATION_STATUS_PENDING
    elapsed_ms: int = 0
    error: str | None = None
    storage_bytes: int | None = None
    device_bytes: int | None = None  # device memory the snapshot freed, where measured (NVML)
    fault: int = xpb.OPERATION_FAULT_UNSPECIFIED  # why it FAILED, where known (snapshot_ext.proto)
    parked_requests: int = 0  # requests found inside the engine after the sleep (see SuspendResult)
    parked_action: str = ""
    done: asyncio.Event = field(default_factory=asyncio.Event)
    _waiters: list[Callable[[], None]] = field(default_factory=list, init=False, repr=False)

    def on_done(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        """Call ``callback`` (in ``loop``, soon) once the operation ended: at once if it has."""
        if self.done.is_set():
            loop.call_soon(callback)
        else:
            self._waiters.append(callback)

    def finish(self) -> None:
        """Mark the operation ended: wakes its waiters."""
        self.done.set()
        waiters, self._waiters = self._waiters, []
        for callback in waiters:
            callback()

    def to_pb(self) -> pb.GetOperationResponse:
        elapsed = self.elapsed_ms if self.status != pb.OPERATION_STATUS_PENDING else int((time.monotonic() - self.started) * 1000)
        resp = pb.GetOperationResponse(status=self.status, elapsed_ms=elapsed)
        if self.error is not None:
            resp.error = self.error
        if self.storage_bytes is not None:
            resp.storage_bytes = self.storage_bytes
        if self.device_bytes is not None:
            resp.snapshot_device_bytes = self.device_bytes
        if self.parked_requests:
            resp.parked_requests, resp.parked_action = self.parked_requests, self.parked_action
        return resp


def failure_signature(error: str) -> str:
    """What makes two failures "the same": the error with its figures (counts, ids, durations) taken out."""
    return re.sub(r"\d+(?:\.\d+)?", "#", error)


@dataclass
class WakeFailures:
    """A job's run of identical wake failures (``signature`` of the last, ``count`` in a row); ``failed``: the
    reason the engine was marked failed (None: not marked)."""

    signature: str = ""
    count: int = 0
    failed: str | None = None


_STREAM_CLOSING = xpb.OperationEvent()  # put on each open RunOperations stream's queue at a stop (by identity)


class SnapshotSidecar(pb_grpc.SnapshotAgentServiceServicer, xpb_grpc.SnapshotOperationsServiceServicer):
    """Servicer for one pod's jobs.

    Args:
        backends: job id -> default backend that suspends/resumes it.
        operation_timeout_s: most seconds a sleep or a wake may take before the operation FAILS, where the command
            names no deadline of its own (``OperationCommand.deadlines``; a weight reload inside a wake has its own,
            :mod:`~llmd_timeslice.snapshot.backends.deadlines`).
        annotations: the pod's annotations (see :mod:`llmd_timeslice.snapshot.resolve`).
        command_timeout_s: most seconds a registered workload may take to answer a command.
        backend_kwargs: extra arguments for vLLM/SGLang backends built on demand.
        max_identical_wake_failures: after this many wakes of a job failing the same way in a row (the error with its
            figures taken out), its engine is marked failed: later restores fail at once, naming the failure
            (fault ``ENGINE_FAILED``), until a snapshot of it succeeds; 0: never.
        hung_after_s: an engine that does not answer ``GetServedWeightVersion``'s reads within this many seconds is
            reported hung (``engine_unreachable``): the orchestrator's audit takes it out of service like a dead one
            (issue 38 §5: a frozen engine was never noticed).
    """

    def __init__(
        self,
        backends: dict[str, SnapshotBackend],
        operation_timeout_s: float = 300.0,
        annotations: dict[str, str] | None = None,
        command_timeout_s: float = 300.0,
        backend_kwargs: dict | None = None,
        max_identical_wake_failures: int = 3,
        hung_after_s: float = 5.0,
    ) -> None:
        self.max_identical_wake_failures = max_identical_wake_failures
        self.wake_failures: defaultdict[str, WakeFailures] = defaultdict(WakeFailures)
        self.hung_after_s = hung_after_s
        self.backends = backends
        self.workloads = WorkloadRegistry()
        self.resolver = BackendResolver(backends, self.workloads, annotations, command_timeout_s, backend_kwargs)
        self.states: dict[str, JobState] = {job: JobState.RUNNING for job in backends}
        self.operations: dict[str, Operation] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._timeout = operation_timeout_s
        self._tasks: set[asyncio.Task] = set()
        self._op_streams: set[asyncio.Queue] = set()  # the event queue of each open RunOperations stream
        self.last_resolution: dict[str, str] = {}  # job id -> source of its last operation's backend
        self.accelerator_reader: AcceleratorReader | None = nvml_accelerators()
        self.highest_term = 0
        """Highest orchestrator leader term seen on a Snapshot/Restore (fencing; 0: none yet)."""

    def _fence(self, request, kind: str) -> None:
        """Refuse (FAILED_PRECONDITION) a command whose ``leader_term`` is below the highest seen; remember a
        higher one. A missing term (0, an unfenced orchestrator) passes only while no term has been seen.
        Raises :class:`Refused`."""
        term = request.leader_term
        if term < self.highest_term:
            FENCED_COMMANDS.inc()
            why = (
                f"fenced: {kind} of job {request.job_id!r} from orchestrator leader term {term} refused, this sidecar "
                f"has seen term {self.highest_term} (a newer leader took over)"
            )
            log.error("%s", why)
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, why, fenced_term=self.highest_term)
        if term > self.highest_term:
            if self.highest_term:
                log.warning("orchestrator leader term %d -> %d (a new leader)", self.highest_term, term)
            self.highest_term = term

    @staticmethod
    def _record_residual(job_id: str, residual: SleepResidual | None, over: bool = False) -> None:
        """The residual of one sleep into the metrics (module constants above)."""
        if residual is None:
            return
        labels = {"job_id": job_id, "level": str(residual.level)}
        SLEEP_RESIDUAL.labels(**labels).set(residual.bytes)
        if residual.budget is not None:
            SLEEP_RESIDUAL_BUDGET.labels(**labels).set(residual.budget)
        if over:
            SLEEPS_OVER_BUDGET.labels(**labels).inc()

    def _start(
        self, request, kind: str, weights: WeightUpdate | None = None, limits: OperationDeadlines | None = None
    ) -> Operation:
        """Check and start one operation (in the background); returns it. Raises :class:`Refused`."""
        if not request.job_id:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "job_id is required")
        self._fence(request, kind)
        cfg = request.backend_config if request.HasField("backend_config") else None
        try:
            res = self.resolver.resolve(request.job_id, cfg)
        except ResolveError as exc:
            raise Refused(exc.code, str(exc)) from None
        if kind == "snapshot" and res.mode not in res.backend.supported_modes:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"backend {res.backend.name!r} does not support mode {res.mode.name}")
        if weights is not None and not res.backend.supports_weight_sync:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"backend {res.backend.name!r} of job {request.job_id!r} cannot load weights "
                "(weight sync needs the vllm backend)",
            )
        if request.job_id not in self.states:
            move(self.states, request.job_id, JobState.RUNNING)
        self.last_resolution[request.job_id] = res.source
        op = Operation(uuid.uuid4().hex, request.job_id, kind)
        self._remember(op)
        budget = request.device_residual_budget_bytes if kind == "snapshot" else 0
        task = asyncio.get_running_loop().create_task(
            self._run(op, res.backend, res.mode, res.tags, weights, limits or OperationDeadlines(), budget)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return op

    async def _start_call(self, request, context, kind: str, weights: WeightUpdate | None = None) -> str:
        """:meth:`_start` for a unary call: a refusal ends the call with its status."""
        try:
            return self._start(request, kind, weights).id
        except Refused as exc:
            await exc.abort(context)
            raise  # unreachable: abort raises

    async def finish_operations(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` seconds for operations in flight, then cancel the rest (logged)."""
        tasks = set(self._tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=grace_s)
        for task in pending:
            task.cancel()
        if pending:
            log.warning("stopping: cancelled %d operation(s) still running after %g s", len(pending), grace_s)
            await asyncio.gather(*pending, return_exceptions=True)

    def _remember(self, op: Operation) -> None:
        self.operations[op.id] = op
        if len(self.operations) > MAX_OPERATIONS_KEPT:
            for old in list(self.operations)[: len(self.operations) - MAX_OPERATIONS_KEPT]:
                if self.operations[old].done.is_set():
                    del self.operations[old]

    async def _run(
        self,
        op: Operation,
        backend: SnapshotBackend,
        mode: SuspendMode,
        tags: list[str],
        weights: WeightUpdate | None = None,
        limits: OperationDeadlines = OperationDeadlines(),
        residual_budget_bytes: int = 0,
    ) -> None:
        async with self._locks[op.job_id]:
            failures = self.wake_failures[op.job_id]
            if op.kind == "restore" and failures.failed is not None:
                self._refuse_failed_engine(op, failures.failed)
                return
            move(self.states, op.job_id, JobState.TRANSITIONING)
            kind = "sleep" if op.kind == "snapshot" else "wake"
            limit_s = (limits.sleep_s if kind == "sleep" else limits.wake_s) or self._timeout
            clock: OperationClock | None = None
            try:
                async with operation_clock(kind, limit_s, limits.reload_s) as clock:
                    await self._run_backend(op, backend, mode, tags, weights, residual_budget_bytes)
                op.status = pb.OPERATION_STATUS_COMPLETE
            except TimeoutError:
                what = f"{op.kind} of job {op.job_id!r}"
                op.status = pb.OPERATION_STATUS_FAILED
                op.error = clock.expired_reason(what) if clock is not None else f"{what} ran past {limit_s:g} s"
                move(self.states, op.job_id, JobState.FAULTED)
            except BackendError as exc:
                op.status, op.error = pb.OPERATION_STATUS_FAILED, str(exc)
                if isinstance(exc, MemoryNotFreed):
                    self._record_residual(op.job_id, exc.residual, over=True)
                if isinstance(exc, WeightVersionRejected):
                    op.fault = xpb.OPERATION_FAULT_WEIGHTS_REJECTED
                elif isinstance(exc, EngineUnreachable):
                    op.fault = xpb.OPERATION_FAULT_ENGINE_UNREACHABLE
                move(self.states, op.job_id, JobState.FAULTED)
            except asyncio.CancelledError:
                op.status, op.error = (
                    pb.OPERATION_STATUS_FAILED,
                    (f"{op.kind} of job {op.job_id!r} was cancelled: the sidecar is stopping"),
                )
                move(self.states, op.job_id, JobState.FAULTED)
                raise
            except Exception as exc:
                log.exception("operation %s crashed", op.id)
                op.status, op.error = pb.OPERATION_STATUS_FAILED, f"internal error: {exc!r}"
                move(self.states, op.job_id, JobState.FAULTED)
            finally:
                self._count_wake_failure(op)
                op.elapsed_ms = int((time.monotonic() - op.started) * 1000)
                op.finish()
                log.info(
                    "operation=%s job=%s kind=%s%s status=%s elapsed_ms=%d%s%s",
                    op.id,
                    op.job_id,
                    op.kind,
                    f" weight_version={weights.version}" if weights is not None else "",
                    pb.OperationStatus.Name(op.status),
                    op.elapsed_ms,
                    f" parked_requests={op.parked_requests} ({op.parked_action})" if op.parked_requests else "",
                    f" error={op.error}" if op.error else "",
                )

    def _count_wake_failure(self, op: Operation) -> None:
        """Track the job's run of identical wake failures; mark its engine failed at the bound (class doc). A
        snapshot that succeeds clears the mark (the engine works again, e.g. it restarted)."""
        failures = self.wake_failures[op.job_id]
        if op.status == pb.OPERATION_STATUS_COMPLETE:
            self.wake_failures.pop(op.job_id, None)
            return
        if op.kind != "restore" or op.error is None or op.fault == xpb.OPERATION_FAULT_WEIGHTS_REJECTED:
            return  # a rejected version is the version's fault, not the engine's (its last good version serves)
        signature = failure_signature(op.error)
        failures.count = failures.count + 1 if signature == failures.signature else 1
        failures.signature = signature
        if self.max_identical_wake_failures and failures.count >= self.max_identical_wake_failures:
            failures.failed = (
                f"engine of job {op.job_id!r} marked failed: its wake failed the same way {failures.count} times in "
                f"a row (max_identical_wake_failures={self.max_identical_wake_failures}); last: {op.error}. Restores "
                "are refused without touching it: restart the engine (or its pod); a snapshot that succeeds clears "
                "the mark"
            )
            op.error, op.fault = failures.failed, xpb.OPERATION_FAULT_ENGINE_FAILED
            ENGINES_MARKED_FAILED.labels(job_id=op.job_id).inc()
            log.error("%s", failures.failed)

    def _refuse_failed_engine(self, op: Operation, why: str) -> None:
        """End restore ``op`` at once: its engine is marked failed (``why``)."""
        op.status, op.error, op.fault = pb.OPERATION_STATUS_FAILED, why, xpb.OPERATION_FAULT_ENGINE_FAILED
        move(self.states, op.job_id, JobState.FAULTED)
        op.elapsed_ms = int((time.monotonic() - op.started) * 1000)
        op.finish()

    async def _run_backend(
        self,
        op: Operation,
        backend: SnapshotBackend,
        mode: SuspendMode,
        tags: list[str],
        weights: WeightUpdate | None,
        residual_budget_bytes: int = 0,
    ) -> None:
        """The backend's part of ``op`` (under the operation's deadline, set by :meth:`_run`); ``residual_budget_bytes``:
        a sleep's device-memory budget (0: the backend's default)."""
        if op.kind == "snapshot":
            budget = {"residual_budget_bytes": residual_budget_bytes or None} if backend.checks_residual else {}
            res = await backend.suspend(mode, tags, **budget)
            if res is not None:
                self._record_residual(op.job_id, res.residual)
                op.storage_bytes, op.device_bytes = res.storage_bytes, res.device_bytes_freed
                if res.parked_requests:
                    op.parked_requests, op.parked_action = res.parked_requests, res.parked_action
                    PARKED_REQUESTS.labels(job_id=op.job_id, action=res.parked_action).inc(res.parked_requests)
            move(self.states, op.job_id, JobState.SAVED)
        elif weights is not None:
            await backend.resume_with_weights(tags, weights)
            op.storage_bytes = int(getattr(backend, "last_sync", {}).get("bytes", 0)) or None
            move(self.states, op.job_id, JobState.RUNNING)
        else:
            await backend.resume(tags)
            move(self.states, op.job_id, JobState.RUNNING)

    async def Snapshot(self, request, context):  # noqa: N802
        return pb.SnapshotResponse(operation_id=await self._start_call(request, context, "snapshot"))

    async def Restore(self, request, context):  # noqa: N802
        return pb.RestoreResponse(operation_id=await self._start_call(request, context, "restore"))

    @staticmethod
    def _weights(request: xpb.RestoreWithWeightsRequest) -> WeightUpdate:
        """The weight update of a RestoreWithWeights request. Raises :class:`Refused` (INVALID_ARGUMENT)."""
        if not request.HasField("weights"):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "weights is required (use Restore without a sync)")
        try:
            return WeightUpdate.from_pb(request.weights)
        except InvalidWeightUpdate as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    async def RestoreWithWeights(self, request, context):  # noqa: N802
        """Project extension: Restore with a weight sync (weights.proto, snapshot_ext.proto)."""
        try:
            weights = self._weights(request)
        except Refused as exc:
            await exc.abort(context)
            raise  # unreachable: abort raises
        return pb.RestoreResponse(operation_id=await self._start_call(request.restore, context, "restore", weights))

    def _start_command(self, cmd: xpb.OperationCommand) -> Operation:
        """Start the operation an OperationCommand names. Raises :class:`Refused`."""
        which = cmd.WhichOneof("command")
        limits = OperationDeadlines.from_pb(cmd.deadlines)
        if which == "snapshot":
            return self._start(cmd.snapshot, "snapshot", limits=limits)
        if which == "restore":
            return self._start(cmd.restore, "restore", limits=limits)
        if which == "restore_with_weights":
            weights = self._weights(cmd.restore_with_weights)
            return self._start(cmd.restore_with_weights.restore, "restore", weights, limits)
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"command {cmd.command_id}: an OperationCommand must set snapshot, restore or restore_with_weights",
        )

    async def RunOperations(self, request_iterator, context):  # noqa: N802
        """Project extension (snapshot_ext.proto): a stream of commands, each answered by one event when its
        operation ended (or at once, refused). Operations run as they would from unary calls; the stream's end
        leaves those in flight running (a caller that reconnects reads them with GetOperation)."""
        events: asyncio.Queue[xpb.OperationEvent | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        unanswered = 0  # operations started from this stream whose event is not sent yet

        def answer(command_id: int, op: Operation) -> None:
            events.put_nowait(
                xpb.OperationEvent(
                    command_id=command_id, result=xpb.OperationResult(operation=op.to_pb(), fault=cast(Any, op.fault))
                )
            )

        async def read_commands() -> None:
            try:
                async for cmd in request_iterator:
                    try:
                        op = self._start_command(cmd)
                    except Refused as exc:
                        events.put_nowait(xpb.OperationEvent(command_id=cmd.command_id, refused=exc.to_pb()))
                        continue
                    nonlocal unanswered
                    unanswered += 1
                    op.on_done(loop, functools.partial(answer, cmd.command_id, op))
            finally:
                events.put_nowait(None)

        await context.send_initial_metadata(())  # the caller's open completes: this sidecar takes commands
        reader = loop.create_task(read_commands())
        self._op_streams.add(events)  # a stop ends the stream once its operations are answered
        closing = False
        try:
            while (event := await events.get()) is not None:
                if event is _STREAM_CLOSING:
                    closing = True
                else:
                    unanswered -= event.HasField("result")
                    yield event
                if closing and unanswered == 0:  # the sidecar stops: nothing more to answer here
                    break
        finally:
            self._op_streams.discard(events)
            reader.cancel()

    def end_operation_streams(self) -> None:
        """Each open ``RunOperations`` stream ends (status OK) once its operations are answered (a stop)."""
        for events in self._op_streams:
            events.put_nowait(_STREAM_CLOSING)

    async def GetServedWeightVersion(self, request, context):  # noqa: N802
        """Project extension (snapshot_ext.proto): the label the job's engine reports now, from the engine."""
        if not request.job_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id is required")
        try:
            backend = self.resolver.resolve(request.job_id, None).backend
        except ResolveError as exc:
            await context.abort(exc.code, str(exc))
        if not backend.supports_weight_sync:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"backend {backend.name!r} of job {request.job_id!r} has no weight version"
            )
        try:
            async with asyncio.timeout(self.hung_after_s):
                label = await backend.served_weight_version()
                sleeping = await backend.is_suspended()
        except TimeoutError:
            why = (
                f"engine of job {request.job_id!r} did not answer within {self.hung_after_s:g} s (hung: a frozen "
                "process, a stuck engine core); out of service until it answers again"
            )
            log.error("%s", why)
            return xpb.GetServedWeightVersionResponse(engine_unreachable=why)
        except EngineUnreachable as exc:
            return xpb.GetServedWeightVersionResponse(engine_unreachable=str(exc))
        except BackendError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return xpb.GetServedWeightVersionResponse(weight_version=label or "", known=label is not None, sleeping=sleeping)

    async def _op(self, operation_id: str, context: grpc.aio.ServicerContext) -> Operation:
        op = self.operations.get(operation_id)
        if op is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown operation {operation_id!r}")
        return op

    async def GetOperation(self, request, context):  # noqa: N802
        return (await self._op(request.operation_id, context)).to_pb()

    async def _wait(self, request, context) -> Operation:
        op = await self._op(request.operation_id, context)
        if not 0 <= request.timeout_s <= MAX_WAIT_S:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s must be in [0, {MAX_WAIT_S:g}]")
        try:
            await asyncio.wait_for(op.done.wait(), request.timeout_s)
        except TimeoutError:
            pass
        return op

    async def WaitOperation(self, request, context):  # noqa: N802
        return (await self._wait(request, context)).to_pb()

    async def WaitOperationResult(self, request, context):  # noqa: N802
        """WaitOperation plus the kind of fault of a FAILED operation (snapshot_ext.proto)."""
        op = await self._wait(request, context)
        return xpb.OperationResult(operation=op.to_pb(), fault=op.fault)

    async def Status(self, request, context):  # noqa: N802
        accelerators = []
        if self.accelerator_reader is not None:
            try:
                accelerators = [
                    pb.AcceleratorStatus(id=a.id, memory_used_bytes=a.memory_used_bytes, memory_total_bytes=a.memory_total_bytes)
                    for a in await asyncio.to_thread(self.accelerator_reader)
                ]
            except Exception as exc:
                log.warning("reading accelerator memory failed: %r", exc)
        return pb.StatusResponse(
            job_statuses=[pb.JobStatus(job_id=j, state=_JOB_STATE[s]) for j, s in sorted(self.states.items())],
            accelerator_statuses=accelerators,
        )

    async def WorkloadChannel(self, request_iterator, context):  # noqa: N802
        """Upstream WorkloadChannel: register, then receive commands and answer each with a result."""
        it = request_iterator.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("message") != "register" or not first.register.job_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the first WorkloadMessage must be RegisterWorkload with a job_id"
            )
        ch = self.workloads.register(first.register)
        if self.states.get(ch.job_id, JobState.IDLE) in (JobState.IDLE, JobState.FAULTED):
            move(self.states, ch.job_id, JobState.RUNNING)

        async def read_results() -> None:
            try:
                async for msg in it:
                    if msg.WhichOneof("message") == "result":
                        ch.on_result(msg.result)
                    else:
                        log.warning("job %s: RegisterWorkload on an already registered stream ignored", ch.job_id)
                ch.close(f"the workload of job {ch.job_id!r} disconnected (its stream ended)")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                ch.close(f"the stream of job {ch.job_id!r} broke: {exc!r}")

        reader = asyncio.get_running_loop().create_task(read_results())
        try:
            while True:
                cmd = await ch.outbox.get()
                if cmd is None:
                    break
                yield cmd
        finally:
            reader.cancel()
            ch.close(f"the workload of job {ch.job_id!r} disconnected")
            self.workloads.unregister(ch)


class SidecarServer:
    """The sidecar's gRPC server in this event loop."""

    def __init__(
        self,
        backends: dict[str, SnapshotBackend],
        host: str = "127.0.0.1",
        port: int = 9001,
        token: str | None = None,
        operation_timeout_s: float = 300.0,
        annotations: dict[str, str] | None = None,
        command_timeout_s: float = 300.0,
        backend_kwargs: dict | None = None,
        tls_files: tls.TlsFiles | None = None,
        max_identical_wake_failures: int = 3,
        hung_after_s: float = 5.0,
    ) -> None:
        limits = (command_timeout_s, backend_kwargs, max_identical_wake_failures, hung_after_s)
        self.servicer = SnapshotSidecar(backends, operation_timeout_s, annotations, *limits)
        self.host, self.port, self.token = host, port, token
        self.tls = tls_files
        self._server: aio.Server | None = None

    async def start(self) -> None:
        self._server = aio.server(options=SERVER_OPTIONS, interceptors=auth.server_interceptors(self.token))
        pb_grpc.add_SnapshotAgentServiceServicer_to_server(self.servicer, self._server)
        xpb_grpc.add_SnapshotOperationsServiceServicer_to_server(self.servicer, self._server)
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, self._server)
        self.port = tls.add_port(self._server, f"{self.host}:{self.port}", self.tls)
        await self._server.start()
        await hs.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("sidecar %s:%d jobs=%s", self.host, self.port, sorted(self.servicer.backends))

    async def stop(self, operation_grace_s: float = 5.0) -> None:
        """Stop serving: new calls refused, calls in flight get 1 s; each ``RunOperations`` stream ends (status OK) once
        every operation started from it was answered (at once when none runs). Operations in flight get
        ``operation_grace_s`` seconds to finish, then are cancelled (their engines are left as the interrupted step
        left them), before the backends' clients close."""
        if self._server is not None:
            stopping = asyncio.ensure_future(self._server.stop(1.0))
            await asyncio.sleep(0)
            self.servicer.end_operation_streams()
            await stopping
        await self.servicer.finish_operations(operation_grace_s)
        await self.servicer.resolver.close()
