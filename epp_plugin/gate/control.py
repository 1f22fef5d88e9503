"""The gate's control servicer (project service ``llmd_timeslice.v1alpha1.GateControlService``): read-only.

Served on the control port (authenticated), never on the ext_proc data-plane port. It answers status calls (pool
status, pool list, objectives source) from the :class:`~epp_plugin.gate.pool_state.PoolState` objects; it writes
nothing. The pools' endpoint states have one writer, the orchestrator's state stream
(:mod:`epp_plugin.gate.subscription`; docs/decisions/one-writer-of-gate-state.md). This module also holds the
mapping between the wire ``EndpointState`` and the core's, which that stream uses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import grpc

from epp_plugin.gate.objectives_k8s import SourceState, SourceStatus
from epp_plugin.gate.pool_state import EndpointState, PoolState
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as pb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2_grpc as pb_grpc

TO_CORE = {
    pb.ENDPOINT_STATE_SERVING: EndpointState.SERVING,
    pb.ENDPOINT_STATE_DRAINING: EndpointState.DRAINING,
    pb.ENDPOINT_STATE_ASLEEP: EndpointState.ASLEEP,
    pb.ENDPOINT_STATE_WAKING: EndpointState.WAKING,
}
_TO_WIRE = {v: k for k, v in TO_CORE.items()}
_SOURCE_TO_WIRE = {
    SourceState.READING: pb.OBJECTIVES_SOURCE_STATE_READING,
    SourceState.NO_CRD: pb.OBJECTIVES_SOURCE_STATE_NO_CRD,
    SourceState.FORBIDDEN: pb.OBJECTIVES_SOURCE_STATE_FORBIDDEN,
    SourceState.UNREACHABLE: pb.OBJECTIVES_SOURCE_STATE_UNREACHABLE,
}

log = logging.getLogger(__name__)


class GateControl(pb_grpc.GateControlServiceServicer):
    """Read-only control servicer over ``pools``; ``objectives_source()`` is the InferenceObjective source's status
    (None: objectives are not read from Kubernetes)."""

    def __init__(
        self,
        pools: Mapping[str, PoolState],
        objectives_source: Callable[[], SourceStatus | None] = lambda: None,
    ) -> None:
        self._pools = pools
        self._objectives_source = objectives_source

    async def _pool(self, name: str, context: grpc.aio.ServicerContext) -> PoolState:
        pool = self._pools.get(name)
        if pool is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown pool {name!r}; known: {sorted(self._pools)}")
        return pool

    async def GetPoolStatus(self, request, context):  # noqa: N802
        pool = await self._pool(request.pool, context)
        return pool_status(pool)

    async def ListPools(self, request, context):  # noqa: N802
        return pb.ListPoolsResponse(pools=sorted(self._pools))

    async def GetObjectivesSource(self, request, context):  # noqa: N802
        return objectives_source(self._objectives_source())


def objectives_source(status: SourceStatus | None) -> pb.ObjectivesSource:
    """Wire form of the objectives source (None: not read from Kubernetes)."""
    if status is None:
        return pb.ObjectivesSource(state=pb.OBJECTIVES_SOURCE_STATE_NOT_KUBERNETES)
    return pb.ObjectivesSource(
        state=_SOURCE_TO_WIRE[status.state],
        namespace=status.namespace,
        group_version=status.group_version or "",
        served=list(status.served),
        objectives=status.objectives,
        detail=status.detail,
    )


def pool_status(pool: PoolState) -> pb.PoolStatus:
    """Wire snapshot of a pool."""
    return pb.PoolStatus(
        pool=pool.name,
        epoch=pool.epoch,
        endpoints=[
            pb.EndpointStatus(address=e.address, state=_TO_WIRE[e.state], weight_version=e.weight_version, in_flight=e.in_flight)
            for e in pool.endpoints.values()
        ],
        held=pool.held,
        admitted_total=pool.admitted_total,
        released_total=pool.released_total,
        refused_total=pool.refused_total,
        bands=band_status(pool),
    )


def band_status(pool: PoolState) -> list[pb.BandStatus]:
    """The pool's bands that hold requests, declare a hold deadline or have counts, highest first."""
    held = pool.held_by_band()
    oldest = pool.oldest_held_by_band()
    declared = {b.priority: b for b in (pool.priorities.bands.values() if pool.priorities is not None else ())}
    out = []
    for b in sorted({*held, *declared, *pool.band_stats}, reverse=True):
        band = declared.get(b) or pool.band(b)
        st = pool.band_stats.get(b)
        out.append(
            pb.BandStatus(
                band=b,
                held=held.get(b, 0),
                max_hold_s=band.max_hold_s,
                hold_deadline_s=band.hold_deadline_s or 0.0,
                oldest_held_s=oldest.get(b, 0.0),
                released_total=st.released_total if st is not None else 0,
                refused_total=dict(st.refused_total) if st is not None else {},
                deadline_misses_total=st.deadline_misses_total if st is not None else 0,
            )
        )
    return out


def export_pool(pool: PoolState) -> None:
    """Hook after a state change (metrics are read at scrape time; kept for logging): the endpoints the change
    touched at info level, every endpoint at debug level. Listing every endpoint on each update made a release of N
    samplers cost the gate N x N formatted entries (issue 29, ``benchmarks/scale.py``), at every log level: the
    arguments of a log call are built before the level is checked."""
    if not log.isEnabledFor(logging.INFO):
        return
    eps = pool.endpoints
    log.info(
        "pool=%s epoch=%d endpoints=%d changed=%s",
        pool.name,
        pool.epoch,
        len(eps),
        {a: f"{eps[a].state.value}@v{eps[a].weight_version}" for a in pool.last_changed if a in eps},
    )
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "pool=%s epoch=%d all endpoints=%s",
            pool.name,
            pool.epoch,
            {e.address: f"{e.state.value}@v{e.weight_version}" for e in eps.values()},
        )
