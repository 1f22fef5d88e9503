"""The gate's subscription to the orchestrator's endpoint state (``GateStateService.Connect``).

Applies snapshots and updates to the pools, acks each epoch once applied, answers drain queries
from the pool's drain barrier and the orchestrator's keepalive (at least every second, and at least three times
per ``stale_after_s``, on an idle stream). Until then the last known state serves, so an orchestrator restart
passes unnoticed.

**Current view** (docs/gate.md, "When the gate's view counts as current"): the orchestrator never puts an
endpoint to sleep before every gate has either acked the epoch that drained it or been silent, *as the
orchestrator hears it*, for the ``stale_after_s`` that gate announced. The gate answers every command it processes
at once, so its view is current while less than ``stale_after_s`` has passed since it last processed a command
(or sent its hello). Past that (a broken stream, a partition, a stuck orchestrator, or this process stalled: a
SIGSTOP, a CPU-throttled container, a long pause) every pool is **stale**: new requests are held, not steered,
checked in the data path itself (``PoolState.fresh_until``), so the first request after a stall of this process is
held even before the watchdog runs. A command processed late is *not* taken as current (it may be a backlog
queued before the stall, while the orchestrator went on without this gate): staleness is never healed by the old
stream. The gate then **resubscribes**: it drops the stream and opens a new one, whose first message is a full
snapshot sent after the orchestrator registered the new stream, and that snapshot makes the view current again
(it too must arrive within ``stale_after_s`` of the hello, or the session is dropped and retried).

**Hold pressure** (issue 26; docs/gate.md, "Priority bands"): while a band with a hold deadline holds requests,
the gate sends ``GateMessage.hold_pressure`` for it on the stream: at once when the band's first request is held,
then every :data:`PRESSURE_PERIOD_S` while it holds any, and a last one with ``held = 0`` when it holds none. The
orchestrator applies the group's yield-request policy to it; the gate holds no policy of its own. Nothing is sent
while the stream is down (the next session's messages start over with a first one).

Reconnects use exponential back-off (0.2 s doubling to 5 s, tenacity; a session that synced starts the next from
0.2 s again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
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
    # Each session's channel connects anew: by default channels to one target share a subchannel, whose reconnect
    # back-off (1 s, x1.6, up to 5 s) outlives the session that grew it, so after a partition healed the next session
    # failed fast (UNAVAILABLE) until that back-off ran out, on top of the gate's own wait (RECONNECT_FIRST_S ...).
    ("grpc.use_local_subchannel_pool", 1),
]
RESYNCS = Counter("llmd_timeslice_gate_resyncs_total", "Full snapshots applied (first connect and every reconnect).")
RESUBSCRIBES = Counter(
    "llmd_timeslice_gate_resubscribes_total",
    "State streams the gate dropped itself to get a current view: its view went stale on a stream that stayed up "
    "(reason=stale), a command came later than stale_after_s after the last one (reason=late), or the first "
    "snapshot did not come within stale_after_s of the hello (reason=no_snapshot).",
    ["reason"],
)
RECONNECT_FIRST_S = 0.2
"""First wait before reconnecting (doubling, per failed session in a row, up to :data:`RECONNECT_MAX_S`)."""
RECONNECT_MAX_S = 5.0
WATCHDOG_PERIOD_S = 0.1
PRESSURE_PERIOD_S = 0.25
"""Seconds between two HoldPressure messages of one band while it holds requests."""
HOLD_PRESSURE = Counter(
    "llmd_timeslice_gate_hold_pressure_messages_total",
    "HoldPressure messages sent to the orchestrator (bands with a hold deadline holding requests), by pool.",
    ["pool"],
)


class Resubscribe(Exception):
    """The gate ends its own state stream to get a current view (see the module docstring); ``reason`` is the
    metric label: ``stale``, ``late`` or ``no_snapshot``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class FencedCommand(Exception):
    """A command whose ``leader_term`` is below the highest this gate has seen: from a deposed orchestrator leader.
    The gate answers ``FencedRefusal``, applies nothing of that stream and reconnects (gate_state.proto)."""


