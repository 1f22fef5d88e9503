"""The orchestrator's side of the gate state stream for tests and benchmarks that start a gate without an
orchestrator: the orchestrator's own :class:`~llmd_timeslice.orchestrator.gate_hub.GateHub`, served over real gRPC
(``GateStateService``) on a loopback port from an event loop in its own thread, with a blocking face.

The state stream is the one writer of a gate's endpoint states (docs/decisions/one-writer-of-gate-state.md): a gate
started with ``--orchestrator 127.0.0.1:<port>`` of this publisher gets its states and drain queries from here,
exactly as from a running orchestrator.
"""

from __future__ import annotations

import asyncio
import threading

import grpc

from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2_grpc as pb_grpc
from llmd_timeslice.orchestrator.gate_hub import GateHub


class StatePublisher:
    """A real ``GateStateService`` (the orchestrator's hub) on ``127.0.0.1:port``.

    ``publish(pool, {address: wire state})`` returns once every connected gate acked the epoch;
    ``wait_drained(pool, [addresses], timeout_s)`` is the gates' drain barrier (True when all report drained).
    """

    def __init__(self, ack_timeout_s: float = 5.0) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="state-publisher", daemon=True)
        self._thread.start()
        self.hub = GateHub(ack_timeout_s=ack_timeout_s)
        self._server: grpc.aio.Server | None = None
        self.port = self._run(self._start())

    def _run(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self) -> int:
        self._server = grpc.aio.server()
        pb_grpc.add_GateStateServiceServicer_to_server(self.hub, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return port

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_gates(self, n: int = 1, timeout_s: float = 60.0) -> None:
        """Return once ``n`` gates are subscribed (AssertionError after ``timeout_s``)."""

        async def wait() -> None:
            deadline = self.loop.time() + timeout_s
            while len(self.hub.gate_ids) < n:
                if self.loop.time() >= deadline:
                    raise AssertionError(f"{n} gate(s) did not subscribe in {timeout_s:g} s (have {self.hub.gate_ids})")
                await asyncio.sleep(0.02)

        self._run(wait(), timeout_s + 5)

    def publish(self, pool: str, states: dict[str, int], weight_version: int | None = None) -> int:
        """Set the listed endpoints of ``pool`` (others keep theirs); returns the epoch, once every gate acked it."""
        epoch, laggards = self._run(self.hub.publish(pool, [(a, s, weight_version) for a, s in states.items()]))
        if laggards:
            raise AssertionError(f"gates {laggards} did not ack epoch {epoch}")
        return epoch

    def wait_drained(self, pool: str, addresses: list[str], timeout_s: float) -> tuple[bool, dict[str, int]]:
        """The gates' drain barrier on ``addresses``: ``(drained, in flight per address)``."""
        return self._run(self.hub.wait_drained(pool, addresses, timeout_s), timeout_s + 30)

    def stop(self) -> None:
        async def stop() -> None:
            self.hub.close_all()
            if self._server is not None:
                await self._server.stop(1)

        self._run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
