"""The gate's subscription to the orchestrator's endpoint state (``GateStateService.Connect``).

Applies snapshots and updates to the pools, acks each epoch once applied, answers drain queries
from the pool's drain barrier. On a broken stream it keeps the last known state, reconnects with
exponential back-off (0.2 s doubling to 5 s) and resyncs from the full snapshot the orchestrator
sends first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, MutableMapping

import grpc
from grpc import aio
from prometheus_client import Counter, Gauge

from epp_plugin.gate import metrics
from epp_plugin.gate.control import TO_CORE, export_pool
from epp_plugin.gate.pool_state import PoolState
from llmd_timeslice import auth
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2 as pb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SUBSCRIBED = Gauge("llmd_timeslice_gate_subscribed", "1 while the gate's state stream to the orchestrator is up.")
RESYNCS = Counter("llmd_timeslice_gate_resyncs_total", "Full snapshots applied (first connect and every reconnect).")


class StateSubscription:
    """Keeps ``pools`` in line with the orchestrator at ``target``.

    Args:
        target: orchestrator ``host:port``.
        gate_id: this replica's stable id (e.g. the pod name).
        pools: pool name -> state, shared with the ext_proc servicer.
        pool_factory: creates a pool the orchestrator names that this gate does not have yet.
        token: bearer token for the orchestrator.
        on_synced: called after the first full snapshot is applied (readiness).
    """

    def __init__(self, target: str, gate_id: str, pools: MutableMapping[str, PoolState],
                 pool_factory: Callable[[str], PoolState], token: str | None = None,
                 on_synced: Callable[[], None] | None = None) -> None:
        self.target, self.gate_id, self.pools = target, gate_id, pools
        self._factory = pool_factory
        self._token = token
        self._on_synced = on_synced
        self.connected = asyncio.Event()
        self.synced_epoch = -1
        self.resyncs = 0
        self._outbox: asyncio.Queue | None = None
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        """Connect, apply, reconnect on failure; runs until cancelled."""
        backoff = 0.2
        while True:
            try:
                await self._session()
                backoff = 0.2
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    log.error("orchestrator %s refused the gate: %s (check the token)", self.target, exc.details())
                else:
                    log.warning("state stream to %s lost: %s %s; keeping the last known state, retrying in %.1f s",
                                self.target, exc.code().name, exc.details(), backoff)
            except Exception:
                log.exception("state stream to %s failed; retrying in %.1f s", self.target, backoff)
            self.connected.clear()
            SUBSCRIBED.set(0)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _outgoing(self, outbox: asyncio.Queue):
        yield pb.GateMessage(hello=pb.GateHello(gate_id=self.gate_id, pools=sorted(self.pools)))
        while True:
            msg = await outbox.get()
            if msg is None:
                return
            yield msg

    async def _session(self) -> None:
        outbox: asyncio.Queue = asyncio.Queue()
        self._outbox = outbox
        # Metadata passed on the call: grpc.aio's stream-stream client interceptors do not add it (seen with 1.85).
        async with aio.insecure_channel(self.target) as ch:
            call = pb_grpc.GateStateServiceStub(ch).Connect(self._outgoing(outbox),
                                                            metadata=auth.call_metadata(self._token))
            try:
                async for cmd in call:
                    which = cmd.WhichOneof("command")
                    if which == "state":
                        self._apply(cmd.state)
                        outbox.put_nowait(pb.GateMessage(ack=pb.EpochAck(epoch=cmd.state.epoch)))
                    elif which == "drain":
                        t = asyncio.get_running_loop().create_task(self._drain(cmd.drain, outbox))
                        self._tasks.add(t)
                        t.add_done_callback(self._tasks.discard)
            finally:
                outbox.put_nowait(None)
                for t in list(self._tasks):
                    t.cancel()

    def _apply(self, update: pb.StateUpdate) -> None:
        named = set()
        for pe in update.pools:
            named.add(pe.pool)
            pool = self.pools.get(pe.pool)
            if pool is None:
                pool = self.pools[pe.pool] = self._factory(pe.pool)
            items = [(e.address, TO_CORE[e.state], e.weight_version) for e in pe.endpoints if e.state in TO_CORE]
            if update.full_snapshot:
                pool.replace_states(items)
            else:
                pool.set_states(items)
            export_pool(pool)
        if update.full_snapshot:
            for name, pool in self.pools.items():
                if name not in named and pool.endpoints:
                    pool.replace_states([])  # the orchestrator no longer lists this pool's endpoints
                    export_pool(pool)
            self.resyncs += 1
            RESYNCS.inc()
            if not self.connected.is_set():
                log.info("gate %s synced with %s at epoch %d", self.gate_id, self.target, update.epoch)
            self.connected.set()
            SUBSCRIBED.set(1)
            if self._on_synced is not None:
                self._on_synced()
        self.synced_epoch = update.epoch
        metrics.ORCHESTRATOR_EPOCH.set(update.epoch)

    async def _drain(self, q: pb.DrainQuery, outbox: asyncio.Queue) -> None:
        pool = self.pools.get(q.pool)
        if pool is None:
            drained, in_flight = True, {}
        else:
            drained, in_flight = await pool.wait_drained(list(q.addresses), max(0.0, q.timeout_s))
        outbox.put_nowait(pb.GateMessage(drain_result=pb.DrainResult(query_id=q.query_id, drained=drained,
                                                                     in_flight=in_flight)))
