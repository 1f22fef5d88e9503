"""One operation stream per sidecar: the orchestrator's side of ``SnapshotOperationsService.RunOperations``.

A sleep or wake used to cost 2 unary calls (``Snapshot``/``Restore``/``RestoreWithWeights``, then
``WaitOperationResult``), 4 per sampler per switch; on grpc.aio each unary call is a call set-up, a batch of six
operations and its completion hop into the event loop, and together they were most of the orchestrator's CPU per
added sampler (docs/decisions/sidecar-operation-stream.md). On one long-lived stream an operation is one
message each way: the command, and the event the sidecar sends when the operation ended (or at once, refused).

The stream is opened on first use and again after it broke. Opening waits for the channel to be ready (a sidecar
that is reconnecting gets ``open_timeout_s``), then for the sidecar's initial metadata, sent as its handler starts:
a dead sidecar fails the command after ``open_timeout_s``, as the unary start call's deadline did. A stream that
breaks (the sidecar stopped or restarted) fails every command waiting on it with :class:`StreamBroken`. No keepalive
pings: with them (5 s) a sidecar's server answered GOAWAY ``too_many_pings`` under load (seen once in
tests/faults/test_orchestrator_failover.py), failing a switch; so a sidecar that goes silent without closing its
connection (its node cut off, or frozen) is caught instead by a reachability probe: a command with no answer after
``probe_after_s`` gets a probe (a unary call on the same channel, :class:`OperationStream`'s ``probe``) every
``probe_after_s`` while it waits, and one the sidecar does not answer within ``open_timeout_s`` fails the command with
:class:`StreamBroken` (UNAVAILABLE), long before the command's own timeout (the operation's deadline, minutes), with
every other command on that stream; the owner then drops the connection (``on_unreachable``), which may stay dead
long after the network is back, so the next command connects anew. Unary calls, not transport pings: no ping
policy to trip. A command answered within ``probe_after_s`` (most sleeps and wakes) costs no probe. A sidecar
without the method (an older release: UNIMPLEMENTED) raises :class:`StreamUnsupported` and is not asked again; the
caller uses the unary calls.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import cast

import grpc
from grpc import aio

from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2_grpc as xpb_grpc

log = logging.getLogger(__name__)


class StreamBroken(Exception):
    """The stream could not be opened, or broke with the command in flight: ``code`` and ``details`` say how."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class StreamUnsupported(Exception):
    """The sidecar has no ``RunOperations`` (UNIMPLEMENTED: an older release)."""


class OperationRefused(Exception):
    """The sidecar did not start the command: the status its unary call would have ended with (``fenced_term``:
    the highest leader term it saw, on a fenced refusal; else 0)."""

    def __init__(self, refusal: xpb.OperationRefusal) -> None:
        code = next((c for c in grpc.StatusCode if c.value[0] == refusal.code), grpc.StatusCode.UNKNOWN)
        super().__init__(f"{code.name}: {refusal.details}")
        self.code, self.details, self.fenced_term = code, refusal.details, refusal.fenced_term


def _expire(fut: asyncio.Future, timeout_s: float) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError(f"no answer from the sidecar within {timeout_s:g} s"))


Probe = Callable[[float], Awaitable[bool]]
"""Whether the sidecar answers a call within the given seconds (any answer counts, an error status included)."""

PROBE_AFTER_S = 2.0
"""A command without an answer after this long gets a reachability probe, and again this often while it waits."""


async def _watch(
    fut: asyncio.Future, probe: Probe, timeout_s: float, every_s: float, lost: Callable[[StreamBroken], None]
) -> None:
    """Call ``lost`` with the reason when the sidecar stops answering probes while ``fut`` waits (module docstring);
    ends when ``fut`` does."""
    while not fut.done():
        if not await probe(timeout_s):
            if not fut.done():
                lost(
                    StreamBroken(
                        grpc.StatusCode.UNAVAILABLE,
                        f"the sidecar did not answer a call within {timeout_s:g} s while the operation ran: "
                        "unreachable (its node cut off, down or frozen)",
                    )
                )
            return
        await asyncio.sleep(every_s)