class StateSubscription:
    """Keeps ``pools`` in line with the orchestrator at ``target``.

    Args:
        target: orchestrator ``host:port``.
        gate_id: this replica's stable id (e.g. the pod name).
        pools: pool name -> state, shared with the ext_proc servicer.
        pool_factory: creates a pool the orchestrator names that this gate does not have yet (None: such a pool's
            endpoints are ignored, logged once per pool; ``gate.accept_new_pools`` false).
        token: bearer token for the orchestrator.
        on_synced: called after the first full snapshot is applied (readiness).
        stale_after_s: seconds without a processed command before the pools go stale and the gate resubscribes
            (0: never; the orchestrator is told in the hello).
        clock: monotonic seconds; the pools' ``PoolState`` clock must be the same one.
    """

    def __init__(
        self,
        target: str,
        gate_id: str,
        pools: MutableMapping[str, PoolState],
        pool_factory: Callable[[str], PoolState] | None,
        token: str | None = None,
        on_synced: Callable[[], None] | None = None,
        stale_after_s: float = 5.0,
        tls_files: tls.TlsFiles | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tls = tls_files
        self.target, self.gate_id, self.pools = target, gate_id, pools
        self._factory = pool_factory
        self._ignored: set[str] = set()  # pools named by the orchestrator but not created (no pool_factory)
        self._token = token
        self._on_synced = on_synced
        self._clock = clock
        self.connected = asyncio.Event()
        self.synced_epoch = -1
        self.resyncs = 0
        self.resubscribes = 0
        self._outbox: asyncio.Queue | None = None
        self._tasks: set[asyncio.Task] = set()
        self.stale_after_s = stale_after_s
        self.last_rx: float | None = None
        """Monotonic time (``clock``) of the last command processed in time on a synced stream (each is answered
        at once); None before the first snapshot."""
        self._hello_at: float | None = None  # the current session's hello, until its snapshot is applied
        self.stale = False
        self._session_task: asyncio.Task | None = None
        self._resubscribe: Resubscribe | None = None
        self.highest_term = 0
        """Highest orchestrator leader term seen on a command (fencing; 0: none, or an unfenced orchestrator)."""
        self._pressure = asyncio.Event()
        self.pressure_sent = 0
        for pool in pools.values():
            self.watch_pool(pool)

    def watch_pool(self, pool: PoolState) -> None:
        """Send HoldPressure for ``pool``'s deadline bands (every pool of the gate, also one created later)."""
        pool.on_pressure = self._pressure.set

    async def run(self) -> None:
        """Connect, apply, reconnect on failure; runs until cancelled."""
        watchdog = asyncio.get_running_loop().create_task(self._watch_staleness())
        pressure = asyncio.get_running_loop().create_task(self._send_pressure())
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
            pressure.cancel()

    async def _send_pressure(self) -> None:
        """HoldPressure of every pool's deadline bands (see the module docstring); woken by a band starting or
        stopping to hold (``PoolState.on_pressure``), else every :data:`PRESSURE_PERIOD_S` while one holds."""
        last: dict[tuple[str, int], tuple[float, float]] = {}  # (pool, band) -> (sent at, deadline) on this stream
        outbox = None
        while True:
            if outbox is not self._outbox:  # a new session: every band starts over with a first message
                outbox, last = self._outbox, {}
            now = self._clock()
            live = outbox is not None and self.connected.is_set()
            seen: set[tuple[str, int]] = set()
            for name, pool in list(self.pools.items()):
                for bp in pool.pressure():
                    key = (name, bp.band)
                    seen.add(key)
                    sent = last.get(key)
                    if live and (sent is None or now - sent[0] >= PRESSURE_PERIOD_S):
                        self._pressure_message(outbox, name, bp.band, bp.objective, bp.oldest_held_s, bp.hold_deadline_s, bp.held)
                        last[key] = (now, bp.hold_deadline_s)
            for key in [k for k in last if k not in seen]:
                _, deadline = last.pop(key)
                if live:
                    self._pressure_message(outbox, key[0], key[1], "", 0.0, deadline, 0)
            self._pressure.clear()
            if seen:
                due = min((last[k][0] + PRESSURE_PERIOD_S for k in seen if k in last), default=now + PRESSURE_PERIOD_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._pressure.wait(), max(0.0, due - self._clock()))
            else:
                await self._pressure.wait()

    def _pressure_message(
        self, outbox: asyncio.Queue | None, pool: str, band: int, objective: str, oldest_s: float, deadline_s: float, held: int
    ) -> None:
        if outbox is None:
            return
        outbox.put_nowait(
            pb.GateMessage(
                hold_pressure=pb.HoldPressure(
                    pool=pool, band=band, objective=objective, oldest_held_s=oldest_s, hold_deadline_s=deadline_s, held=held
                )
            )
        )
        self.pressure_sent += 1
        HOLD_PRESSURE.labels(pool=pool).inc()

    async def _watch_staleness(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            if self.stale_after_s <= 0:
                continue
            now = self._clock()
            if self.last_rx is not None and now - self.last_rx >= self.stale_after_s:
                self._go_stale(now - self.last_rx)
                if self.connected.is_set():  # the stream is up but brings nothing current: drop it
                    self._end_session(Resubscribe("stale", f"no command processed for {now - self.last_rx:.1f} s"))
            if not self.connected.is_set() and self._hello_at is not None and now - self._hello_at >= self.stale_after_s:
                detail = f"no snapshot {now - self._hello_at:.1f} s after the hello (stale_after_s {self.stale_after_s:g})"
                self._end_session(Resubscribe("no_snapshot", detail))

    def _go_stale(self, silent_s: float) -> None:
        if self.stale:
            return
        self._set_stale(True)
        log.warning(
            "no current state from %s for %.1f s (stale_after_s %g): holding new requests and resubscribing for a "
            "full snapshot (the orchestrator may have put engines to sleep meanwhile)",
            self.target,
            silent_s,
            self.stale_after_s,
        )

    def _end_session(self, why: Resubscribe) -> None:
        """Drop the current stream (at most once per session); the session ends with ``why``."""
        task = self._session_task
        if task is None or task.done() or self._resubscribe is not None:
            return
        self._resubscribe = self._resubscribing(why)
        task.cancel()

    def _resubscribing(self, why: Resubscribe) -> Resubscribe:
        RESUBSCRIBES.labels(why.reason).inc()
        self.resubscribes += 1
        return why

    def _set_stale(self, stale: bool) -> None:
        self.stale = stale
        STALE.set(int(stale))
        for pool in self.pools.values():
            pool.set_stale(stale)

    def _heard(self, now: float) -> None:
        """A command was processed in time at ``now``: the view stays current ``stale_after_s`` from now."""
        self.last_rx = now
        if self.stale_after_s > 0:
            until = now + self.stale_after_s
            for pool in self.pools.values():
                pool.set_fresh_until(until)

    async def _session_once(self) -> None:
        """One session: returns once it ended after the orchestrator's first snapshot was applied, however it
        ended (logged here); raises what ended a session that never synced (tenacity waits, then retries)."""
        synced = self.resyncs
        self._resubscribe = None
        self._session_task = asyncio.create_task(self._session())
        try:
            await asyncio.shield(self._session_task)
        except asyncio.CancelledError:
            why = self._resubscribe
            current = asyncio.current_task()
            if why is None or (current is not None and current.cancelling()):
                self._session_task.cancel()  # the gate stops
                raise
            exc: BaseException = why
        except Exception as e:
            exc = e
        else:
            return
        finally:
            self._session_task = None
        if self.resyncs == synced:
            raise exc
        self._log_lost(exc, RECONNECT_FIRST_S)

    def _lost(self, state: RetryCallState) -> None:
        """tenacity's ``before_sleep``: a session failed before it synced."""
        exc = state.outcome.exception() if state.outcome is not None else None
        self._log_lost(exc, state.next_action.sleep if state.next_action is not None else 0.0)
        self._disconnected()

    def _log_lost(self, exc: BaseException | None, wait_s: float) -> None:
        if isinstance(exc, Resubscribe):
            log.warning("state stream to %s dropped by the gate (%s): resubscribing in %.1f s", self.target, exc, wait_s)
        elif isinstance(exc, grpc.aio.AioRpcError):
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
        self._hello_at = self._clock()  # the first snapshot must come within stale_after_s of the hello
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
                    now = self._clock()
                    synced = self.connected.is_set()
                    since = self.last_rx if synced else self._hello_at
                    if self.stale_after_s > 0 and since is not None and now - since >= self.stale_after_s:
                        # Processed too late to count as current: a backlog from before a stall of this process (or
                        # of the path). Hold, and get a snapshot on a new stream instead of applying it.
                        if synced:
                            self._go_stale(now - since)
                        what = "a command" if synced else "the snapshot"
                        detail = f"{what} was processed {now - since:.1f} s after the last contact"
                        raise self._resubscribing(Resubscribe("late" if synced else "no_snapshot", detail))
                    which = cmd.WhichOneof("command")
                    if self.connected.is_set():
                        self._heard(now)
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
                if self._factory is None:
                    if pe.pool not in self._ignored:
                        self._ignored.add(pe.pool)
                        log.warning("pool %r named by the orchestrator is not served here (accept_new_pools is off)", pe.pool)
                    continue
                pool = self.pools[pe.pool] = self._factory(pe.pool)
                pool.set_stale(self.stale)
                self.watch_pool(pool)
            items = [(e.address, TO_CORE[e.state], e.weight_version) for e in pe.endpoints if e.state in TO_CORE]
            if update.full_snapshot:
                pool.replace_states(items)
            else:
                pool.set_states(items)
            pool.set_weights_final(pe.weights_final)
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
            self._hello_at = None
            self._heard(self._clock())
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
