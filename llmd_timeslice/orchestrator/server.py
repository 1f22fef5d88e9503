"""Assembly of the orchestrator process: inventory, switch actions, gRPC server, metrics."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmd_timeslice import auth, error_info, tls
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import (
    gate_state_pb2_grpc,
    lease_pb2_grpc,
    orchestrator_info_pb2_grpc,
    weights_pb2_grpc,
)
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as pb_grpc
from llmd_timeslice.domain.group_settings import SchedulingPolicy
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.grpc_server import SERVER_OPTIONS
from llmd_timeslice.orchestrator.actions import START_RPC_TIMEOUT_S, GrpcSwitchActions, ServingLabeler
from llmd_timeslice.orchestrator.clock import Clock
from llmd_timeslice.orchestrator.errors import StateConflict
from llmd_timeslice.orchestrator.gate_hub import GateHub
from llmd_timeslice.orchestrator.groups import Orchestrator, RestoreOutcome
from llmd_timeslice.orchestrator.persistence import StatePersister, StateStore
from llmd_timeslice.orchestrator.placement_watch import METRICS as PLACEMENT_METRICS
from llmd_timeslice.orchestrator.placement_watch import CheckSettings, PlacementWatch
from llmd_timeslice.orchestrator.service import (
    LEADER,
    LEADER_TERM,
    SAMPLERS_OUT_OF_SERVICE,
    LeaseServicer,
    OrchestratorInfo,
    OrchestratorService,
    WeightVersionServicer,
    export_switch,
)
from llmd_timeslice.orchestrator.sidecar_stream import PROBE_AFTER_S
from llmd_timeslice.orchestrator.switch import SwitchActions
from llmd_timeslice.orchestrator.upstream_listener import PeerAllowList, describe
from llmd_timeslice.orchestrator.upstream_listener import interceptors as peer_interceptors

if TYPE_CHECKING:  # election imports the kubernetes client (a slow import at every process start); only the CLI builds one
    from llmd_timeslice.orchestrator.election import LeaderElector

log = logging.getLogger(__name__)

DEFAULT_PORT = 50051  # upstream default
LIVENESS_SERVICE = "llmd_timeslice.v1alpha1.OrchestratorLiveness"
"""gRPC health service that is SERVING while the process serves at all, leader or not (the liveness probe); the
overall health ("") is SERVING only on the leader once its state is restored (the readiness probe)."""
STEPPED_DOWN_EXIT_CODE = 3
"""Exit code of ``llmd-timeslice orchestrator`` after it stepped down (deposed leader): Kubernetes restarts it as a
follower with nothing of the old term left in memory (as client-go controllers exit when they stop leading)."""


def _unavailable_handler(why: str) -> grpc.RpcMethodHandler:
    async def refuse(request_or_iterator, context):
        code = grpc.StatusCode.UNAVAILABLE
        await context.abort(code, why, error_info.trailing_metadata(code.value[0], why, "NOT_LEADER"))

    return grpc.unary_unary_rpc_method_handler(refuse)  # aborting before reading works for every shape


class _LeaderOnly(aio.ServerInterceptor):
    """While this replica does not lead (or has not restored its state yet), every call but the health check is
    refused with UNAVAILABLE naming the leader (clients retry UNAVAILABLE; the Service routes to the leader)."""

    def __init__(self, server: OrchestratorServer) -> None:
        self._server = server

    async def intercept_service(self, continuation, handler_call_details):
        if self._server.serving or handler_call_details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(handler_call_details)
        return _unavailable_handler(self._server.not_leader_message())


class _ConflictWatch:
    """The state store of a leader: no write once it stepped down, and a save that met another writer (a newer
    leader wrote the ConfigMap) tells the server."""

    def __init__(self, store: StateStore, on_conflict, stepped_down: asyncio.Event) -> None:
        self._store, self._on_conflict, self._stepped_down = store, on_conflict, stepped_down

    def load(self) -> dict | None:
        return self._store.load()

    def save(self, state: dict) -> None:
        if self._stepped_down.is_set():
            raise StateConflict("this orchestrator stepped down (deposed leader): it writes no state")
        try:
            self._store.save(state)
        except StateConflict as exc:
            self._on_conflict(str(exc))
            raise


class OrchestratorServer:
    """Orchestrator gRPC server in this event loop.

    Args:
        inventory: groups and their samplers (gates subscribe to this server's GateStateService).
        host, port: bind address (port 0 picks a free one; ``self.port`` tells which).
        token: bearer token required from callers (None: auth off, warned).
        actions: switch actions (default: over gRPC to the inventory's gates and sidecars).
        reconcile_on_start: wake/verify samplers and publish them SERVING at start-up (groups a job
            still holds according to ``state_store`` keep their samplers asleep, published ASLEEP).
        state_store: where holders, leases and states survive a restart (None: nowhere).
        job_tokens: job id -> that job's own token (see :class:`~llmd_timeslice.auth.JobAuthorizer`).
        require_job_tokens: jobs listed in ``job_tokens`` must use their own token.
        tls_files: mutual TLS for this server and its calls to sidecars (None: plain TCP).
        engine_audit_interval_s: every that many seconds, read the engines of idle groups through their
            sidecars and wake again any that restarted on their own or sleep while serving (0: off).
        labeler: serving-label hook of the default actions (Kubernetes label fallback; None: gates only).
        clock: time for leases, repair and audit (default: the event loop's).
        placement: the placement plan to check against the measured profiles, and how often (None: profiles are
            recorded and served, no plan is checked; docs/placement.md).
        sidecar_call_timeout_s, sidecar_probe_after_s: seconds; the default actions' deadline of a call starting a
            sleep or wake (and of a reachability probe), and when a command without an answer is probed
            (``GrpcSwitchActions``'s ``start_rpc_timeout_s`` and ``probe_after_s``).
        election: leader election of the replicas (None: this replica always serves, commands carry no term).
            With it, ``start()`` serves the health check (NOT_SERVING) and refuses every other call with
            UNAVAILABLE until this replica leads, then restores the state from ``state_store`` and serves;
            every command to sidecars and gates carries its term (fencing). On losing the Lease or a fenced
            refusal it steps down: ``stepped_down`` is set and it serves nothing any more.
    """

    def __init__(
        self,
        inventory: Inventory,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        token: str | None = None,
        actions: SwitchActions | None = None,
        reconcile_on_start: bool = True,
        state_store: StateStore | None = None,
        job_tokens: dict[str, str] | None = None,
        require_job_tokens: bool = False,
        tls_files: tls.TlsFiles | None = None,
        engine_audit_interval_s: float = 10.0,
        labeler: ServingLabeler | None = None,
        clock: Clock | None = None,
        election: LeaderElector | None = None,
        upstream_compat_port: int | None = None,
        upstream_compat_allowed_peers: tuple[str, ...] = (),
        placement: CheckSettings | None = None,
        sidecar_call_timeout_s: float = START_RPC_TIMEOUT_S,
        sidecar_probe_after_s: float = PROBE_AFTER_S,
    ) -> None:
        self.inventory = inventory
        self.upstream_compat_port = upstream_compat_port
        self.upstream_compat_peers = PeerAllowList(upstream_compat_allowed_peers)
        self._upstream: aio.Server | None = None
        self.engine_audit_interval_s = engine_audit_interval_s
        self.jobs = auth.JobAuthorizer(job_tokens, require_job_tokens)
        self.tls = tls_files
        self.host = host
        self.port = port
        self.token = token
        self.hub = GateHub()
        self.actions = actions or GrpcSwitchActions(
            self.hub,
            token,
            labeler=labeler,
            tls_files=tls_files,
            start_rpc_timeout_s=sidecar_call_timeout_s,
            probe_after_s=sidecar_probe_after_s,
        )
        self.orchestrator = Orchestrator(inventory.group_specs(), self.actions, on_switch=export_switch, clock=clock)
        self.hub.on_endpoint_failure = self.orchestrator.audit_endpoint
        self.hub.on_hold_pressure = self.orchestrator.hold_pressure
        self.orchestrator.on_weights_final = self.hub.set_weights_final
        self.placement = PlacementWatch(placement, apply_settings=self._apply_replan)
        self.orchestrator.lease_events = self.placement
        self._reconcile = reconcile_on_start
        self.state_store = state_store
        self._server: aio.Server | None = None
        self.ready = asyncio.Event()
        self.election = election
        self.term = 0
        """This leader's term (0: no election)."""
        self.serving = election is None
        self.stepped_down = asyncio.Event()
        self.step_down_reason = ""
        self._health: health.aio.HealthServicer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def not_leader_message(self) -> str:
        e = self.election
        if e is None:
            return "orchestrator is not serving"
        if self.stepped_down.is_set():
            return f"orchestrator {e.identity} stepped down ({self.step_down_reason}); retry: the Service routes to the leader"
        leader = e.leader
        if leader == e.identity:
            return f"orchestrator {e.identity} is taking over (restoring its state); retry"
        return (
            f"orchestrator {e.identity} is not the leader; the leader is {leader or '(not known yet)'} "
            f"(Lease {e.lock.namespace}/{e.lock.name}); retry: the Service routes to the leader"
        )

    async def start(self) -> None:
        interceptors = auth.server_interceptors(self.token, extra_tokens=tuple(self.jobs.job_tokens.values()))
        if self.election is not None:
            interceptors = [*interceptors, _LeaderOnly(self)]
        self._server = aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        servicer = OrchestratorService(self.orchestrator, self.jobs)
        pb_grpc.add_TimeSliceOrchestratorServiceServicer_to_server(servicer, self._server)
        gate_state_pb2_grpc.add_GateStateServiceServicer_to_server(self.hub, self._server)
        lease_pb2_grpc.add_LeaseServiceServicer_to_server(LeaseServicer(self.orchestrator, self.jobs), self._server)
        weights_pb2_grpc.add_WeightVersionServiceServicer_to_server(
            WeightVersionServicer(self.orchestrator, self.jobs), self._server
        )
        orchestrator_info_pb2_grpc.add_OrchestratorInfoServiceServicer_to_server(
            OrchestratorInfo(self.orchestrator), self._server
        )
        hs = self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, self._server)
        self.port = tls.add_port(self._server, f"{self.host}:{self.port}", self.tls)
        if self.upstream_compat_port is not None:
            self._start_upstream_listener(servicer, hs)
        await self._server.start()
        if self._upstream is not None:
            await self._upstream.start()
        SAMPLERS_OUT_OF_SERVICE.orchestrators.append(self.orchestrator)
        await hs.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        saved = None
        if self.election is not None:
            await hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await self._take_over()
            if self.state_store is not None:
                saved = await asyncio.to_thread(self.state_store.load)
            self._set_term(max(self.election.lock.term, int((saved or {}).get("term") or 0) + 1))
        elif self.state_store is not None:
            saved = await asyncio.to_thread(self.state_store.load)
        try:
            await self._restore_and_start(saved)
        except Exception:
            if not self.stepped_down.is_set():
                raise
            log.warning("take-over not finished: stepped down meanwhile (%s)", self.step_down_reason)
        if self.stepped_down.is_set():
            return
        self.serving = True
        await hs.set("", health_pb2.HealthCheckResponse.SERVING)
        LEADER.set(1)
        LEADER_TERM.set(self.term)
        self.ready.set()
        log.info(
            "orchestrator %s:%d groups=%s%s",
            self.host,
            self.port,
            sorted(self.orchestrator.groups),
            f" leader term={self.term}" if self.election is not None else "",
        )

    def _start_upstream_listener(self, servicer: OrchestratorService, hs: health.aio.HealthServicer) -> None:
        """Bind the upstream-compatible port: the same servicer and health, peer check, leader-only; no token."""
        interceptors = peer_interceptors(self.upstream_compat_peers)
        if self.election is not None:
            interceptors = [*interceptors, _LeaderOnly(self)]
        self._upstream = aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        pb_grpc.add_TimeSliceOrchestratorServiceServicer_to_server(servicer, self._upstream)
        health_pb2_grpc.add_HealthServicer_to_server(hs, self._upstream)
        address = f"{self.host}:{self.upstream_compat_port}"
        self.upstream_compat_port = self._upstream.add_insecure_port(address)
        if not self.upstream_compat_port:
            raise OSError(f"upstream_compat_port: cannot bind {address}")
        extra = ["authentication is off on the main port too"] if not self.token else []
        log.warning("%s", describe(self.host, self.upstream_compat_port, self.upstream_compat_peers, extra))

    async def _restore_and_start(self, saved: dict | None) -> None:
        """Restore ``saved`` (the state store's), persist every change from here on, start the groups (reconcile)."""
        if self.state_store is not None:
            if saved:
                todo = self.orchestrator.restore(saved)
                self.placement.restore(saved.get("profiles"))
                self.hub.assume_recent(saved.get("gates") or {})
                log.info(
                    "restored state: %s; gates known before the restart: %s",
                    {gid: o.value for gid, o in todo.items()},
                    sorted(saved.get("gates") or {}),
                )
                held = [gid for gid, o in todo.items() if o is RestoreOutcome.HELD]
                if held:
                    log.info("groups still held after the restart (samplers stay asleep): %s", held)
            persister = StatePersister(self.state_store, self._snapshot)
            self.orchestrator.persister = persister
            self.hub.on_gates_change = persister.request
            await persister.save()
        # Held groups publish their samplers ASLEEP; free groups' samplers are woken and verified (reconcile).
        await self.orchestrator.start(reconcile=self._reconcile)
        self.orchestrator.start_repair(audit_interval_s=self.engine_audit_interval_s)
        self._loop = asyncio.get_running_loop()
        PLACEMENT_METRICS.watches.append(self.placement)
        self._spawn(self.placement.run())

    async def _take_over(self) -> None:
        """Campaign; return once this replica leads (its fencing hooks armed, the Lease watched)."""
        e = self.election
        assert e is not None
        loop = asyncio.get_running_loop()
        if self.state_store is not None:
            self.state_store = _ConflictWatch(
                self.state_store,
                lambda why: loop.call_soon_threadsafe(self.step_down, f"the state ConfigMap was written by another: {why}"),
                self.stepped_down,
            )
        e.start()
        log.info("orchestrator %s: candidate for Lease %s/%s", e.identity, e.lock.namespace, e.lock.name)
        await e.wait_leading()
        self.hub.on_fenced = self._fenced
        if isinstance(self.actions, GrpcSwitchActions):
            self.actions.on_fenced = self._fenced

        async def watch_lease() -> None:
            await e.lost.wait()
            self.step_down(e.lost_reason)

        self._spawn(watch_lease())

    def _set_term(self, term: int) -> None:
        self.term = self.hub.term = term
        if isinstance(self.actions, GrpcSwitchActions):
            self.actions.term = term
        log.info("orchestrator %s leads with term %d", self.election.identity if self.election else "", term)

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _fenced(self, peer: str, refused_term: int, highest_term: int) -> None:
        self.step_down(f"{peer} refused a command of term {refused_term}: it has seen term {highest_term}")

    def step_down(self, reason: str) -> None:
        """Stop leading at once: refuse every call (UNAVAILABLE), health NOT_SERVING, stop the groups (no further
        command to sidecars or gates) and end the gate streams; ``stepped_down`` is set. Idempotent."""
        if self.stepped_down.is_set() or self.election is None:
            return
        self.serving = False
        LEADER.set(0)
        self.step_down_reason = reason
        self.stepped_down.set()
        log.error("orchestrator %s (term %d) steps down: %s", self.election.identity, self.term, reason)

        async def quiesce() -> None:
            if self._health is not None:
                await self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            self.hub.close_all()
            await self.orchestrator.close()

        self._spawn(quiesce())

    def _apply_replan(self, group_id: str, policy: str, job_priorities: dict[str, int]) -> bool:
        """A re-plan's policy and job priorities for a group whose ``replan_apply`` setting is on (called from the
        placement check's worker thread); False: not allowed, or the group is unknown."""
        g = self.orchestrator.groups.get(group_id)
        if g is None or not g.spec.replan_apply or self._loop is None:
            return False
        spec = g.spec.copy()
        spec.policy, spec.job_priorities = SchedulingPolicy(policy), dict(job_priorities)
        asyncio.run_coroutine_threadsafe(self.orchestrator.update_spec(spec), self._loop)
        return True

    def _snapshot(self) -> dict:
        state = {**self.orchestrator.snapshot(), "gates": self.hub.known_gates(), "profiles": self.placement.snapshot()}
        if self.term:
            state["term"] = self.term
        return state

    async def stop(self) -> None:
        if self.serving:
            LEADER.set(0)
        if self.placement in PLACEMENT_METRICS.watches:
            PLACEMENT_METRICS.watches.remove(self.placement)
        if self.orchestrator in SAMPLERS_OUT_OF_SERVICE.orchestrators:
            SAMPLERS_OUT_OF_SERVICE.orchestrators.remove(self.orchestrator)
        await self.orchestrator.close()
        if self.orchestrator.persister is not None and not self.stepped_down.is_set():
            # A deposed leader does not wait for its write in flight: that write is refused or moot (a newer
            # leader owns the state), and on a node cut off from the API server it hangs its request timeout.
            await self.orchestrator.persister.close()
        self.hub.close_all()
        await asyncio.sleep(0)
        if self._server is not None:
            await self._server.stop(1.0)
        if self._upstream is not None:
            await self._upstream.stop(1.0)
        await self.actions.close()
        if self.election is not None:
            # A clean stop (rolling update) hands the Lease back, so the other replica takes over at its next retry.
            await self.election.stop(release=not self.stepped_down.is_set())
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