class _Open:
    """One opened stream: its call, the commands waiting for their event, and the task that reads the events."""

    def __init__(self, call: aio.StreamStreamCall) -> None:
        self.call = call
        self.pending: dict[int, asyncio.Future[xpb.OperationEvent]] = {}
        self.write_lock = asyncio.Lock()  # one message in flight per call (gRPC core)
        self.broken: StreamBroken | None = None
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        why = StreamBroken(grpc.StatusCode.UNAVAILABLE, "the sidecar ended its operation stream")
        try:
            while True:
                got = await self.call.read()
                if got is aio.EOF:
                    break
                event = cast(xpb.OperationEvent, got)
                fut = self.pending.pop(event.command_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(event)
        except aio.AioRpcError as exc:
            why = StreamBroken(exc.code(), exc.details() or "")
        except asyncio.CancelledError:
            why = StreamBroken(grpc.StatusCode.CANCELLED, "the orchestrator closed its operation stream")
            raise
        finally:
            if self.broken is None:  # else failed first (:meth:`fail`): that reason stands
                self.broken = why
            pending, self.pending = self.pending, {}
            for fut in pending.values():
                if not fut.done():
                    fut.set_exception(why)

    def fail(self, why: StreamBroken) -> None:
        """Fail every command waiting on this stream with ``why`` and end it."""
        if self.broken is None:
            self.broken = why
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(why)
        self.close()

    def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()


class OperationStream:
    """The operation stream to one sidecar.

    Args:
        stub: the sidecar's ``SnapshotOperationsService`` stub.
        metadata: call metadata of the stream (the bearer token).
        open_timeout_s: most seconds to wait for a stream to open (channel ready and the sidecar's answer), and for
            the sidecar to answer a reachability probe.
        probe: the reachability probe of a command waiting for its answer (module docstring); None: none.
        probe_after_s: when a waiting command is first probed, and how often again.
        on_unreachable: called when a probe went unanswered (after the stream was ended and every command waiting on
            it failed): the connection under it is dead, so the caller replaces it (a new channel, a new connection).
    """

    def __init__(
        self,
        stub: xpb_grpc.SnapshotOperationsServiceStub,
        metadata: Sequence[tuple[str, str]],
        open_timeout_s: float,
        probe: Probe | None = None,
        probe_after_s: float = PROBE_AFTER_S,
        on_unreachable: Callable[[], None] | None = None,
    ) -> None:
        self._stub = stub
        self._on_unreachable = on_unreachable
        self._md = tuple(metadata)
        self.open_timeout_s = open_timeout_s
        self._probe = probe
        self.probe_after_s = probe_after_s
        self.unsupported = False
        """True once the sidecar answered UNIMPLEMENTED: it is not asked again."""
        self._open: _Open | None = None
        self._opening = asyncio.Lock()
        self._ids = itertools.count(1)

    async def _stream(self) -> _Open:
        cur = self._open
        if cur is not None and cur.broken is None:
            return cur
        async with self._opening:
            cur = self._open
            if cur is not None and cur.broken is None:
                return cur
            if self.unsupported:
                raise StreamUnsupported()
            call = self._stub.RunOperations(metadata=self._md, wait_for_ready=True)
            # Open once the sidecar's initial metadata came; a call that ends first (trailers only: unauthenticated,
            # unimplemented...) never delivers it, so its status is awaited beside it.
            started = asyncio.ensure_future(call.initial_metadata())
            ended = asyncio.ensure_future(call.code())
            try:
                await asyncio.wait((started, ended), timeout=self.open_timeout_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                started.cancel()
                ended.cancel()
            if not started.done() or started.cancelled() or call.done():
                code = ended.result() if ended.done() and not ended.cancelled() else None
                call.cancel()
                if code is None:
                    raise StreamBroken(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no operation stream from the sidecar within {self.open_timeout_s:g} s",
                    )
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    self.unsupported = True
                    raise StreamUnsupported()
                raise StreamBroken(code, await call.details() or "the sidecar ended its operation stream at once")
            self._open = cur = _Open(call)
            return cur

    async def run(self, command: xpb.OperationCommand, timeout_s: float) -> xpb.OperationResult:
        """Send ``command`` (its ``command_id`` is set here) and return the finished operation's result.

        Raises:
            OperationRefused: the sidecar did not start it.
            StreamBroken: the stream could not be opened or broke before the answer.
            StreamUnsupported: the sidecar has no ``RunOperations``.
            TimeoutError: no answer within ``timeout_s`` seconds.
        """
        cur: _Open | None = None
        for attempt in (1, 2):
            cur = self._open
            if cur is None or cur.broken is not None:
                cur = await self._stream()
            command.command_id = cid = next(self._ids)
            fut: asyncio.Future[xpb.OperationEvent] = asyncio.get_running_loop().create_future()
            cur.pending[cid] = fut  # before the write: its event may be read before the write's completion is
            try:
                async with cur.write_lock:
                    if cur.broken is None:
                        await cur.call.write(command)
                        break
            except (aio.AioRpcError, asyncio.InvalidStateError):
                # The stream had ended (the sidecar restarted since: the read side tells why) and the command was
                # not sent: it is safe to send on a new stream, which waits for the sidecar to be ready.
                await asyncio.wait({cur.reader}, timeout=1.0)
            except BaseException:  # cancelled while sending
                cur.pending.pop(cid, None)
                raise
            cur.pending.pop(cid, None)
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # retrieved: the stream's end, already handled here
            why = cur.broken or StreamBroken(grpc.StatusCode.UNAVAILABLE, "the operation stream ended")
            if self._open is cur:
                self._open = None
                cur.close()
            if attempt == 2:
                raise why
        assert cur is not None
        # One timer rather than asyncio.wait_for (a waiter future and callbacks more, per command).
        loop = asyncio.get_running_loop()
        timer = loop.call_later(timeout_s, _expire, fut, timeout_s)
        watch: list[asyncio.Task] = []
        if self._probe is not None:
            probe, stream = self._probe, cur

            def lost(why: StreamBroken) -> None:
                self._lost(stream, why)

            def start_watch() -> None:
                if not fut.done():
                    watch.append(loop.create_task(_watch(fut, probe, self.open_timeout_s, self.probe_after_s, lost)))

            probe_timer = loop.call_later(self.probe_after_s, start_watch)
        try:
            event = await fut
        finally:
            timer.cancel()
            if self._probe is not None:
                probe_timer.cancel()
            for task in watch:
                task.cancel()
            cur.pending.pop(cid, None)
        if event.WhichOneof("event") == "refused":
            raise OperationRefused(event.refused)
        return event.result

    def _lost(self, cur: _Open, why: StreamBroken) -> None:
        """The sidecar did not answer a probe: every command on the stream ``cur`` fails with ``why`` (they wait on
        the same dead connection), the stream ends, and the owner hears of it (``on_unreachable``). A black-holed
        connection (a node cut off) may stay dead long after the network is back (TCP's retransmissions back off to
        tens of seconds), so the next command must not go over it."""
        if self._open is cur:
            self._open = None
        cur.fail(why)
        if self._on_unreachable is not None:
            self._on_unreachable()

    def close(self) -> None:
        """End the stream (commands waiting on it fail with :class:`StreamBroken`)."""
        if self._open is not None:
            self._open.close()
            self._open = None
