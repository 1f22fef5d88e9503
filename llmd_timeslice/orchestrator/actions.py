"""Phase-switch actions over gRPC: the gate's state stream and the snapshot sidecars.

Drain (phase DRAINING): publish DRAINING on the gate state stream (returns once every connected
gate acked the epoch), then wait on each gate's drain barrier (an event on the gate, not a poll).
Suspend (SUSPENDING): ask each sidecar to sleep its engine (:meth:`GrpcSwitchActions.suspend_sampler`)
and wait for the operation's completion event (one command and one event on the sidecar's operation
stream, ``RunOperations``, a project extension: :mod:`~llmd_timeslice.orchestrator.sidecar_stream`;
``Snapshot`` + ``WaitOperationResult`` for a sidecar without it; the reference design polls
``GetOperation`` each second), then publish ASLEEP. Resume (RESUMING,
REPAIRING): publish WAKING, wake each engine (:meth:`GrpcSwitchActions.resume_sampler`), and publish
each endpoint SERVING as soon as its own wake is verified, so held requests start leaving before
the slowest engine is back.

Weight sync: when the switch record carries a weight version, each sampler is woken with
``RestoreWithWeights`` (wake weights, load, wake kv_cache, reset prefix cache, verify the version)
and published SERVING *at that version*. A sampler that refuses the version (the sidecar reports
``OPERATION_FAULT_WEIGHTS_REJECTED``: its files failed verification or loading failed) is woken
again with a plain ``Restore``, which reloads its last good version; if that works, the version was
at fault (``record.weights_rejected`` says why) and the sampler is published SERVING at its last
good version. A sampler whose wake fails otherwise (the fallback included: then the engine, not the
version, is suspect) is published ASLEEP (out of service) and keeps its old version. The sleep level of a switch to a job
is the record's (the group's per-job policy), else the group's.

Optional serving label (the label fallback, for gateways that cannot run the gate): with a
``labeler``, each sampler is labelled not serving when it is published DRAINING (before the drain
wait; a failure fails the switch, since without the label the router keeps sending to it) and
serving once its wake is verified, just before it is published SERVING (a failure leaves it out of
service, like a failed wake).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import ClassVar, Protocol

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmd_timeslice import auth, tls
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as gpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2_grpc as xpb_grpc
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as spb
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as spb_grpc
from llmd_timeslice.domain.group_settings import MAX_DEADLINE_S, GroupSpec, SamplerEndpoint
from llmd_timeslice.domain.switches import EngineReading, JobState, SamplerStepFailed, StepFault, SwitchRecord
from llmd_timeslice.orchestrator.gate_hub import GateHub
from llmd_timeslice.orchestrator.sidecar_stream import (
    PROBE_AFTER_S,
    OperationRefused,
    OperationStream,
    Probe,
    StreamBroken,
    StreamUnsupported,
)
from llmd_timeslice.orchestrator.switch import SwitchActions
from llmd_timeslice.weights.update import WeightUpdate

log = logging.getLogger(__name__)

FENCED_TERM_KEY = "x-llmd-timeslice-fenced-term"
"""Trailing metadata of a sidecar's fenced refusal (the highest leader term it saw; llmd_timeslice/snapshot/server.py)."""

RPC_TIMEOUT_S = 10.0
START_RPC_TIMEOUT_S = 6.0
"""Deadline of the calls that start a sidecar operation; they wait for the channel to be ready (a sidecar that is
reconnecting is reached within the 5 s back-off cap), so a dead sidecar fails the switch after this long."""


def operation_deadlines(spec: GroupSpec) -> xpb.OperationDeadlines:
    """``spec``'s sleep, wake and reload deadlines as a command carries them (reload 0: by the version's bytes,
    computed by the sidecar, which knows them)."""
    return xpb.OperationDeadlines(
        sleep_s=spec.sleep_deadline_s, wake_s=spec.wake_deadline_s, reload_s=spec.reload_deadline_s or 0.0
    )


