"""gRPC edge of the orchestrator: the upstream-compatible ``TimeSliceOrchestratorService``.

Wire format: ``timeslice_orchestrator.v1alpha1`` (shared/upstream-api.md). Acquire has no
timeout field upstream; the caller's gRPC deadline is the acquire timeout. Typed core errors map
to status codes here and nowhere else.
"""

from __future__ import annotations

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from llmd_timeslice import error_info
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import (
    lease_pb2,
    lease_pb2_grpc,
    orchestrator_info_pb2,
    orchestrator_info_pb2_grpc,
    weights_pb2,
    weights_pb2_grpc,
)
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as pb
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as pb_grpc
from llmd_timeslice.auth import JobAuthorizer
from llmd_timeslice.domain.group_settings import RELOAD_BASE_S, RELOAD_FLOOR_BYTES_PER_S
from llmd_timeslice.domain.switches import JobState, SwitchKind, SwitchRecord
from llmd_timeslice.orchestrator import errors
from llmd_timeslice.orchestrator import groups as core
from llmd_timeslice.orchestrator.phases import GroupState, IllegalTransition
from llmd_timeslice.orchestrator.placement_watch import hints_from_metadata
from llmd_timeslice.orchestrator.switch import SwitchActions
from llmd_timeslice.weights.update import InvalidWeightUpdate, WeightUpdate

