"""The orchestrator's side of the gate state stream (project service ``GateStateService``).

The hub owns the desired endpoint state of every pool (the source of truth) and the set of
connected gate replicas. ``publish`` applies a change, starts a new state epoch, sends it to every
connected gate and waits until each acked that epoch (the gate applied it, so it no longer
steers to a DRAINING endpoint). ``wait_drained`` asks every connected gate for its drain barrier
and waits for all answers. A gate that connects (or reconnects) first gets a full snapshot.

Gates the hub lost: a gate that does not ack in time has its stream closed, and ``publish`` then waits
until every gate it heard from recently has either acked the epoch (after reconnecting) or been
without a stream for the ``stale_after_s`` it announced in its hello, after which that gate holds new
requests by itself. So an epoch is never treated as applied while some gate may still steer by an
older one (a network partition between gate and orchestrator, a gate stuck or restarting).

Hold pressure (issue 26): a gate whose band with a hold deadline holds requests sends ``hold_pressure`` on its
stream; the hub keeps each gate's latest per (pool, band), sums them over gates (held: the sum; oldest: the
longest wait, with its objective) and hands the sum to ``on_hold_pressure`` (the orchestrator's yield-request
policy, :mod:`llmd_timeslice.orchestrator.yield_requests`). A gate whose stream ends stops counting.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from prometheus_client import Counter, Gauge

from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as gpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2 as pb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2_grpc as pb_grpc
from llmd_timeslice.orchestrator.yield_requests import HoldPressure

log = logging.getLogger(__name__)
# States whose publication need not wait for a lost gate to hold by itself: they put nothing out of service.
_NO_WAIT_FOR_LOST_GATES = frozenset({gpb.ENDPOINT_STATE_SERVING, gpb.ENDPOINT_STATE_WAKING})

CONNECTED_GATES = Gauge("llmd_timeslice_orchestrator_connected_gates", "Gate replicas subscribed to the state stream.")
GATE_COMMANDS = Counter(
    "llmd_timeslice_orchestrator_gate_commands_total",
    "Commands sent on the state streams, summed over gates, by kind (state, snapshot, drain, keepalive).",
    ["kind"],
)
HOLD_PRESSURE = Counter(
    "llmd_timeslice_orchestrator_hold_pressure_messages_total",
    "hold_pressure messages received from gates (held requests of a band with a hold deadline).",
)
GATE_ENDPOINT_UPDATES = Counter(
    "llmd_timeslice_orchestrator_gate_endpoint_updates_total",
    "Endpoint states carried by state updates (not snapshots), summed over gates.",
)


@dataclass(eq=False)
class _GateConn:
    gate_id: str
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    acked_epoch: int = -1
    ack_waiters: list[tuple[int, int, asyncio.Future]] = field(default_factory=list)
    """Heap of ``(epoch, seq, future)``: each publication waiting for this gate's ack of ``epoch``."""
    drains: dict[str, asyncio.Future] = field(default_factory=dict)
    closed: bool = False
    stale_after_s: float = 3.0
    last_sent: float = 0.0
    """Event-loop time of the last command yielded on the stream (the keepalive timer reads it)."""


@dataclass(eq=False)
class _Batch:
    """In-service updates of one pool waiting for the next coalesced epoch, and the result its callers await."""

    done: asyncio.Future
    updates: list[tuple[str, gpb.EndpointState, int | None]] = field(default_factory=list)


@dataclass
class _Contact:
    """When the hub last heard from a gate (monotonic seconds) and the grace the gate announced."""

    at: float
    stale_after_s: float


WEIGHTS_FINAL_FLUSH_S = 0.2
"""Longest a change of a pool's ``weights_final`` waits for the pool's next state update before it is sent alone."""


