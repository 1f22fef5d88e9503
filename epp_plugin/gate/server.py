"""Assembly of the gate process: the two data-plane edges, the control server, metrics.

Data plane (invariant 8: nothing else there): the gRPC port serves ``envoy.service.ext_proc.v3.ExternalProcessor``
(the ext_proc edge), ``envoy.service.accesslog.v3.AccessLogService`` (completions of the fast path),
``envoy.service.endpoint.v3.EndpointDiscoveryService`` (Envoy's model-server hosts when the gate picks) and gRPC
health; the HTTP port (``authz_port``) answers Envoy's ext_authz checks (admissions of the fast path). Both
edges share the pools. The control port serves ``GateControlService`` behind bearer-token auth.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

import grpc
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pydantic import Field, model_validator

from epp_plugin.gate import ext_authz, metrics
from epp_plugin.gate.access_log import GateAccessLogService
from epp_plugin.gate.admissions import AdmissionBook
from epp_plugin.gate.control import GateControl
from epp_plugin.gate.endpoint_discovery import EndpointDirectory
from epp_plugin.gate.ext_proc import GateExternalProcessor
from epp_plugin.gate.objectives_k8s import ObjectiveWatch, SourceState, SourceStatus
from epp_plugin.gate.pool_state import PoolState
from epp_plugin.gate.subscription import StateSubscription
from llmd_timeslice import auth, tls
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2_grpc
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2 as state_pb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2_grpc as state_grpc
from llmd_timeslice.config import GateSettings, Port
from llmd_timeslice.domain.objectives import ObjectiveEntry, Objectives, PoolPriorities, load_objectives_file
from llmd_timeslice.grpc_server import SERVER_OPTIONS
from llmd_timeslice.protocol import GATE_READINESS_SERVICE

log = logging.getLogger(__name__)

READINESS_SERVICE = GATE_READINESS_SERVICE
"""gRPC health service name that turns SERVING once the first state snapshot is applied."""


class GateConfig(GateSettings):
    """A gate process's settings (:class:`~llmd_timeslice.config.GateSettings`; durations in seconds) and what it
    holds at run time: the control-plane token itself. One difference as a library: ``authz_port`` defaults to
    None (no ext_authz edge); 0 picks a free port."""

    authz_port: Port | None = Field(
        None, description="HTTP data-plane port for Envoy's ext_authz checks (the fast path; 0: a free port; None: not served)."
    )
    token: str | None = Field(
        None, repr=False, exclude=True, description="Bearer token for the control port and the orchestrator."
    )
    priorities: Objectives | None = Field(
        None,
        exclude=True,
        description="Objectives and priority bands (the `objectives` file, read; None: the objective header is "
        "ignored unless `objectives_from_kubernetes`).",
    )

    @model_validator(mode="after")
    def _priorities_fit(self) -> GateConfig:
        if self.priorities is not None:
            problems = self.priorities.check(self.max_hold_s, self.default_pool)
            if problems:
                raise ValueError("; ".join(problems))
        return self

    @classmethod
    def from_settings(cls, settings: GateSettings, token: str | None) -> GateConfig:
        """The configuration of a gate run from ``settings`` (as validated by ``llmd-timeslice gate``); reads the
        ``objectives`` file.

        Raises:
            ObjectivesError: the objectives file is unusable (one line per problem).
            FileNotFoundError: no such objectives file.
        """
        priorities = None
        if settings.objectives is not None:
            priorities = load_objectives_file(settings.objectives, settings.max_hold_s, settings.default_pool)
        return cls.model_validate({**settings.model_dump(), "token": token, "priorities": priorities})

    def pool_priorities(self, pool: str, from_kubernetes: list[ObjectiveEntry] | None = None) -> PoolPriorities | None:
        """What pool ``pool`` knows of objectives and bands (None: objectives off); ``from_kubernetes``: the
        InferenceObjective objects read, in place of the file's objectives (its bands stay). With
        ``objectives_from_kubernetes`` and none read (no CRD served, RBAC refused, API server unreachable, not
        read yet): None, bands off (docs/gate.md, "Priority bands")."""
        if self.objectives_from_kubernetes:
            if from_kubernetes is None:
                return None
            return (self.priorities or Objectives()).merged(from_kubernetes).for_pool(pool, self.default_pool, self.max_hold_s)
        if self.priorities is None:
            return None
        return self.priorities.for_pool(pool, self.default_pool, self.max_hold_s)


class GateServer:
    """The gate's servers in this event loop. ``await start()``, ``await stop()``."""

    def __init__(self, config: GateConfig, tls_files: tls.TlsFiles | None = None) -> None:
        self.config = config
        self.tls = tls_files  # mutual TLS of the control port and of the subscription (not the data plane)
        self.pools: dict[str, PoolState] = {}
        for name in {*config.pools, config.default_pool}:
            self.pools[name] = self._new_pool(name)
        self._data: aio.Server | None = None
        self._ext_proc: GateExternalProcessor | None = None
        self.book = AdmissionBook(
            config.lost_completion_after_s, on_lost=lambda reason, n: metrics.LOST_COMPLETIONS.labels(reason=reason).inc(n)
        )
        self.authz: ext_authz.AuthzService | None = None
        self._authz_server: asyncio.Server | None = None
        self.authz_port = config.authz_port
        self.subscription: StateSubscription | None = None
        self._sub_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # readiness updates in flight, kept: the loop holds tasks only weakly
        self._health: health.aio.HealthServicer | None = None
        self._control: aio.Server | None = None
        self.ext_proc_port = config.ext_proc_port
        self.control_port = config.control_port
        self.gate_id = config.gate_id or f"{socket.gethostname()}-{os.getpid()}"
        self.directory = EndpointDirectory(self.pools)
        for pool in self.pools.values():
            pool.on_change = self.directory.refresh
        self._report_channel: aio.Channel | None = None
        self.k8s_objectives: list[ObjectiveEntry] | None = None
        """The InferenceObjectives read from Kubernetes (``objectives_from_kubernetes``; None: not read)."""
        self.objective_watch: ObjectiveWatch | None = None
        self._objectives_api = None
        self._objectives_status: SourceStatus | None = None  # set when no watch could be made (no configuration)

    def objectives_source(self) -> SourceStatus | None:
        """Where the InferenceObjectives come from now (None: not read from Kubernetes)."""
        if self.objective_watch is not None:
            return self.objective_watch.status
        return self._objectives_status

    def _objectives_changed(self, entries: list[ObjectiveEntry] | None) -> None:
        """The InferenceObjective objects changed (None: none read, bands off): every pool gets its objectives anew
        (held requests keep their band and longest hold)."""
        self.k8s_objectives = entries
        for name, pool in self.pools.items():
            pool.set_priorities(self.config.pool_priorities(name, entries))
        if entries is not None:
            log.info("objectives now %s", {e.name: (e.pool, e.priority) for e in entries})

    async def _start_objective_watch(self) -> None:
        """Discover and read the InferenceObjectives (:class:`ObjectiveWatch`). Never raises for the cluster's state:
        without the CRD, the RBAC or the API server the gate serves with bands off. No Kubernetes configuration
        at all (not in a pod with a ServiceAccount token, no kubeconfig): bands off, one warning.

        Raises:
            KubernetesError: ``kubeconfig`` names a file that cannot be loaded (bad input: the gate does not start).
        """
        from llmd_timeslice.discovery.kubernetes import KubernetesError, default_namespace, make_api_client

        cfg = self.config
        namespace = cfg.objectives_namespace or default_namespace()
        try:
            self._objectives_api = make_api_client(cfg.kubeconfig)
        except KubernetesError as exc:
            if cfg.kubeconfig is not None:
                raise
            self._objectives_status = SourceStatus(SourceState.UNREACHABLE, namespace, detail=str(exc))
            metrics.set_objectives_source(namespace, SourceState.UNREACHABLE.value, None)
            log.warning("InferenceObjectives: %s; priority bands off (the objective header is ignored)", exc)
            return
        self.objective_watch = ObjectiveWatch(
            namespace, self._objectives_api, self._objectives_changed, recheck_s=cfg.objectives_recheck_s
        )
        self._objectives_changed(await self.objective_watch.start())

    def _new_pool(self, name: str) -> PoolState:
        pool = PoolState(
            name,
            max_held=self.config.max_held,
            max_hold_s=self.config.max_hold_s,
            release_rate_per_s=self.config.release_rate_per_s,
            priorities=self.config.pool_priorities(name, getattr(self, "k8s_objectives", None)),
        )
        subscription = getattr(self, "subscription", None)
        if subscription is not None:
            subscription.watch_pool(pool)
        directory = getattr(self, "directory", None)  # pools made in __init__ are wired once it exists
        if directory is not None:
            pool.on_change = directory.refresh
        return pool

    async def start(self) -> None:
        """Start every server (after the first discovery and list of the InferenceObjectives, with
        ``objectives_from_kubernetes``: a missing CRD, RBAC or API server turns the bands off, see
        :class:`ObjectiveWatch`).

        Raises:
            KubernetesError: the ``kubeconfig`` named cannot be loaded.
        """
        cfg = self.config
        if cfg.objectives_from_kubernetes:
            await self._start_objective_watch()
        self._data = aio.server(options=SERVER_OPTIONS)
        self._ext_proc = GateExternalProcessor(self.pools, cfg.default_pool)
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(self._ext_proc, self._data)
        self.access_log = GateAccessLogService(self.book, on_failed=self._endpoint_failed)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self.access_log, self._data)
        eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(self.directory, self._data)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._data)
        self.ext_proc_port = self._data.add_insecure_port(f"{cfg.host}:{cfg.ext_proc_port}")

        self._control = aio.server(options=SERVER_OPTIONS, interceptors=auth.server_interceptors(cfg.token))
        gate_control_pb2_grpc.add_GateControlServiceServicer_to_server(
            GateControl(self.pools, self.objectives_source), self._control
        )
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._control)
        self.control_port = tls.add_port(self._control, f"{cfg.host}:{cfg.control_port}", self.tls)
        await self._data.start()
        await self._control.start()
        if cfg.authz_port is not None:
            self.authz = ext_authz.AuthzService(self.pools, self.book, self.directory)
            self._authz_server = await ext_authz.serve(self.authz, cfg.host, cfg.authz_port)
            self.authz_port = self._authz_server.sockets[0].getsockname()[1]
            metrics.COLLECTOR.books.append(self.book)
            metrics.COLLECTOR.access_logs.append(self.access_log)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        self._health = health_servicer
        metrics.COLLECTOR.pool_maps.append(self.pools)
        if cfg.orchestrator:
            await health_servicer.set(READINESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
            self.subscription = StateSubscription(
                cfg.orchestrator,
                self.gate_id,
                self.pools,
                self._new_pool if cfg.accept_new_pools else None,
                cfg.token,
                on_synced=self._synced,
                stale_after_s=cfg.stale_after_s,
                tls_files=self.tls,
            )
            self._sub_task = asyncio.get_running_loop().create_task(self.subscription.run())
        else:
            await health_servicer.set(READINESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "gate ext_proc=%s:%d ext_authz=%s control=%s:%d pools=%s",
            cfg.host,
            self.ext_proc_port,
            f"{cfg.host}:{self.authz_port}" if self.authz_port is not None else "off",
            cfg.host,
            self.control_port,
            sorted(self.pools),
        )

    def _endpoint_failed(self, pool: PoolState, address: str, reason: str) -> None:
        """Envoy could not connect to ``address`` (access log, flag UF): out of this gate's picks and subset hints at
        once (:meth:`PoolState.mark_failed`), and, on its first failure, the orchestrator audits its engine."""
        if not pool.mark_failed(address, self.config.failed_endpoint_hold_s):
            return
        metrics.ENDPOINT_FAILURES.labels(pool=pool.name, endpoint=address).inc()
        log.warning(
            "pool=%s endpoint %s: %s; not steered to until the orchestrator publishes its state again (or %.1f s)",
            pool.name,
            address,
            reason,
            self.config.failed_endpoint_hold_s,
        )
        if self.config.orchestrator:
            task = asyncio.get_running_loop().create_task(self._report_failure(pool.name, address, reason))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _report_failure(self, pool: str, address: str, reason: str) -> None:
        """``GateStateService.ReportEndpointFailure``: the orchestrator audits that engine now (best effort: its
        periodic audit finds a dead engine anyway)."""
        target = self.config.orchestrator
        if target is None:
            return
        if self._report_channel is None:
            self._report_channel = tls.aio_channel(target, self.tls)
        stub = state_grpc.GateStateServiceStub(self._report_channel)
        msg = state_pb.EndpointFailure(gate_id=self.gate_id, pool=pool, address=address, reason=reason)
        try:
            ack = await stub.ReportEndpointFailure(msg, timeout=5.0, metadata=auth.call_metadata(self.config.token))
            log.info("orchestrator told of %s's failed connection (audit started: %s)", address, ack.audited)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "could not tell the orchestrator of %s's failed connection: %s %s", address, exc.code().name, exc.details()
            )

    def _synced(self) -> None:
        if self._health is not None:
            task = asyncio.get_running_loop().create_task(
                self._health.set(READINESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def stop(self, grace_s: float = 2.0) -> None:
        """Refuse held requests (503 gate_shutting_down), then stop both servers.

        ``grace_s`` (seconds) bounds the wait for the ext_proc streams of requests already on an engine (their
        response phase); Envoy's long-lived streams (EDS, access logs, health) do not count, so an idle gate stops at
        once instead of waiting out the grace."""
        if self._sub_task is not None:
            self._sub_task.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self.pools in metrics.COLLECTOR.pool_maps:
            metrics.COLLECTOR.pool_maps.remove(self.pools)
        if self.book in metrics.COLLECTOR.books:
            metrics.COLLECTOR.books.remove(self.book)
            metrics.COLLECTOR.access_logs.remove(self.access_log)
        for pool in self.pools.values():
            pool.close()
        await asyncio.sleep(0)
        if self._authz_server is not None and self.authz is not None:
            self._authz_server.close()  # held checks were answered (gate_shutting_down) just above
            await asyncio.sleep(0)
            for conn in list(self.authz.open):
                conn.close()
        self.book.close()
        if self.objective_watch is not None:
            await self.objective_watch.stop()
        elif self._objectives_status is not None:
            metrics.set_objectives_source(self._objectives_status.namespace, None, None)
        if self._objectives_api is not None:
            self._objectives_api.close()
        if self._report_channel is not None:
            await self._report_channel.close()
        if self._data is not None:
            if self._ext_proc is not None and not await self._ext_proc.wait_streams_done(grace_s):
                log.info("gate stopping with %d ext_proc streams still open after %g s", self._ext_proc.open_streams, grace_s)
            await self._data.stop(0)
        if self._control is not None:
            await self._control.stop(0)


async def serve(config: GateConfig, tls_files: tls.TlsFiles | None = None) -> None:
    """Run the gate until cancelled (SIGINT/SIGTERM handled by the caller)."""
    server = GateServer(config, tls_files)
    await server.start()
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()