def operation_wait_s(spec: GroupSpec, kind: str) -> float:
    """How long the orchestrator waits for a sidecar's answer to a ``kind`` ("sleep" or "wake") operation: its
    deadline, and for a wake one weight reload's on top (the sidecar enforces both; an unset reload deadline, known
    only to the sidecar by the bytes, is waited for up to the longest one the setting allows). A sidecar that dies
    meanwhile breaks the operation stream first."""
    if kind == "sleep":
        return spec.sleep_deadline_s
    reload_s = spec.reload_deadline_s or MAX_DEADLINE_S
    return spec.wake_deadline_s + reload_s


_STEP_FAULTS: dict[int, StepFault] = {
    xpb.OPERATION_FAULT_WEIGHTS_REJECTED: StepFault.WEIGHTS_REJECTED,
    xpb.OPERATION_FAULT_ENGINE_UNREACHABLE: StepFault.ENGINE_UNREACHABLE,
    xpb.OPERATION_FAULT_ENGINE_FAILED: StepFault.ENGINE_FAILED,
}
"""A failed operation's fault (snapshot_ext.proto) -> the step's fault; any other: StepFault.ENGINE."""


class ServingLabeler(Protocol):
    """Marks a sampler serving or not outside the gate (e.g. :class:`~llmd_timeslice.discovery.kubernetes.PodLabeler`,
    the pod label ``timeslice.io/serving``). Raises on failure."""

    async def set_serving(self, sampler: SamplerEndpoint, serving: bool) -> None: ...


