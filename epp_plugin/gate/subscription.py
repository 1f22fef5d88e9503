"""The gate's subscription to the orchestrator's endpoint state (``GateStateService.Connect``).

Applies snapshots and updates to the pools, acks each epoch once applied, answers drain queries
from the pool's drain barrier and the orchestrator's keepalive (every second on an idle stream). When
nothing has come from the orchestrator for ``stale_after_s`` seconds (broken stream, partition, stuck
peer) it marks every pool **stale**: new requests are held, not steered by a view that may be out of
date, because the orchestrator may meanwhile have put those engines to sleep (it waits that long for
a gate it lost before it does). Until then the last known state serves, so an orchestrator restart
passes unnoticed. It reconnects with exponential back-off (0.2 s doubling to 5 s, tenacity; a session that
synced starts the next from 0.2 s again) and resyncs from the full snapshot the orchestrator sends first,
which ends the stale state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, MutableMapping

import grpc
from prometheus_client import Counter, Gauge
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from epp_plugin.gate import metrics
from epp_plugin.gate.control import TO_CORE, export_pool
from epp_plugin.gate.pool_state import PoolState
from llmd_timeslice import auth, tls
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2 as pb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SUBSCRIBED = Gauge("llmd_timeslice_gate_subscribed", "1 while the gate's state stream to the orchestrator is up.")
STALE = Gauge(
    "llmd_timeslice_gate_state_stale",
    "1 while the gate holds new requests: its state stream has been down longer than stale_after_s.",
)
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 2000),  # transport pings too, so a dead TCP peer ends the stream
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
RESYNCS = Counter("llmd_timeslice_gate_resyncs_total", "Full snapshots applied (first connect and every reconnect).")
RECONNECT_FIRST_S = 0.2
"""First wait before reconnecting (doubling, per failed session in a row, up to :data:`RECONNECT_MAX_S`)."""
RECONNECT_MAX_S = 5.0


class FencedCommand(Exception):
    """A command whose ``leader_term`` is below the highest this gate has seen: from a deposed orchestrator leader.
    The gate answers ``FencedRefusal``, applies nothing of that stream and reconnects (gate_state.proto)."""


class StateSubscription:
    """Keeps ``pools`` in line with the orchestrator at ``target``.

    Args:
        target: orchestrator ``host:port``.
        gate_id: this replica's stable id (e.g. the pod name).
        pools: pool name -> state, shared with the ext_proc servicer.
        pool_factory: creates a pool the orchestrator names that this gate does not have yet.
        token: bearer token for the orchestrator.
        on_synced: called after the first full snapshot is applied (readiness).
        stale_after_s: seconds without a stream before the pools go stale (0: never).
    """

    def __init__(
        self,
        target: str,
        gate_id: str,
        pools: MutableMapping[str, PoolState],
        pool_factory: Callable[[str], PoolState],
        token: str | None = None,
        on_synced: Callable[[], None] | None = None,
        stale_after_s: float = 5.0,
        tls_files: tls.TlsFiles | None = None,
    ) -> None:
        self._tls = tls_files
        self.target, self.gate_id, self.pools = target, gate_id, pools
        self._factory = pool_factory
        self._token = token
        self._on_synced = on_synced
        self.connected = asyncio.Event()
        self.synced_epoch = -1
        self.resyncs = 0
        self._outbox: asyncio.Queue | None = None
        self._tasks: set[asyncio.Task] = set()
        self.stale_after_s = stale_after_s
        self.last_rx: float | None = None  # monotonic time of the last command from the orchestrator
        self.stale = False
        self.highest_term = 0
        """Highest orchestrator leader term seen on a command (fencing; 0: none, or an unfenced orchestrator)."""

    async def run(self) -> None:
        """Connect, apply, reconnect on failure; runs until cancelled."""
        watchdog = asyncio.get_running_loop().create_task(self._watch_staleness())
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(Exception),
            before_sleep=self._lost,
            reraise=True,
            wait=wait_exponential(multiplier=RECONNECT_FIRST_S, max=RECONNECT_MAX_S),
        )
        try:
            while True:
                await retrying(self._session_once)  # sessions that fail before they sync: waits double
                self._disconnected()  # it synced, then ended: the next session starts from the first wait
                await asyncio.sleep(RECONNECT_FIRST_S)
        finally:
            watchdog.cancel()

    async def _watch_staleness(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(0.1)
            if (
                self.stale_after_s > 0
                and not self.stale
                and self.last_rx is not None
                and loop.time() - self.last_rx >= self.stale_after_s
            ):
                self._set_stale(True)
                log.warning(
                    "no state stream from %s for %.1f s: holding new requests until it resyncs (the "
                    "orchestrator may have put engines to sleep meanwhile)",
                    self.target,
                    self.stale_after_s,
                )

    def _set_stale(self, stale: bool) -> None:
        self.stale = stale
        STALE.set(int(stale))
        for pool in self.pools.values():
            pool.set_stale(stale)

    async def _session_once(self) -> None:
        """One session: returns once it ended after the orchestrator's first snapshot was applied, however it
        ended (logged here); raises what ended a session that never synced (tenacity waits, then retries)."""
        synced = self.resyncs
        try:
            await self._session()
        except Exception as exc:
            if self.resyncs == synced:
                raise
            self._log_lost(exc, RECONNECT_FIRST_S)

    def _lost(self, state: RetryCallState) -> None:
        """tenacity's ``before_sleep``: a session failed before it synced."""
        exc = state.outcome.exception() if state.outcome is not None else None
        self._log_lost(exc, state.next_action.sleep if state.next_action is not None else 0.0)
        self._disconnected()

    def _log_lost(self, exc: BaseException | None, wait_s: float) -> None:
        if isinstance(exc, grpc.aio.AioRpcError):
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                log.error("orchestrator %s refused the gate: %s (check the token)", self.target, exc.details())
            else:
                log.warning(
                    "state stream to %s lost: %s %s; keeping the last known state, retrying in %.1f s",
                    self.target,
                    exc.code().name,
                    exc.details(),
                    wait_s,
                )
        elif isinstance(exc, FencedCommand):
            log.error("state stream to %s refused: %s; reconnecting in %.1f s", self.target, exc, wait_s)
        elif exc is not None:
            log.error("state stream to %s failed; retrying in %.1f s", self.target, wait_s, exc_info=exc)

    def _disconnected(self) -> None:
        self.connected.clear()
        SUBSCRIBED.set(0)

    async def _outgoing(self, outbox: asyncio.Queue, written: asyncio.Event | None = None):
        yield pb.GateMessage(hello=pb.GateHello(gate_id=self.gate_id, pools=sorted(self.pools), stale_after_s=self.stale_after_s))
        while True:
            msg = await outbox.get()
            if msg is None:
                if written is not None:
                    written.set()  # grpc asked for the next message: everything before was written
                return
            yield msg

    async def _refuse_fenced(self, cmd: pb.GateCommand, outbox: asyncio.Queue, written: asyncio.Event) -> None:
        """Answer a command of a deposed leader with FencedRefusal (so it steps down), then end the session."""
        outbox.put_nowait(pb.GateMessage(fenced=pb.FencedRefusal(refused_term=cmd.leader_term, highest_term=self.highest_term)))
        outbox.put_nowait(None)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(written.wait(), 1.0)
        raise FencedCommand(
            f"a command of orchestrator leader term {cmd.leader_term} refused: this gate has seen term {self.highest_term}"
        )

    async def _session(self) -> None:
        outbox: asyncio.Queue = asyncio.Queue()
        self._outbox = outbox
        written = asyncio.Event()
        # Metadata passed on the call: grpc.aio's stream-stream client interceptors do not add it (seen with 1.85).
        async with tls.aio_channel(self.target, self._tls, options=KEEPALIVE_OPTIONS) as ch:
            call = pb_grpc.GateStateServiceStub(ch).Connect(
                self._outgoing(outbox, written), metadata=auth.call_metadata(self._token)
            )
            try:
                async for cmd in call:
                    if cmd.leader_term < self.highest_term:
                        await self._refuse_fenced(cmd, outbox, written)
                    self.highest_term = cmd.leader_term
                    if self.connected.is_set():
                        self.last_rx = asyncio.get_running_loop().time()
                    which = cmd.WhichOneof("command")
                    if which == "keepalive":
                        outbox.put_nowait(pb.GateMessage(keepalive=pb.KeepAlive()))
                    elif which == "state":
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
                pool.set_stale(self.stale)
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
            self.last_rx = asyncio.get_running_loop().time()
            if self.stale:
                self._set_stale(False)
                log.warning("state stream to %s resynced: steering again", self.target)
            if self._on_synced is not None:
                self._on_synced()
        self.synced_epoch = update.epoch
        metrics.ORCHESTRATOR_EPOCH.set(update.epoch)

    async def _drain(self, q: pb.DrainQuery, outbox: asyncio.Queue) -> None:
        """Answer a drain query from the pool's drain barrier; at its timeout, requests that could still reach the
        addresses and whose response has not started are refused (503 drain_deadline) and named in the result."""
        pool = self.pools.get(q.pool)
        result = pb.DrainResult(query_id=q.query_id, drained=True)
        if pool is not None:
            outcome = await pool.drain(list(q.addresses), max(0.0, q.timeout_s))
            result.drained = outcome.drained
            result.in_flight.update(outcome.in_flight)
            addrs = set(q.addresses)
            for adm in outcome.cut:
                result.cut.add(request_id=adm.request_id, addresses=sorted(addrs.intersection(adm.candidates)))
            if outcome.cut:
                log.warning(
                    "pool=%s drain deadline (%.1f s) passed: %d request(s) that could still reach %s were "
                    "answered 503 drain_deadline: %s",
                    q.pool,
                    q.timeout_s,
                    len(outcome.cut),
                    sorted(addrs),
                    [a.request_id for a in outcome.cut],
                )
        outbox.put_nowait(pb.GateMessage(drain_result=result))