class GateHub(pb_grpc.GateStateServiceServicer):
    """Endpoint state per pool and the gates subscribed to it.

    Args:
        ack_timeout_s: most seconds ``publish`` waits for each gate's ack; a gate that does not
            ack in time is logged, its stream closed, and ``publish`` waits for it to hold by itself.
        keepalive_s: period of the keepalive command on an idle stream, in seconds.
    """

    def __init__(self, ack_timeout_s: float = 5.0, keepalive_s: float = 1.0) -> None:
        self.ack_timeout_s = ack_timeout_s
        self.keepalive_s = keepalive_s
        self.epoch = 0
        self.weights_final: dict[str, bool] = {}  # pool -> no newer weight version can come now (set_weights_final)
        self.weights_final_flush_s = WEIGHTS_FINAL_FLUSH_S
        self._final_flush: dict[str, asyncio.TimerHandle] = {}  # pool -> a flag-only update not yet sent
        self.state: dict[str, dict[str, tuple[gpb.EndpointState, int]]] = {}  # pool -> address -> (wire state, weight version)
        self._gates: dict[str, _GateConn] = {}
        self._ids = itertools.count()
        self._contacts: dict[str, _Contact] = {}
        self._batches: dict[str, _Batch] = {}
        self._senders: dict[str, asyncio.Task] = {}
        self.ack_checks = 0
        """Ack waiters looked at by :meth:`_wake_acked` (tests check it grows as acks + waiters)."""
        self.forget_after_s = 3600.0
        self.on_gates_change: Callable[[], object] | None = None
        """Called when a gate id is first heard from (the server persists the list)."""
        self.term = 0
        """Leader term sent with every command (fencing; 0: no leader election)."""
        self.on_fenced: Callable[[str, int, int], object] | None = None
        """Called with (gate id, refused term, the gate's highest term) when a gate refuses a command as fenced."""
        self.on_endpoint_failure: Callable[[str, str], bool] | None = None
        """Called with ``(address, why)`` when a gate reports that Envoy could not connect to an endpoint; returns
        whether an engine audit was started (the server wires :meth:`Orchestrator.audit_endpoint`)."""
        self.on_hold_pressure: Callable[[HoldPressure], object] | None = None
        """Called with the pressure of one (pool, band) summed over gates at each ``hold_pressure`` message (the
        server wires :meth:`Orchestrator.hold_pressure`)."""
        self._pressure: dict[tuple[str, int], dict[str, pb.HoldPressure]] = {}  # (pool, band) -> gate id -> latest

    @property
    def gate_ids(self) -> list[str]:
        return sorted(self._gates)

    # ------------------------------------------------------------ gRPC service
    async def Connect(self, request_iterator, context):  # noqa: N802
        try:
            first = await request_iterator.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("message") != "hello" or not first.hello.gate_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be GateHello with a gate_id")
        conn = _GateConn(first.hello.gate_id, stale_after_s=first.hello.stale_after_s)
        self._touch(conn)
        old = self._gates.get(conn.gate_id)
        if old is not None:
            self._close(old, "replaced by a new stream from the same gate_id")
        self._gates[conn.gate_id] = conn
        CONNECTED_GATES.set(len(self._gates))
        log.info("gate %s connected (pools %s); sending snapshot at epoch %d", conn.gate_id, list(first.hello.pools), self.epoch)
        conn.outbox.put_nowait(pb.GateCommand(state=self._snapshot()))
        GATE_COMMANDS.labels("snapshot").inc()
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read(conn, request_iterator))
        keepalive = pb.GateCommand(keepalive=pb.KeepAlive())
        timer = None  # the keepalive timer (an asyncio.TimerHandle once armed)
        # At least three keepalives per stale_after_s the gate announced: it counts its view current only that
        # long after the last command it processed (epp_plugin/gate/subscription.py).
        period = min(self.keepalive_s, conn.stale_after_s / 3) if conn.stale_after_s > 0 else self.keepalive_s

        def keepalive_due() -> None:
            # One timer per keepalive period rather than a timeout on every wait for the next command (that was a
            # task and a timer per command sent, hundreds per switch with many samplers).
            nonlocal timer
            due = conn.last_sent + period
            if loop.time() >= due - 0.001:
                conn.outbox.put_nowait(keepalive)
                GATE_COMMANDS.labels("keepalive").inc()
                due = loop.time() + period
            timer = loop.call_at(due, keepalive_due)

        conn.last_sent = loop.time()
        timer = loop.call_at(conn.last_sent + period, keepalive_due)
        try:
            while True:
                cmd = await conn.outbox.get()
                if cmd is None:
                    return
                conn.last_sent = loop.time()
                cmd.leader_term = self.term
                yield cmd
        finally:
            if timer is not None:
                timer.cancel()
            reader.cancel()
            if self._gates.get(conn.gate_id) is conn:
                del self._gates[conn.gate_id]
                CONNECTED_GATES.set(len(self._gates))
                self._forget_pressure(conn.gate_id)
            self._close(conn, "stream ended")
            log.info("gate %s disconnected", conn.gate_id)

    async def ReportEndpointFailure(self, request, context):  # noqa: N802
        """A gate saw a connection to ``request.address`` fail and stopped steering to it: audit that engine now."""
        if not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "EndpointFailure needs the endpoint's address (ip:port)")
        log.warning(
            "gate %s: Envoy could not connect to %s (pool %s: %s); auditing its engine now",
            request.gate_id or "?",
            request.address,
            request.pool or "?",
            request.reason or "no detail",
        )
        why = f"gate {request.gate_id or '?'} saw a failed connection ({request.reason or 'no detail'})"
        audited = self.on_endpoint_failure(request.address, why) if self.on_endpoint_failure is not None else False
        return pb.EndpointFailureAck(audited=audited)

    async def _read(self, conn: _GateConn, request_iterator) -> None:
        try:
            async for msg in request_iterator:
                self._touch(conn)
                which = msg.WhichOneof("message")
                if which == "ack":
                    conn.acked_epoch = max(conn.acked_epoch, msg.ack.epoch)
                    self._wake_acked(conn)
                elif which == "drain_result":
                    fut = conn.drains.pop(msg.drain_result.query_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg.drain_result)
                elif which == "hold_pressure":
                    self._take_pressure(conn.gate_id, msg.hold_pressure)
                elif which == "fenced":
                    log.error(
                        "gate %s refused a command of leader term %d: it has seen term %d (a newer leader)",
                        conn.gate_id,
                        msg.fenced.refused_term,
                        msg.fenced.highest_term,
                    )
                    if self.on_fenced is not None:
                        self.on_fenced(conn.gate_id, msg.fenced.refused_term, msg.fenced.highest_term)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            conn.outbox.put_nowait(None)

    def _take_pressure(self, gate_id: str, p: pb.HoldPressure) -> None:
        HOLD_PRESSURE.inc()
        if not p.pool:
            log.warning("gate %s: hold_pressure without a pool ignored", gate_id)
            return
        key = (p.pool, p.band)
        per_gate = self._pressure.setdefault(key, {})
        if p.held > 0:
            per_gate[gate_id] = p
        else:
            per_gate.pop(gate_id, None)
        self._emit_pressure(key, p.hold_deadline_s)

    def _forget_pressure(self, gate_id: str) -> None:
        for key, per_gate in list(self._pressure.items()):
            gone = per_gate.pop(gate_id, None)
            if gone is not None:
                self._emit_pressure(key, gone.hold_deadline_s)

    def _emit_pressure(self, key: tuple[str, int], hold_deadline_s: float) -> None:
        per_gate = self._pressure.get(key) or {}
        if not per_gate:
            self._pressure.pop(key, None)
            total = HoldPressure(key[0], key[1], "", 0.0, hold_deadline_s, 0)
        else:
            oldest = max(per_gate.values(), key=lambda m: m.oldest_held_s)
            total = HoldPressure(
                key[0],
                key[1],
                oldest.objective,
                oldest.oldest_held_s,
                max(m.hold_deadline_s for m in per_gate.values()),
                sum(m.held for m in per_gate.values()),
            )
        if self.on_hold_pressure is not None:
            try:
                self.on_hold_pressure(total)
            except Exception as exc:  # the stream must live on: a policy bug is logged, not fatal to the gate
                log.error("hold pressure of pool %s band %d not taken: %r", key[0], key[1], exc, exc_info=exc)

    def _wake_acked(self, conn: _GateConn) -> None:
        """Resolve the waiters of every epoch ``conn`` has acked (True), or all of them once it closed (their
        ``acked_epoch`` check decides). Each waiter is looked at once when resolved, plus one look per ack at the
        first one still waiting: O(acks + waiters) in all, not waiters x acks (``ack_checks`` counts the looks)."""
        heap = conn.ack_waiters
        while heap:
            self.ack_checks += 1
            epoch, _, fut = heap[0]
            if epoch > conn.acked_epoch and not conn.closed:
                return
            heapq.heappop(heap)
            if not fut.done():  # done: its wait timed out
                fut.set_result(None)

    def _touch(self, conn: _GateConn) -> None:
        new = conn.gate_id not in self._contacts
        self._contacts[conn.gate_id] = _Contact(time.monotonic(), conn.stale_after_s)
        if new and self.on_gates_change is not None:
            self.on_gates_change()

    def known_gates(self) -> dict[str, float]:
        """Gate id -> its announced ``stale_after_s``, for every gate heard from (persisted across restarts)."""
        return {gid: c.stale_after_s for gid, c in self._contacts.items()}

    def assume_recent(self, gates: dict[str, float]) -> None:
        """After a restart: treat ``gates`` (from :meth:`known_gates`) as heard from just now, so no engine is
        put to sleep until each has reconnected and acked, or stayed silent for its ``stale_after_s``."""
        now = time.monotonic()
        for gid, stale in (gates or {}).items():
            self._contacts.setdefault(str(gid), _Contact(now, float(stale)))

    def _close(self, conn: _GateConn, why: str) -> None:
        if conn.closed:
            return
        if self._gates.get(conn.gate_id) is conn:
            self._touch(conn)  # its last contact: from here the gate's own grace runs
        conn.closed = True
        conn.outbox.put_nowait(None)
        self._wake_acked(conn)
        for fut in conn.drains.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"gate {conn.gate_id}: {why}"))
        conn.drains.clear()

    def close_all(self) -> None:
        """End every gate stream cleanly (orchestrator shutdown); gates keep their state and reconnect."""
        for conn in list(self._gates.values()):
            self._close(conn, "orchestrator shutting down")

    # ------------------------------------------------------------------ state
    def _snapshot(self) -> pb.StateUpdate:
        return pb.StateUpdate(
            epoch=self.epoch,
            full_snapshot=True,
            pools=[
                pb.PoolEndpoints(
                    pool=pool,
                    endpoints=[gpb.EndpointUpdate(address=a, state=s, weight_version=v) for a, (s, v) in eps.items()],
                    weights_final=self.weights_final.get(pool, False),
                )
                for pool, eps in self.state.items()
            ],
        )

    def set_weights_final(self, pool: str, final: bool) -> None:
        """Whether no newer weight version can come for ``pool`` (:meth:`Orchestrator.weights_final`). A change rides
        on the pool's next state update (an acquire is followed by its drain, a release by its wakes, within
        milliseconds); only when none goes out within :attr:`weights_final_flush_s` is it sent alone, as a state
        update without endpoints (not waited for: the flag only lets a gate refuse at once what it would otherwise
        hold). So the flag costs the gates no message per switch (benchmarks.scale, messages per gate per switch)."""
        if self.weights_final.get(pool, False) == final:
            return
        self.weights_final[pool] = final
        if pool not in self._final_flush:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a unit test of the hub's state): the next update carries it
                return
            self._final_flush[pool] = loop.call_later(self.weights_final_flush_s, self._send_weights_final, pool)

    def _send_weights_final(self, pool: str) -> None:
        """The flag-only update of ``pool`` (:meth:`set_weights_final`)."""
        self._final_flush.pop(pool, None)
        self.epoch += 1
        final = self.weights_final.get(pool, False)
        cmd = pb.GateCommand(state=pb.StateUpdate(epoch=self.epoch, pools=[pb.PoolEndpoints(pool=pool, weights_final=final)]))
        conns = [c for c in self._gates.values() if not c.closed]
        for c in conns:
            c.outbox.put_nowait(cmd)
        GATE_COMMANDS.labels("state").inc(len(conns))

    async def publish(self, pool: str, updates: list[tuple[str, gpb.EndpointState, int | None]]) -> tuple[int, list[str]]:
        """Apply ``(address, wire state, weight version or None)`` updates to ``pool``; send them to every gate
        and wait for each gate's ack. Returns ``(epoch, gate ids that did not ack in time)``."""
        eps = self.state.setdefault(pool, {})
        wire = []
        for address, state, version in updates:
            prev_version = eps.get(address, (gpb.ENDPOINT_STATE_UNSPECIFIED, 0))[1]
            v = prev_version if version is None else version
            eps[address] = (state, v)
            wire.append(gpb.EndpointUpdate(address=address, state=state, weight_version=v))
        self.epoch += 1
        epoch = self.epoch
        final = self.weights_final.get(pool, False)
        pending = self._final_flush.pop(pool, None)
        if pending is not None:  # this update carries the flag's change
            pending.cancel()
        cmd = pb.GateCommand(
            state=pb.StateUpdate(epoch=epoch, pools=[pb.PoolEndpoints(pool=pool, endpoints=wire, weights_final=final)])
        )
        conns = [c for c in self._gates.values() if not c.closed]
        for c in conns:
            c.outbox.put_nowait(cmd)
        GATE_COMMANDS.labels("state").inc(len(conns))
        GATE_ENDPOINT_UPDATES.inc(len(conns) * len(wire))
        results = await self._wait_acks(conns, epoch)
        laggards = [c.gate_id for c, ok in zip(conns, results, strict=True) if not ok]
        if laggards:
            log.warning(
                "epoch %d: no ack within %.1f s from gates %s; closing their streams and waiting until they hold by themselves",
                epoch,
                self.ack_timeout_s,
                laggards,
            )
            for c, ok in zip(conns, results, strict=True):
                if not ok:
                    self._close(c, f"no ack of epoch {epoch} within {self.ack_timeout_s:g} s")
        if any(state not in _NO_WAIT_FOR_LOST_GATES for _, state, _ in updates):
            # Only taking endpoints out of service needs every gate to stop steering to them; a lost gate that
            # misses a WAKING or SERVING update merely keeps holding (or steering elsewhere) until it resyncs.
            await self._wait_lost_gates(epoch)
        return epoch, laggards

    async def publish_coalesced(
        self, pool: str, updates: list[tuple[str, gpb.EndpointState, int | None]]
    ) -> tuple[int, list[str]]:
        """:meth:`publish` for updates that put endpoints in service (SERVING, WAKING), sharing epochs: updates
        made while an earlier coalesced epoch of ``pool`` is still waiting for acks (and those of the same event-loop
        iteration) go out together in the next one, as soon as it is acked. So each endpoint is published at most
        one ack round after it was ready, never after another endpoint's wake, and a release of N samplers costs the
        gates as many epochs as the acks it waited for rather than N (docs/decisions/control-path-128-samplers.md).
        Returns the epoch that
        carried ``updates`` and the gates that did not ack it in time.

        Raises:
            ValueError: an update takes an endpoint out of service (those keep an epoch of their own and wait for
                lost gates: :meth:`publish`).
        """
        out = [a for a, state, _ in updates if state not in _NO_WAIT_FOR_LOST_GATES]
        if out:
            raise ValueError(f"publish_coalesced carries SERVING and WAKING only; {out} would leave service: use publish")
        loop = asyncio.get_running_loop()
        batch = self._batches.get(pool)
        if batch is None:
            batch = self._batches[pool] = _Batch(loop.create_future())
        batch.updates.extend(updates)
        if pool not in self._senders:
            self._senders[pool] = loop.create_task(self._send_coalesced(pool))
        return await asyncio.shield(batch.done)

    async def _send_coalesced(self, pool: str) -> None:
        """Publish ``pool``'s coalesced batches one epoch at a time until none is waiting."""
        batch: _Batch | None = None
        try:
            await asyncio.sleep(0)  # the publications of this event-loop iteration join the first epoch
            while (batch := self._batches.pop(pool, None)) is not None:
                try:
                    result = await self.publish(pool, batch.updates)
                except Exception as exc:
                    batch.done.set_exception(exc)
                else:
                    batch.done.set_result(result)
        finally:
            self._senders.pop(pool, None)
            for b in (batch, self._batches.pop(pool, None)):
                if b is not None and not b.done.done():
                    b.done.cancel()  # the sender was cancelled (shutdown): so are its callers

    async def _wait_lost_gates(self, epoch: int) -> None:
        """Wait until every recently seen gate acked ``epoch`` or has been out of contact for its grace."""
        logged: set[str] = set()
        while True:
            now = time.monotonic()
            pending: dict[str, float] = {}
            for gid, contact in list(self._contacts.items()):
                conn = self._gates.get(gid)
                if conn is not None and not conn.closed and conn.acked_epoch >= epoch:
                    continue
                if now - contact.at > self.forget_after_s:
                    del self._contacts[gid]
                    continue
                if contact.stale_after_s <= 0:
                    if gid not in logged:
                        log.error(
                            "gate %s is out of contact and announced stale_after_s 0: it may keep steering by an "
                            "old state; proceeding without it",
                            gid,
                        )
                        logged.add(gid)
                    continue
                until = contact.at + contact.stale_after_s + 0.2
                if until > now:
                    pending[gid] = until
            if not pending:
                return
            for gid in pending.keys() - logged:
                log.warning(
                    "epoch %d: waiting up to %.1f s for gate %s (out of contact) to ack or hold by itself",
                    epoch,
                    pending[gid] - now,
                    gid,
                )
                logged.add(gid)
            await asyncio.sleep(min(0.05, max(0.0, min(pending.values()) - now)))

    async def _wait_acks(self, conns: list[_GateConn], epoch: int) -> list[bool]:
        """For each of ``conns``: True once it acked ``epoch`` (or a later one); False when it closed first or
        ``ack_timeout_s`` passed. One future per gate still to ack, resolved by the ack that reaches its epoch
        (:meth:`_wake_acked`), and one timer for them all."""
        loop = asyncio.get_running_loop()
        futs = []
        for c in conns:
            if c.acked_epoch < epoch and not c.closed:
                fut = loop.create_future()
                heapq.heappush(c.ack_waiters, (epoch, next(self._ids), fut))
                futs.append(fut)
        if futs:
            try:
                await asyncio.wait(futs, timeout=self.ack_timeout_s)
            finally:
                for f in futs:
                    if not f.done():
                        f.cancel()  # left in the heap: dropped by the next ack past it, or the close
        return [c.acked_epoch >= epoch for c in conns]

    async def _wait_ack(self, conn: _GateConn, epoch: int) -> bool:
        """:meth:`_wait_acks` for one gate."""
        return (await self._wait_acks([conn], epoch))[0]

    async def wait_drained(
        self, pool: str, addresses: list[str], timeout_s: float, cut: list[str] | None = None
    ) -> tuple[bool, dict[str, int]]:
        """Ask every connected gate for its drain barrier on ``addresses``; True when all report drained.

        A gate that disconnects while asked counts as not drained (its requests may still be in flight).
        Gates whose stream the hub closed are not asked (``publish`` already waited until they hold).
        At ``timeout_s`` each gate answers 503 drain_deadline to the requests that could still reach the addresses
        and had no response yet; their ids (x-request-id) are appended to ``cut`` when given."""
        conns = [c for c in self._gates.values() if not c.closed]
        if not conns:
            return True, {}
        loop = asyncio.get_running_loop()
        futs = []
        for c in conns:
            qid = f"{c.gate_id}-{next(self._ids)}"
            fut = loop.create_future()
            c.drains[qid] = fut
            futs.append(fut)
            c.outbox.put_nowait(
                pb.GateCommand(drain=pb.DrainQuery(query_id=qid, pool=pool, addresses=addresses, timeout_s=timeout_s))
            )
        GATE_COMMANDS.labels("drain").inc(len(conns))
        done = await asyncio.gather(*(asyncio.wait_for(f, timeout_s + self.ack_timeout_s) for f in futs), return_exceptions=True)
        drained = True
        left: dict[str, int] = {}
        for r in done:
            if isinstance(r, BaseException):
                drained = False
                continue
            drained &= r.drained
            if cut is not None:
                cut.extend(c.request_id or "(no x-request-id)" for c in r.cut)
            for k, v in r.in_flight.items():
                left[k] = left.get(k, 0) + v
        return drained, left