class GrpcSwitchActions(SwitchActions):
    """:class:`~llmd_timeslice.orchestrator.switch.SwitchActions` over the gate state stream and the sidecars.

    Args:
        hub: the gate state hub (gates subscribe to it).
        token: bearer token for the sidecars (None: no auth).
        operation_timeout_s: most seconds one sleep or wake may take before the switch fails.
        start_rpc_timeout_s: deadline (seconds) of the call that starts a sleep or wake on a sidecar, which waits
            for the channel to be ready: a dead sidecar fails the switch after this long (``START_RPC_TIMEOUT_S``);
            also the deadline of the reachability probe of a command without an answer.
        probe_after_s: seconds after which a command without an answer gets that probe, and again this often
            (``PROBE_AFTER_S``; sidecar_stream.py).
        labeler: optional serving-label hook (None: gates only).
        tls_files: mutual TLS for the sidecar channels (None: plain TCP).
    """

    can_read_engines: ClassVar[bool] = True

    def __init__(
        self,
        hub: GateHub,
        token: str | None = None,
        operation_timeout_s: float = 300.0,
        labeler: ServingLabeler | None = None,
        tls_files: tls.TlsFiles | None = None,
        start_rpc_timeout_s: float = START_RPC_TIMEOUT_S,
        probe_after_s: float = PROBE_AFTER_S,
    ) -> None:
        self._tls = tls_files
        self.probe_after_s = probe_after_s
        self.hub = hub
        self.labeler = labeler
        self._token = token
        self.operation_timeout_s = operation_timeout_s
        self.start_rpc_timeout_s = start_rpc_timeout_s
        self._channels: dict[str, aio.Channel] = {}
        self._retired: set[aio.Channel] = set()
        """Channels dropped after an unanswered probe, closing (:meth:`_retire_channel`)."""
        self._stub_cache: dict[str, tuple[spb_grpc.SnapshotAgentServiceStub, xpb_grpc.SnapshotOperationsServiceStub]] = {}
        self._streams: dict[str, OperationStream] = {}
        self._md = auth.call_metadata(token)
        self.sampler_states: dict[str, JobState] = {}
        self.term = 0
        """Leader term sent with every Snapshot/Restore (fencing; 0: no leader election)."""
        self.on_fenced: Callable[[str, int, int], object] | None = None
        """Called with (sidecar, refused term, the sidecar's highest term) when a sidecar refuses a command as fenced."""

    def job_states(self) -> Mapping[str, JobState]:
        return self.sampler_states

    def _stubs(self, target: str) -> tuple[spb_grpc.SnapshotAgentServiceStub, xpb_grpc.SnapshotOperationsServiceStub]:
        """The sidecar stubs on ``target``'s channel, made once (a stub builds a callable per method)."""
        stubs = self._stub_cache.get(target)
        if stubs is None:
            ch = self._channel(target)
            stubs = self._stub_cache[target] = (spb_grpc.SnapshotAgentServiceStub(ch), xpb_grpc.SnapshotOperationsServiceStub(ch))
        return stubs

    def _channel(self, target: str) -> aio.Channel:
        ch = self._channels.get(target)
        if ch is None:
            # tls.aio_channel caps the reconnect back-off at 5 s: the engine audit keeps probing a dead sidecar,
            # and with gRPC's default (up to 120 s) a sidecar back after a minute stayed unreachable (fail-fast
            # UNAVAILABLE) for tens of seconds more (found by tests/local/test_stack_up.py).
            # The token goes as call metadata (self._md), not through an interceptor: grpc.aio runs an intercepted
            # call as an extra task, a measurable share of a switch's CPU per sampler
            # (docs/decisions/sidecar-operation-stream.md).
            # Its own subchannel pool: by default channels to one target with the same settings share a connection,
            # and a channel made anew after a probe went unanswered (_retire_channel) would get the dead one again.
            ch = self._channels[target] = tls.aio_channel(target, self._tls, options=[("grpc.use_local_subchannel_pool", 1)])
        return ch

    def _operation_stream(self, sampler: SamplerEndpoint) -> OperationStream:
        """The operation stream to ``sampler``'s sidecar (made on first use), with the current start deadline."""
        stream = self._streams.get(sampler.sidecar)
        if stream is None:
            target = sampler.sidecar
            stream = self._streams[target] = OperationStream(
                self._stubs(target)[1],
                self._md,
                self.start_rpc_timeout_s,
                probe=self._reachable(target),
                probe_after_s=self.probe_after_s,
                on_unreachable=lambda: self._retire_channel(target),
            )
        stream.open_timeout_s = self.start_rpc_timeout_s
        return stream

    def _reachable(self, target: str) -> Probe:
        """The operation stream's reachability probe of the sidecar at ``target``: a gRPC health check on its channel;
        any answer, an error status included, means it is reachable (sidecar_stream.py)."""
        stub = health_pb2_grpc.HealthStub(self._channel(target))  # its stubs (types-grpcio-health-checking) declare no methods

        async def probe(timeout_s: float) -> bool:
            try:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s, metadata=self._md)  # type: ignore[attr-defined]
            except aio.AioRpcError as exc:
                return exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED
            return True

        return probe

    def _retire_channel(self, target: str) -> None:
        """The sidecar at ``target`` left a probe unanswered: its channel (and the connection under it, which may stay
        dead for tens of seconds after the network is back: TCP's retransmissions back off) is dropped, so the next
        call to it connects anew and reaches it as soon as it is reachable. Calls still on the old channel get
        ``RPC_TIMEOUT_S`` to end before it is closed."""
        ch = self._channels.pop(target, None)
        self._stub_cache.pop(target, None)
        self._streams.pop(target, None)
        if ch is None:
            return
        log.warning("sidecar %s did not answer a probe: its connection is dropped, the next call connects anew", target)
        self._retired.add(ch)
        task = asyncio.get_running_loop().create_task(ch.close(grace=RPC_TIMEOUT_S))
        task.add_done_callback(lambda _t: self._retired.discard(ch))

    async def close(self) -> None:
        for ch in list(self._retired):
            await ch.close()
        self._retired.clear()
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._stub_cache.clear()

    # ------------------------------------------------------------------- gates
    async def _publish(
        self, samplers: list[SamplerEndpoint], state: gpb.EndpointState, weight_version: int | None = None
    ) -> None:
        """Set ``state`` for ``samplers`` and wait until every connected gate acked it."""
        by_pool: dict[str, list[SamplerEndpoint]] = defaultdict(list)
        for s in samplers:
            by_pool[s.pool].append(s)
        for pool, eps in by_pool.items():
            await self.hub.publish(pool, [(e.address, state, weight_version) for e in eps])

    async def _wait_drained(self, samplers: list[SamplerEndpoint], timeout_s: float, cut: list[str] | None = None) -> bool:
        """The gates' drain barrier; at ``timeout_s`` the gates answer 503 drain_deadline to requests that had not
        reached a response yet (their ids go to ``cut``); those already responding finish (sleep mode=wait)."""
        by_pool: dict[str, list[str]] = defaultdict(list)
        for s in samplers:
            by_pool[s.pool].append(s.address)
        results = await asyncio.gather(*(self.hub.wait_drained(p, a, timeout_s, cut) for p, a in by_pool.items()))
        drained = all(d for d, _ in results)
        if not drained:
            left = {k: v for _, m in results for k, v in m.items() if v}
            log.warning(
                "drain deadline (%.1f s) passed with requests still in flight: %s; the engines' own "
                "sleep(mode=wait) finishes them",
                timeout_s,
                left,
            )
        return drained

    async def _set_serving(self, samplers: list[SamplerEndpoint], serving: bool) -> None:
        """Serving label on each sampler (no-op without a labeler); raises the first failure."""
        if self.labeler is None or not samplers:
            return
        results = await asyncio.gather(*(self.labeler.set_serving(s, serving) for s in samplers), return_exceptions=True)
        errors = [f"{s.address}: {r}" for s, r in zip(samplers, results, strict=True) if isinstance(r, BaseException)]
        if errors:
            raise SamplerStepFailed(
                ", ".join(s.address for s in samplers),
                "label",
                StepFault.LABEL,
                f"serving label {str(serving).lower()}: " + "; ".join(errors),
            )

    # ---------------------------------------------------------------- sidecars
    async def _operation(
        self,
        sampler: SamplerEndpoint,
        group: str,
        kind: str,
        config: spb.BackendConfig,
        weights: WeightUpdate | None = None,
        residual_budget_bytes: int = 0,
        spec: GroupSpec | None = None,
    ) -> spb.GetOperationResponse:
        """One sleep or wake through the sidecar, waited for; returns the finished operation. ``residual_budget_bytes``:
        a sleep's device-memory budget (the group's for its level; 0: the sidecar's default). The command carries
        ``spec``'s deadlines (:func:`operation_deadlines`), and the wait for its answer outlasts them. Raises
        :class:`SamplerStepFailed`."""
        stream = self._operation_stream(sampler)
        snapshot = spb.SnapshotRequest(
            job_id=sampler.job_id,
            group=group,
            backend_config=config,
            leader_term=self.term,
            device_residual_budget_bytes=residual_budget_bytes,
        )
        if stream.unsupported:
            return await self._operation_unary(sampler, group, kind, config, weights, snapshot)
        cmd = xpb.OperationCommand()
        wait_s = self.operation_timeout_s
        if spec is not None:
            cmd.deadlines.CopyFrom(operation_deadlines(spec))
            wait_s = operation_wait_s(spec, kind)
        if kind == "sleep":
            cmd.snapshot.CopyFrom(snapshot)
        else:
            restore = spb.RestoreRequest(job_id=sampler.job_id, group=group, backend_config=config, leader_term=self.term)
            if weights is None:
                cmd.restore.CopyFrom(restore)
            else:
                cmd.restore_with_weights.CopyFrom(xpb.RestoreWithWeightsRequest(restore=restore, weights=weights.to_pb()))
        try:
            result = await stream.run(cmd, wait_s + RPC_TIMEOUT_S)
        except StreamUnsupported:
            return await self._operation_unary(sampler, group, kind, config, weights, snapshot)
        except (StreamBroken, OperationRefused, TimeoutError) as exc:
            self.sampler_states[sampler.address] = JobState.FAULTED
            if isinstance(exc, OperationRefused) and exc.fenced_term:
                self._fenced(sampler, exc.fenced_term)
            why = str(exc) if not isinstance(exc, TimeoutError) else f"DEADLINE_EXCEEDED: {exc}"
            raise SamplerStepFailed(
                sampler.address, kind, StepFault.SIDECAR, f"{kind} of {sampler.address} via sidecar {sampler.sidecar}: {why}"
            ) from exc
        return self._finished(sampler, kind, result.operation, result.fault)

    def _finished(
        self, sampler: SamplerEndpoint, kind: str, op: spb.GetOperationResponse, fault: int
    ) -> spb.GetOperationResponse:
        """``op`` if it COMPLETED; else SamplerStepFailed (WEIGHTS_REJECTED or ENGINE, by ``fault``)."""
        if op.status != spb.OPERATION_STATUS_COMPLETE:
            self.sampler_states[sampler.address] = JobState.FAULTED
            why = op.error if op.HasField("error") else f"status {spb.OperationStatus.Name(op.status)}"
            step_fault = _STEP_FAULTS.get(int(fault), StepFault.ENGINE)
            raise SamplerStepFailed(sampler.address, kind, step_fault, f"{kind} of {sampler.address} failed: {why}")
        return op

    async def _operation_unary(
        self,
        sampler: SamplerEndpoint,
        group: str,
        kind: str,
        config: spb.BackendConfig,
        weights: WeightUpdate | None = None,
        snapshot: spb.SnapshotRequest | None = None,
    ) -> spb.GetOperationResponse:
        """:meth:`_operation` over the unary calls, for a sidecar without ``RunOperations`` (an older release);
        ``snapshot``: the sleep's request as :meth:`_operation` built it."""
        stub, waiter = self._stubs(sampler.sidecar)
        md = self._md
        fault = xpb.OPERATION_FAULT_UNSPECIFIED
        try:
            # wait_for_ready: a sidecar that is (re)connecting gets start_rpc_timeout_s, not a fail-fast error.
            if kind == "sleep":
                resp = await stub.Snapshot(
                    snapshot
                    or spb.SnapshotRequest(job_id=sampler.job_id, group=group, backend_config=config, leader_term=self.term),
                    timeout=self.start_rpc_timeout_s,
                    wait_for_ready=True,
                    metadata=md,
                )
            else:
                restore = spb.RestoreRequest(job_id=sampler.job_id, group=group, backend_config=config, leader_term=self.term)
                if weights is None:
                    resp = await stub.Restore(restore, timeout=self.start_rpc_timeout_s, wait_for_ready=True, metadata=md)
                else:
                    resp = await waiter.RestoreWithWeights(
                        xpb.RestoreWithWeightsRequest(restore=restore, weights=weights.to_pb()),
                        timeout=self.start_rpc_timeout_s,
                        wait_for_ready=True,
                        metadata=md,
                    )
            wait = xpb.WaitOperationRequest(operation_id=resp.operation_id, timeout_s=self.operation_timeout_s)
            try:
                result = await waiter.WaitOperationResult(wait, timeout=self.operation_timeout_s + RPC_TIMEOUT_S, metadata=md)
                op, fault = result.operation, result.fault
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                # A sidecar of an older release: no fault kinds.
                op = await waiter.WaitOperation(wait, timeout=self.operation_timeout_s + RPC_TIMEOUT_S, metadata=md)
        except grpc.aio.AioRpcError as exc:
            self.sampler_states[sampler.address] = JobState.FAULTED
            self._check_fenced(sampler, exc)
            raise SamplerStepFailed(
                sampler.address,
                kind,
                StepFault.SIDECAR,
                f"{kind} of {sampler.address} via sidecar {sampler.sidecar}: {exc.code().name}: {exc.details()}",
            ) from exc
        return self._finished(sampler, kind, op, fault)

    def _check_fenced(self, sampler: SamplerEndpoint, exc: grpc.aio.AioRpcError) -> None:
        """A sidecar's fenced refusal (FAILED_PRECONDITION with the highest term it saw: snapshot/server.py) tells
        this orchestrator it was deposed: ``on_fenced`` (the server steps down)."""
        if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
            return
        for key, value in exc.trailing_metadata() or ():
            if key == FENCED_TERM_KEY:
                self._fenced(sampler, int(value))
                return

    def _fenced(self, sampler: SamplerEndpoint, highest: int) -> None:
        log.error(
            "sidecar %s refused a command of leader term %d: it has seen term %s (a newer leader)",
            sampler.sidecar,
            self.term,
            highest,
        )
        if self.on_fenced is not None:
            self.on_fenced(sampler.sidecar, self.term, highest)

    @staticmethod
    def _config(level: int) -> spb.BackendConfig:
        mode = spb.SUSPEND_MODE_DISCARD if level == 2 else spb.SUSPEND_MODE_OFFLOAD
        return spb.BackendConfig(app_endpoint=spb.AppEndpointConfig(app=spb.APP_VLLM, mode=mode))

    async def suspend_sampler(
        self, spec: GroupSpec, sampler: SamplerEndpoint, config: spb.BackendConfig, record: SwitchRecord | None = None
    ) -> None:
        """Put one sampler's engine to sleep through its sidecar, verified there; requests the sidecar found
        parked inside the sleeping engine (and what it did with them) go to ``record.parked_requests``.
        Raises SamplerStepFailed."""
        self.sampler_states[sampler.address] = JobState.TRANSITIONING
        level = 2 if config.app_endpoint.mode == spb.SUSPEND_MODE_DISCARD else 1
        op = await self._operation(
            sampler, spec.group_id, "sleep", config, residual_budget_bytes=spec.residual_budget_for(level), spec=spec
        )
        self.sampler_states[sampler.address] = JobState.SAVED
        if record is not None and op.parked_requests:
            record.parked_requests[sampler.address] = f"{op.parked_requests} {op.parked_action}"

    async def resume_sampler(
        self, spec: GroupSpec, sampler: SamplerEndpoint, record: SwitchRecord, config: spb.BackendConfig
    ) -> None:
        """Wake one sampler (loading ``record.weights``; on a rejected version, its last good one), label it,
        publish it SERVING at the version it serves. On failure: published ASLEEP, error in
        ``record.sampler_errors``, and SamplerStepFailed raised."""
        weights = record.weights
        address = sampler.address
        self.sampler_states[address] = JobState.TRANSITIONING
        loaded = weights is not None
        try:
            try:
                await self._operation(sampler, spec.group_id, "wake", config, weights, spec=spec)
            except SamplerStepFailed as exc:
                if weights is None or exc.fault is not StepFault.WEIGHTS_REJECTED:
                    raise
                # Wake it with its last good version (a plain restore reloads it) so the pool keeps serving. Only
                # if that works was the version at fault rather than the engine.
                log.error(
                    "sampler %s refused weight version %d (%s); waking it with its last good version",
                    address,
                    weights.version,
                    exc,
                )
                loaded = False
                try:
                    await self._operation(sampler, spec.group_id, "wake", config, spec=spec)
                except SamplerStepFailed as again:
                    raise SamplerStepFailed(
                        address, "wake", again.fault, f"{exc}; waking it with its last good version failed too: {again}"
                    ) from again
                record.weights_rejected[address] = str(exc)
            await self._set_serving([sampler], True)
        except Exception as exc:
            record.sampler_errors[address] = str(exc)
            await self._publish([sampler], gpb.ENDPOINT_STATE_ASLEEP)  # out of service, never half-awake
            if self.labeler is not None:
                try:
                    await self._set_serving([sampler], False)
                except Exception as label_exc:
                    log.error("serving label of %s could not be cleared: %s", address, label_exc)
            raise
        if loaded and weights is not None:
            record.sampler_versions[address] = weights.version
        # In an epoch shared with the samplers verified while the previous SERVING epoch waited for its acks
        # (GateHub.publish_coalesced): never later than one ack round after this sampler's own verification.
        await self.hub.publish_coalesced(
            sampler.pool, [(address, gpb.ENDPOINT_STATE_SERVING, record.sampler_versions.get(address))]
        )
        self.sampler_states[address] = JobState.RUNNING

    # ------------------------------------------------------------ SwitchActions
    async def drain_samplers(self, spec: GroupSpec, record: SwitchRecord) -> None:
        t = time.monotonic()
        await self._publish(spec.samplers, gpb.ENDPOINT_STATE_DRAINING)
        await self._set_serving(spec.samplers, False)
        record.phases["publish_draining"] = time.monotonic() - t
        t = time.monotonic()
        record.phases["drained_in_time"] = float(await self._wait_drained(spec.samplers, spec.drain_timeout_s, record.drain_cut))
        if record.drain_cut:
            log.warning(
                "group=%s drain deadline: %d request(s) answered 503 drain_deadline: %s",
                spec.group_id,
                len(record.drain_cut),
                record.drain_cut,
            )
        record.phases["drain"] = time.monotonic() - t

    async def suspend_samplers(self, spec: GroupSpec, record: SwitchRecord) -> None:
        """Put every sampler to sleep. A sampler whose engine is down (nothing answers at its address, or its engine
        core is dead: the sidecar says so, ``StepFault.ENGINE_UNREACHABLE``) holds no accelerator memory: it is left
        out, named in ``record.unreachable``, and the sleep goes on with the others (issue 38 §5). Any other
        failure raises (the first, once every sampler's sleep ended)."""
        t = time.monotonic()
        cfg = self._config(record.sleep_level or spec.sleep_level)
        results = await asyncio.gather(
            *(self.suspend_sampler(spec, s, cfg, record) for s in spec.samplers), return_exceptions=True
        )
        record.phases["sleep"] = time.monotonic() - t
        for s, r in zip(spec.samplers, results, strict=True):
            if isinstance(r, SamplerStepFailed) and r.fault is StepFault.ENGINE_UNREACHABLE:
                record.unreachable[s.address] = str(r)
                log.warning("group=%s sampler %s left out of the sleep: its engine is down (%s)", spec.group_id, s.address, r)
        for r in results:
            if isinstance(r, BaseException) and not (
                isinstance(r, SamplerStepFailed) and r.fault is StepFault.ENGINE_UNREACHABLE
            ):
                raise r
        await self._publish(spec.samplers, gpb.ENDPOINT_STATE_ASLEEP)

    async def resume_samplers(self, spec: GroupSpec, record: SwitchRecord) -> None:
        t = time.monotonic()
        await self._publish(spec.samplers, gpb.ENDPOINT_STATE_WAKING)
        cfg = self._config(spec.sleep_level)
        results = await asyncio.gather(
            *(self.resume_sampler(spec, s, record, cfg) for s in spec.samplers), return_exceptions=True
        )
        record.phases["wake"] = time.monotonic() - t
        errors = [str(r) for r in results if isinstance(r, BaseException)]
        if errors:
            raise RuntimeError("; ".join(errors))

    async def read_engines(self, spec: GroupSpec) -> dict[str, EngineReading]:
        """Each sampler's engine as its sidecar reads it (``GetServedWeightVersion``, snapshot_ext.proto);
        samplers whose sidecar cannot tell (another backend, no answer) are left out."""

        async def read(s: SamplerEndpoint) -> EngineReading | None:
            stub = self._stubs(s.sidecar)[1]
            try:
                r = await stub.GetServedWeightVersion(
                    xpb.GetServedWeightVersionRequest(job_id=s.job_id), timeout=RPC_TIMEOUT_S, metadata=self._md
                )
            except grpc.aio.AioRpcError as exc:
                log.debug("engine audit: %s via %s: %s %s", s.address, s.sidecar, exc.code().name, exc.details())
                return None
            return EngineReading(r.weight_version if r.known else None, r.sleeping, r.engine_unreachable)

        readings = await asyncio.gather(*(read(s) for s in spec.samplers))
        return {s.address: r for s, r in zip(spec.samplers, readings, strict=True) if r is not None}

    async def take_out_of_service(self, spec: GroupSpec) -> None:
        """Publish ``spec.samplers`` DRAINING (waits for every gate, lost ones included) and drop their serving
        label; requests already on them finish."""
        await self._publish(spec.samplers, gpb.ENDPOINT_STATE_DRAINING)
        for s in spec.samplers:
            self.sampler_states[s.address] = JobState.FAULTED
        await self._set_serving(spec.samplers, False)

    async def retire_samplers(self, samplers: list[SamplerEndpoint]) -> None:
        """Samplers that left their group: published ASLEEP where a gate knows them (the state stream has no
        "removed"), forgotten here."""
        by_pool: dict[str, list[str]] = defaultdict(list)
        for s in samplers:
            self.sampler_states.pop(s.address, None)
            by_pool[s.pool].append(s.address)
        for pool, addrs in by_pool.items():
            known = [a for a in addrs if a in self.hub.state.get(pool, {})]
            if known:
                await self.hub.publish(pool, [(a, gpb.ENDPOINT_STATE_ASLEEP, None) for a in known])

    async def publish_asleep(self, spec: GroupSpec) -> None:
        """At start-up, for a group a job still holds: its samplers stay asleep and out of service."""
        if spec.samplers:
            await self._publish(spec.samplers, gpb.ENDPOINT_STATE_ASLEEP)
            for s in spec.samplers:
                self.sampler_states[s.address] = JobState.SAVED