# Upstream metric names where the meaning is the same (shared/upstream-api.md).
QUEUE_DEPTH = Gauge("timeslice_orchestrator_queue_depth", "Jobs waiting for the group.", ["group_id"])
ACQUIRE_WAIT = Histogram(
    "timeslice_orchestrator_acquire_wait_duration_seconds",
    "Seconds from Acquire to grant.",
    ["group_id"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
DEFERRED = Counter("timeslice_orchestrator_deferred_snapshots_total", "Yields that deferred the snapshot.", ["group_id"])
SWITCH_PHASE = Histogram(
    "llmd_timeslice_orchestrator_switch_phase_seconds",
    "Seconds per phase-switch step.",
    ["group_id", "phase"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)

_STATE = {
    GroupState.IDLE: pb.GroupStatus.STATE_IDLE,
    GroupState.IDLE_YIELDED: pb.GroupStatus.STATE_IDLE_YIELDED,
    GroupState.LOCKED: pb.GroupStatus.STATE_LOCKED,
    GroupState.SWITCHING: pb.GroupStatus.STATE_SWITCHING,
}
_JOB_STATE = {
    JobState.IDLE: pb.SnapshotAgentJobState.STATE_IDLE,
    JobState.RUNNING: pb.SnapshotAgentJobState.STATE_RUNNING,
    JobState.TRANSITIONING: pb.SnapshotAgentJobState.STATE_TRANSITIONING,
    JobState.SAVED: pb.SnapshotAgentJobState.STATE_SAVED,
    JobState.FAULTED: pb.SnapshotAgentJobState.STATE_FAULTED,
}
_CODES: dict[type[errors.OrchestratorError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.UnknownGroup: grpc.StatusCode.NOT_FOUND,
    errors.NotHolder: grpc.StatusCode.FAILED_PRECONDITION,
    errors.AcquireTimedOut: grpc.StatusCode.DEADLINE_EXCEEDED,
    # ABORTED, not UNAVAILABLE: clients retry UNAVAILABLE automatically, and a failed switch is not transient
    # (a retry would drain and sleep every engine again only to fail the same way).
    errors.SwitchFailed: grpc.StatusCode.ABORTED,
    errors.StaleFencingToken: grpc.StatusCode.FAILED_PRECONDITION,
    errors.LockOrderViolation: grpc.StatusCode.FAILED_PRECONDITION,
    errors.StaleWeightVersion: grpc.StatusCode.FAILED_PRECONDITION,
    IllegalTransition: grpc.StatusCode.FAILED_PRECONDITION,
}
WEIGHT_SYNC_ERROR_METADATA = "x-llmd-timeslice-weight-sync-error"
"""Trailing metadata of an Acquire granted to a job whose last published weight version failed to load."""
WEIGHT_VERSION = Gauge(
    "llmd_timeslice_orchestrator_sampler_weight_version",
    "Weight version each sampler serves (or last served, while out of service).",
    ["group_id", "address"],
)
WEIGHT_SYNC_FAILED = Gauge(
    "llmd_timeslice_orchestrator_sampler_weight_sync_failed",
    "1 while a sampler is out of service because its weight load failed.",
    ["group_id", "address"],
)
WAKE_FAILURES = Counter(
    "llmd_timeslice_orchestrator_wake_failures_total",
    "Wakes of a sampler that failed (a switch back to the samplers, a repair, a reconcile); the sampler stays out of "
    "service until a repair wakes it.",
    ["group_id", "address"],
)
LEADER = Gauge(
    "llmd_timeslice_orchestrator_leader",
    "1 while this orchestrator replica serves as the leader (always, once started, without leader election).",
)
LEADER_TERM = Gauge(
    "llmd_timeslice_orchestrator_leader_term",
    "The leader term this replica serves with (the Lease's leaseTransitions + 1; 0 without leader election).",
)


class SamplersOutOfService:
    """Scrape-time ``llmd_timeslice_orchestrator_sampler_out_of_service{group_id,address}``: 1 for each sampler a
    fault keeps out of service (its group's ``sampler_errors``), 0 for the others; over every orchestrator in
    ``orchestrators`` (the server adds its own while it runs)."""

    def __init__(self) -> None:
        self.orchestrators: list[core.Orchestrator] = []

    def collect(self):
        fam = GaugeMetricFamily(
            "llmd_timeslice_orchestrator_sampler_out_of_service",
            "1 while a fault keeps the sampler out of service (failed wake or sleep, engine dead or restarted, state "
            "unknown); 0 otherwise. Asleep for a job is not out of service.",
            labels=["group_id", "address"],
        )
        for orch in self.orchestrators:
            for g in orch.groups.values():
                for smp in g.spec.samplers:
                    fam.add_metric([g.group_id, smp.address], float(smp.address in g.sampler_errors))
        yield fam


SAMPLERS_OUT_OF_SERVICE = SamplersOutOfService()
REGISTRY.register(SAMPLERS_OUT_OF_SERVICE)

ENGINE_FAULTS = Counter(
    "llmd_timeslice_orchestrator_engine_faults_total",
    "Serving samplers whose engine the audit found restarted (another weight version) or asleep; "
    "each was taken out of service and woken again.",
    ["group_id", "reason"],
)

FENCING_TOKEN_METADATA = "x-llmd-timeslice-fencing-token"
"""Optional call metadata on Yield (project clients): the holder's fencing token, checked against the group's."""


def _token_from(context) -> int | None:
    for key, value in context.invocation_metadata() or ():
        if key == FENCING_TOKEN_METADATA:
            try:
                return int(value)
            except ValueError:
                return -1
    return None


def status_code(exc: errors.OrchestratorError) -> grpc.StatusCode:
    """The status code of a typed core error (its nearest mapped class; StateNotSaved is a SwitchFailed)."""
    for cls in type(exc).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return grpc.StatusCode.INTERNAL


async def _abort(context, exc: errors.OrchestratorError):
    """Refuse with the error's status code and its reason as a ``google.rpc.ErrorInfo`` (``error_info.py``)."""
    code = status_code(exc)
    await context.abort(code, str(exc), error_info.trailing_metadata(code.value[0], str(exc), error_info.reason_of(type(exc))))


_ALLOW_ALL = JobAuthorizer()


async def _authorize(jobs: JobAuthorizer, context, job_id: str) -> None:
    why = jobs.check(context, job_id)
    if why is not None:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)


class OrchestratorService(pb_grpc.TimeSliceOrchestratorServiceServicer):
    """Servicer over :class:`~llmd_timeslice.orchestrator.groups.Orchestrator`."""

    def __init__(self, orch: core.Orchestrator, jobs: JobAuthorizer = _ALLOW_ALL) -> None:
        self._orch = orch
        self._actions: SwitchActions = orch.actions
        self._jobs = jobs

    async def Acquire(self, request, context):  # noqa: N802
        await _authorize(self._jobs, context, request.job_id)
        remaining = context.time_remaining()
        timeout = None if remaining is None else max(0.0, remaining - 0.05)
        g = request.group_id
        try:
            if g in self._orch.groups:
                QUEUE_DEPTH.labels(group_id=g).set(len(self._orch.groups[g].waiters) + 1)
            res = await self._orch.acquire(request.job_id, g, timeout, hints_from_metadata(context.invocation_metadata()))
        except errors.OrchestratorError as exc:
            await _abort(context, exc)
        finally:
            if g in self._orch.groups:
                QUEUE_DEPTH.labels(group_id=g).set(len(self._orch.groups[g].waiters))
        ACQUIRE_WAIT.labels(group_id=g).observe(res.waited_ms / 1000)
        if res.weight_sync_error:
            context.set_trailing_metadata(((WEIGHT_SYNC_ERROR_METADATA, res.weight_sync_error[:4000]),))
        return pb.AcquireResponse(success=True, waited_ms=res.waited_ms, context_restored=res.context_restored)

    async def Yield(self, request, context):  # noqa: N802
        await _authorize(self._jobs, context, request.job_id)
        token = _token_from(context)
        if token is not None and token <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{FENCING_TOKEN_METADATA} must be a positive integer")
        try:
            res = await self._orch.yield_(request.job_id, request.group_id, token)
        except errors.OrchestratorError as exc:
            await _abort(context, exc)
        if res.snapshot_deferred:
            DEFERRED.labels(group_id=request.group_id).inc()
        return pb.YieldResponse(success=True, pending_waiters=res.pending_waiters, snapshot_deferred=res.snapshot_deferred)

    async def ListGroups(self, request, context):  # noqa: N802
        return pb.ListGroupsResponse(group_ids=sorted(self._orch.groups))

    async def GetGroupStatus(self, request, context):  # noqa: N802
        try:
            g = self._orch.group(request.group_id)
        except errors.OrchestratorError as exc:
            await _abort(context, exc)
        ts = Timestamp()
        ts.FromNanoseconds(int(g.state_since * 1e9))
        status = pb.GroupStatus(
            group_id=g.spec.group_id,
            group_state=_STATE[g.state],
            state_timestamp=ts,
            locking_job=g.holder or "",
            active_job=g.holder or (g.loaded_job if g.loaded_job and g.loaded_job != core.SAMPLERS else ""),
            waiter_queue_depth=len(g.waiters),
            loaded_job=g.loaded_job if g.loaded_job and g.loaded_job != core.SAMPLERS else "",
        )
        states = self._actions.job_states()
        agents = [
            pb.SnapshotAgentJobState(
                agent=s.sidecar, job_id=s.job_id, job_state=_JOB_STATE[states.get(s.address, JobState.RUNNING)]
            )
            for s in g.spec.samplers
        ]
        # Jobs whose lease expired are FAULTED until they acquire again (the message says what to do).
        agents += [
            pb.SnapshotAgentJobState(agent="orchestrator", job_id=job, job_state=pb.SnapshotAgentJobState.STATE_FAULTED)
            for job in sorted(g.expired_jobs)
        ]
        return pb.GetGroupStatusResponse(group=status, agent_job_states=agents)


def export_switch(record: SwitchRecord) -> None:
    """``on_switch`` hook of the core: phase durations into the histogram."""
    for phase, secs in record.phases.items():
        if phase != "drained_in_time":
            SWITCH_PHASE.labels(group_id=record.group_id, phase=phase).observe(secs)
    for address, version in record.sampler_versions.items():
        WEIGHT_VERSION.labels(group_id=record.group_id, address=address).set(version)
        WEIGHT_SYNC_FAILED.labels(group_id=record.group_id, address=address).set(int(address in record.sampler_errors))
    for fault in record.engine_faults.values():
        ENGINE_FAULTS.labels(group_id=record.group_id, reason=fault.value).inc()
    if record.kind is not SwitchKind.TO_JOB:  # a switch back to the samplers: each error is a failed wake
        for address in record.sampler_errors:
            WAKE_FAILURES.labels(group_id=record.group_id, address=address).inc()


class LeaseServicer(lease_pb2_grpc.LeaseServiceServicer):
    """Project extension: fenced leases with heartbeats (``llmd_timeslice.v1alpha1.LeaseService``)."""

    def __init__(self, orch: core.Orchestrator, jobs: JobAuthorizer = _ALLOW_ALL) -> None:
        self._orch = orch
        self._jobs = jobs

    @staticmethod
    def _wire(lease: core.Lease, group_id: str, now: float) -> lease_pb2.Lease:
        left = max(0.0, lease.expires_at - now) if lease.expires_at is not None else 0.0
        return lease_pb2.Lease(
            job_id=lease.job_id,
            group_id=group_id,
            fencing_token=lease.token,
            ttl_s=lease.ttl_s,
            expires_in_s=left,
            yield_requested=yield_requested(lease.yield_request, now),
        )

    async def GetLease(self, request, context):  # noqa: N802
        await _authorize(self._jobs, context, request.job_id)
        try:
            lease = self._orch.lease(request.job_id, request.group_id)
        except errors.OrchestratorError as exc:
            await _abort(context, exc)
        return self._wire(lease, request.group_id, self._orch.clock.now())

    async def Heartbeat(self, request, context):  # noqa: N802
        await _authorize(self._jobs, context, request.job_id)
        try:
            lease = await self._orch.heartbeat(request.job_id, request.group_id, request.fencing_token)
        except errors.OrchestratorError as exc:
            await _abort(context, exc)
        return self._wire(lease, request.group_id, self._orch.clock.now())

    async def RequestYield(self, request, context):  # noqa: N802
        """Ask the group's holder to yield at its next safe point (operators, tests). Answers ``requested=false``
        with the reason for a group nobody holds or a policy refusal (naming the knob); NOT_FOUND for an unknown
        group, INVALID_ARGUMENT for a malformed deadline; PERMISSION_DENIED for a job's own token (with per-job
        tokens a job may not push another off its group: the control token asks)."""
        owner = self._jobs.job_of(context)
        if owner is not None:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"RequestYield takes the control token, not job {owner!r}'s own token"
            )
        try:
            answer = await self._orch.request_yield(request.group_id, request.reason, request.band, request.hold_deadline_s)
        except errors.OrchestratorError as exc:
            await _abort(context, exc)
        return lease_pb2.RequestYieldResponse(requested=answer.requested, holder=answer.holder, detail=answer.detail)


def yield_requested(req: core.YieldRequest | None, now: float) -> lease_pb2.YieldRequested | None:
    """The wire form of a lease's yield request (None: none)."""
    if req is None:
        return None
    return lease_pb2.YieldRequested(
        reason=req.reason,
        band=req.band,
        objective=req.objective,
        hold_deadline_s=req.hold_deadline_s,
        requested_ago_s=max(0.0, now - req.requested_at),
        pool=req.pool,
    )


class OrchestratorInfo(orchestrator_info_pb2_grpc.OrchestratorInfoServiceServicer):
    """Project extension: recent phase switches per group (``llmd_timeslice.v1alpha1.OrchestratorInfoService``)."""

    def __init__(self, orch: core.Orchestrator) -> None:
        self._orch = orch

    async def ListSwitches(self, request, context):  # noqa: N802
        if request.limit < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"limit must be >= 0, got {request.limit}")
        if request.group_id:
            try:
                groups = [self._orch.group(request.group_id)]
            except errors.OrchestratorError as exc:
                await _abort(context, exc)
        else:
            groups = list(self._orch.groups.values())
        records = sorted((r for g in groups for r in g.history), key=lambda r: r.started_at, reverse=True)
        return orchestrator_info_pb2.ListSwitchesResponse(
            switches=[
                orchestrator_info_pb2.SwitchInfo(
                    group_id=r.group_id,
                    kind=r.kind.value,
                    job_id=r.job_id,
                    started_at_unix_s=r.started_at,
                    ok=r.ok,
                    error=r.error,
                    phase_seconds={k: v for k, v in r.phases.items() if k != "drained_in_time"},
                    drain_cut_request_ids=r.drain_cut,
                    parked_requests=r.parked_requests,
                    cause=r.cause,
                )
                for r in records[: request.limit or 10]
            ]
        )

    async def ListYieldRequests(self, request, context):  # noqa: N802
        """Yield requests per group (sent, honoured, ignored, suppressed) and the one the holder carries now."""
        if request.group_id:
            try:
                groups = [self._orch.group(request.group_id)]
            except errors.OrchestratorError as exc:
                await _abort(context, exc)
        else:
            groups = [self._orch.groups[gid] for gid in sorted(self._orch.groups)]
        now = self._orch.clock.now()
        return orchestrator_info_pb2.ListYieldRequestsResponse(
            groups=[
                orchestrator_info_pb2.GroupYieldRequests(
                    group_id=g.group_id,
                    sent=g.yield_stats.sent,
                    honoured=g.yield_stats.honoured,
                    ignored=g.yield_stats.ignored,
                    suppressed=g.yield_stats.suppressed,
                    holder=g.holder or "",
                    current=yield_requested(g.lease.yield_request if g.lease is not None else None, now),
                )
                for g in groups
            ]
        )

    async def ListGroupDeadlines(self, request, context):  # noqa: N802
        """Each group's sleep, wake and reload deadlines (docs/group-settings.md; reload 0: by the version's bytes)."""
        if request.group_id:
            try:
                groups = [self._orch.group(request.group_id)]
            except errors.OrchestratorError as exc:
                await _abort(context, exc)
        else:
            groups = [self._orch.groups[gid] for gid in sorted(self._orch.groups)]
        rule = f"{RELOAD_BASE_S:g} s + the version's bytes at {RELOAD_FLOOR_BYTES_PER_S / 2**20:g} MiB/s"
        return orchestrator_info_pb2.ListGroupDeadlinesResponse(
            groups=[
                orchestrator_info_pb2.GroupDeadlines(
                    group_id=g.group_id,
                    sleep_s=g.spec.sleep_deadline_s,
                    wake_s=g.spec.wake_deadline_s,
                    reload_s=g.spec.reload_deadline_s or 0.0,
                    reload_rule=rule,
                )
                for g in groups
            ]
        )

    async def ListProfiles(self, request, context):  # noqa: N802
        """Per-job phase profiles, measured switch costs and the last placement check (docs/placement.md)."""
        watch = self._orch.lease_events
        if watch is None:
            return orchestrator_info_pb2.ListProfilesResponse()
        return watch.list_profiles(request.job_id)


def weight_status(g: core.Group) -> weights_pb2.WeightVersionStatus:
    """The wire status of ``g``'s weight versions (``pending``: the target while a sampler is below it;
    ``rejected``: the latest published version samplers refused, until a newer one is published)."""
    target = g.target_weights
    pending = target if target is not None and any(v < target.version for v in g.sampler_versions.values()) else None
    rejected = (
        weights_pb2.RejectedWeightVersion(version=g.rejected.version, error=g.rejected.error[:4000])
        if g.rejected is not None
        else None
    )
    return weights_pb2.WeightVersionStatus(
        group_id=g.spec.group_id,
        serving_version=g.serving_version,
        pending=pending.to_pb() if pending is not None else None,
        samplers=[
            weights_pb2.SamplerWeightVersion(
                address=a, version=v, in_service=a not in g.sampler_errors, error=g.sampler_errors.get(a, "")
            )
            for a, v in sorted(g.sampler_versions.items())
        ],
        last_error=g.last_error,
        rejected=rejected,
    )


class WeightVersionServicer(weights_pb2_grpc.WeightVersionServiceServicer):
    """Project ``WeightVersionService``: a holder publishes the next weight version; anyone reads status."""

    def __init__(self, orch: core.Orchestrator, jobs: JobAuthorizer = _ALLOW_ALL) -> None:
        self._orch = orch
        self._jobs = jobs

    async def PublishWeightVersion(self, request, context):  # noqa: N802
        await _authorize(self._jobs, context, request.job_id)
        if not request.HasField("weights"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "weights is required")
        if request.fencing_token < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fencing_token must be >= 0")
        try:
            update = WeightUpdate.from_pb(request.weights)
        except InvalidWeightUpdate as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            g = await self._orch.publish_weights(request.job_id, request.group_id, update, request.fencing_token or None)
        except errors.OrchestratorError as exc:
            await _abort(context, exc)
        return weight_status(g)

    async def GetWeightVersion(self, request, context):  # noqa: N802
        try:
            g = self._orch.group(request.group_id)
        except errors.OrchestratorError as exc:
            await _abort(context, exc)
        return weight_status(g)
