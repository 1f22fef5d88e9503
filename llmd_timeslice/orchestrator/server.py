"""Assembly of the orchestrator process: inventory, switch actions, gRPC server, metrics."""

from __future__ import annotations

import asyncio
import logging

from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmd_timeslice import auth, tls
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import (
    gate_state_pb2_grpc,
    lease_pb2_grpc,
    orchestrator_info_pb2_grpc,
    weights_pb2_grpc,
)
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as pb_grpc
from llmd_timeslice.discovery.static import Inventory
from llmd_timeslice.grpc_server import SERVER_OPTIONS
from llmd_timeslice.orchestrator.actions import GrpcSwitchActions, ServingLabeler
from llmd_timeslice.orchestrator.clock import Clock
from llmd_timeslice.orchestrator.gate_hub import GateHub
from llmd_timeslice.orchestrator.groups import Orchestrator, RestoreOutcome
from llmd_timeslice.orchestrator.persistence import StatePersister, StateStore
from llmd_timeslice.orchestrator.service import (
    LeaseServicer,
    OrchestratorInfo,
    OrchestratorService,
    WeightVersionServicer,
    export_switch,
)
from llmd_timeslice.orchestrator.switch import SwitchActions

log = logging.getLogger(__name__)

DEFAULT_PORT = 50051  # upstream default


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
    ) -> None:
        self.inventory = inventory
        self.engine_audit_interval_s = engine_audit_interval_s
        self.jobs = auth.JobAuthorizer(job_tokens, require_job_tokens)
        self.tls = tls_files
        self.host = host
        self.port = port
        self.token = token
        self.hub = GateHub()
        self.actions = actions or GrpcSwitchActions(self.hub, token, labeler=labeler, tls_files=tls_files)
        self.orchestrator = Orchestrator(inventory.group_specs(), self.actions, on_switch=export_switch, clock=clock)
        self.hub.on_endpoint_failure = self.orchestrator.audit_endpoint
        self._reconcile = reconcile_on_start
        self.state_store = state_store
        self._server: aio.Server | None = None
        self.ready = asyncio.Event()

    async def start(self) -> None:
        self._server = aio.server(
            options=SERVER_OPTIONS,
            interceptors=auth.server_interceptors(self.token, extra_tokens=tuple(self.jobs.job_tokens.values())),
        )
        pb_grpc.add_TimeSliceOrchestratorServiceServicer_to_server(
            OrchestratorService(self.orchestrator, self.jobs), self._server
        )
        gate_state_pb2_grpc.add_GateStateServiceServicer_to_server(self.hub, self._server)
        lease_pb2_grpc.add_LeaseServiceServicer_to_server(LeaseServicer(self.orchestrator, self.jobs), self._server)
        weights_pb2_grpc.add_WeightVersionServiceServicer_to_server(
            WeightVersionServicer(self.orchestrator, self.jobs), self._server
        )
        orchestrator_info_pb2_grpc.add_OrchestratorInfoServiceServicer_to_server(
            OrchestratorInfo(self.orchestrator), self._server
        )
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, self._server)
        self.port = tls.add_port(self._server, f"{self.host}:{self.port}", self.tls)
        await self._server.start()
        if self.state_store is not None:
            saved = await asyncio.to_thread(self.state_store.load)
            if saved:
                todo = self.orchestrator.restore(saved)
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
        await hs.set("", health_pb2.HealthCheckResponse.SERVING)
        self.ready.set()
        log.info("orchestrator %s:%d groups=%s", self.host, self.port, sorted(self.orchestrator.groups))

    def _snapshot(self) -> dict:
        return {**self.orchestrator.snapshot(), "gates": self.hub.known_gates()}

    async def stop(self) -> None:
        await self.orchestrator.close()
        if self.orchestrator.persister is not None:
            await self.orchestrator.persister.close()
        self.hub.close_all()
        await asyncio.sleep(0)
        if self._server is not None:
            await self._server.stop(1.0)
        await self.actions.close()
