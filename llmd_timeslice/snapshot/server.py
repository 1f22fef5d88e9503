"""The snapshot sidecar: upstream ``SnapshotAgentService`` + the project's ``WaitOperation``.

One sidecar per pod serves the jobs of that pod (a vLLM server, usually one job). Snapshot and
Restore return an operation id at once (upstream semantics) and run the backend in the
background; ``GetOperation`` reads the result and ``WaitOperation`` (project extension) returns
as soon as the operation ends, so the orchestrator waits on an event instead of polling.

Job states follow the Snapshot Agent's vocabulary: RUNNING, TRANSITIONING, SAVED, FAULTED.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmd_timeslice import auth
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2_grpc as xpb_grpc
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from llmd_timeslice.grpc_server import SERVER_OPTIONS
from llmd_timeslice.snapshot.backends.base import BackendError, SnapshotBackend, SuspendMode

log = logging.getLogger(__name__)

MAX_OPERATIONS_KEPT = 1000
MAX_WAIT_S = 3600.0

_JOB_STATE = {
    "IDLE": pb.JOB_STATE_IDLE,
    "RUNNING": pb.JOB_STATE_RUNNING,
    "TRANSITIONING": pb.JOB_STATE_TRANSITIONING,
    "SAVED": pb.JOB_STATE_SAVED,
    "FAULTED": pb.JOB_STATE_FAULTED,
}


@dataclass(eq=False)
class Operation:
    """One snapshot or restore; ``done`` is set when it ends."""

    id: str
    job_id: str
    kind: str
    started: float = field(default_factory=time.monotonic)
    status: int = pb.OPERATION_STATUS_PENDING
    elapsed_ms: int = 0
    error: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def to_pb(self) -> pb.GetOperationResponse:
        elapsed = self.elapsed_ms if self.status != pb.OPERATION_STATUS_PENDING else int(
            (time.monotonic() - self.started) * 1000)
        resp = pb.GetOperationResponse(status=self.status, elapsed_ms=elapsed)
        if self.error is not None:
            resp.error = self.error
        return resp


class SnapshotSidecar(pb_grpc.SnapshotAgentServiceServicer, xpb_grpc.SnapshotOperationsServiceServicer):
    """Servicer for one pod's jobs.

    Args:
        backends: job id -> backend that suspends/resumes it.
        operation_timeout_s: most seconds a backend call may take before the operation FAILS.
    """

    def __init__(self, backends: dict[str, SnapshotBackend], operation_timeout_s: float = 300.0) -> None:
        self.backends = backends
        self.states: dict[str, str] = {job: "RUNNING" for job in backends}
        self.operations: dict[str, Operation] = {}
        self._locks = {job: asyncio.Lock() for job in backends}
        self._timeout = operation_timeout_s
        self._tasks: set[asyncio.Task] = set()

    async def _start(self, request, context, kind: str) -> str:
        if not request.job_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id is required")
        backend = self.backends.get(request.job_id)
        if backend is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"unknown job {request.job_id!r} on this sidecar; it serves {sorted(self.backends)}")
        which = request.backend_config.WhichOneof("backend") if request.HasField("backend_config") else None
        if which not in (None, "app_endpoint"):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                f"backend config {which!r} is not served by this sidecar (it serves app_endpoint)")
        mode = SuspendMode.OFFLOAD
        tags: list[str] = []
        if which == "app_endpoint":
            cfg = request.backend_config.app_endpoint
            if cfg.mode == pb.SUSPEND_MODE_DISCARD:
                mode = SuspendMode.DISCARD
            elif cfg.mode not in (pb.SUSPEND_MODE_UNSPECIFIED, pb.SUSPEND_MODE_OFFLOAD):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown suspend mode {cfg.mode}")
            tags = list(cfg.tags)
            if mode not in backend.supported_modes:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"backend {backend.name!r} does not support mode {mode.name}")
        op = Operation(uuid.uuid4().hex, request.job_id, kind)
        self._remember(op)
        task = asyncio.get_running_loop().create_task(self._run(op, backend, mode, tags))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return op.id

    def _remember(self, op: Operation) -> None:
        self.operations[op.id] = op
        if len(self.operations) > MAX_OPERATIONS_KEPT:
            for old in list(self.operations)[: len(self.operations) - MAX_OPERATIONS_KEPT]:
                if self.operations[old].done.is_set():
                    del self.operations[old]

    async def _run(self, op: Operation, backend: SnapshotBackend, mode: SuspendMode, tags: list[str]) -> None:
        async with self._locks[op.job_id]:
            self.states[op.job_id] = "TRANSITIONING"
            try:
                if op.kind == "snapshot":
                    await asyncio.wait_for(backend.suspend(mode, tags), self._timeout)
                    self.states[op.job_id] = "SAVED"
                else:
                    await asyncio.wait_for(backend.resume(tags), self._timeout)
                    self.states[op.job_id] = "RUNNING"
                op.status = pb.OPERATION_STATUS_COMPLETE
            except TimeoutError:
                op.status, op.error = pb.OPERATION_STATUS_FAILED, (
                    f"{op.kind} of job {op.job_id!r} took more than {self._timeout:g} s; the engine is left out "
                    "of service: check its logs, then retry the operation")
                self.states[op.job_id] = "FAULTED"
            except BackendError as exc:
                op.status, op.error = pb.OPERATION_STATUS_FAILED, str(exc)
                self.states[op.job_id] = "FAULTED"
            except Exception as exc:
                log.exception("operation %s crashed", op.id)
                op.status, op.error = pb.OPERATION_STATUS_FAILED, f"internal error: {exc!r}"
                self.states[op.job_id] = "FAULTED"
            finally:
                op.elapsed_ms = int((time.monotonic() - op.started) * 1000)
                op.done.set()
                log.info("operation=%s job=%s kind=%s status=%s elapsed_ms=%d%s", op.id, op.job_id, op.kind,
                         pb.OperationStatus.Name(op.status), op.elapsed_ms, f" error={op.error}" if op.error else "")

    async def Snapshot(self, request, context):  # noqa: N802
        return pb.SnapshotResponse(operation_id=await self._start(request, context, "snapshot"))

    async def Restore(self, request, context):  # noqa: N802
        return pb.RestoreResponse(operation_id=await self._start(request, context, "restore"))

    async def _op(self, operation_id: str, context) -> Operation:
        op = self.operations.get(operation_id)
        if op is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown operation {operation_id!r}")
        return op

    async def GetOperation(self, request, context):  # noqa: N802
        return (await self._op(request.operation_id, context)).to_pb()

    async def WaitOperation(self, request, context):  # noqa: N802
        op = await self._op(request.operation_id, context)
        if not 0 <= request.timeout_s <= MAX_WAIT_S:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s must be in [0, {MAX_WAIT_S:g}]")
        try:
            await asyncio.wait_for(op.done.wait(), request.timeout_s)
        except TimeoutError:
            pass
        return op.to_pb()

    async def Status(self, request, context):  # noqa: N802
        return pb.StatusResponse(
            job_statuses=[pb.JobStatus(job_id=j, state=_JOB_STATE[s]) for j, s in sorted(self.states.items())]
        )

    async def WorkloadChannel(self, request_iterator, context):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "WorkloadChannel is not served by this sidecar version; trainers offload through the "
                            "TimeSlice client (on_accelerators(state=...))")
        yield  # pragma: no cover - makes this an async generator


class SidecarServer:
    """The sidecar's gRPC server in this event loop."""

    def __init__(self, backends: dict[str, SnapshotBackend], host: str = "127.0.0.1", port: int = 9001,
                 token: str | None = None, operation_timeout_s: float = 300.0) -> None:
        self.servicer = SnapshotSidecar(backends, operation_timeout_s)
        self.host, self.port, self.token = host, port, token
        self._server: aio.Server | None = None

    async def start(self) -> None:
        self._server = aio.server(options=SERVER_OPTIONS, interceptors=auth.server_interceptors(self.token))
        pb_grpc.add_SnapshotAgentServiceServicer_to_server(self.servicer, self._server)
        xpb_grpc.add_SnapshotOperationsServiceServicer_to_server(self.servicer, self._server)
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, self._server)
        self.port = self._server.add_insecure_port(f"{self.host}:{self.port}")
        await self._server.start()
        await hs.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("sidecar %s:%d jobs=%s", self.host, self.port, sorted(self.servicer.backends))

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(1.0)
        for b in self.servicer.backends.values():
            await b.close()
