"""Yield requests (issue 26, the control side): hold pressure from a gate stream reaches the group's holder through
its lease, per the group's policy; ``RequestYield`` asks on demand with a clear answer for each bad input; the
sync and asyncio clients learn it from their heartbeats; the phase callback honours it at a step boundary; the
counts show in the metrics and in ``llmd-timeslice status``.

The core tests run the group machine on a manual clock (no sleep). The gRPC tests run the real orchestrator
server (switch actions in memory: there is no engine here) and a gate stream over real gRPC that sends what the
gate sends (``GateMessage.hold_pressure``, gate_state.proto); the gate's own sending is tested on the gate side.
"""

from __future__ import annotations

import asyncio
import math
import queue
import re
import threading
import time

import grpc
import pytest
from prometheus_client import REGISTRY
from pydantic import ValidationError
from rich.console import Console

from llmd_timeslice import auth
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2 as gspb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2_grpc as gspb_grpc
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import lease_pb2, lease_pb2_grpc
from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient, LeaseError, TimeSliceOrchestratorClient
from llmd_timeslice.client.integrations import RoleLocks, TimesliceCallback
from llmd_timeslice.domain.group_settings import GroupSpec, SamplerEndpoint
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.clock import ManualClock
from llmd_timeslice.orchestrator.errors import InvalidArgument, UnknownGroup
from llmd_timeslice.orchestrator.groups import Orchestrator
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.orchestrator.yield_requests import HoldPressure
from llmd_timeslice.status import print_status
from tests.orchestrator.group_machine_support import ScriptedActions
from tests.orchestrator.test_orchestrator import RecordingActions

TOKEN = "yield-token"
S1 = SamplerEndpoint("pool-a", "10.0.0.1:8000", "10.0.0.1:9001", "s1")


def _metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _outcome(group: str, band: int, outcome: str) -> float:
    return _metric("llmd_timeslice_orchestrator_yield_requests_total", group=group, band=str(band), outcome=outcome)


def _pressure(oldest: float, held: int = 3, band: int = 10, deadline: float = 5.0, pool: str = "pool-a") -> HoldPressure:
    return HoldPressure(pool, band, "eval", oldest, deadline, held)


class Core:
    """One sampler group ``g`` (pool ``pool-a``) and one without samplers ``t``, on a manual clock."""

    def __init__(self, **settings) -> None:
        self.clock = ManualClock()
        self.orch = Orchestrator(
            [GroupSpec("g", [S1], **settings), GroupSpec("t", **settings)], ScriptedActions(), clock=self.clock
        )

    def g(self, gid: str = "g"):
        return self.orch.groups[gid]


async def test_hold_pressure_asks_the_holder_once_the_oldest_request_reached_the_fraction_of_its_deadline():
    c = Core(min_training_s=0)
    try:
        await c.orch.acquire("A", "g")
        sent = _outcome("g", 10, "sent")
        c.orch.hold_pressure(_pressure(oldest=2.4))  # below 0.5 x 5 s: not yet
        await _drain_pressure(c)
        assert c.orch.lease("A", "g").yield_request is None
        c.orch.hold_pressure(_pressure(oldest=2.5))
        await _drain_pressure(c)
        req = c.orch.lease("A", "g").yield_request
        assert req is not None and (req.band, req.objective, req.pool, req.hold_deadline_s) == (10, "eval", "pool-a", 5.0)
        assert "band 10 (objective eval): oldest held request 2.5 s of a 5 s hold deadline" in req.reason
        assert req.deadline_at == pytest.approx(c.clock.now() + 2.5)
        c.orch.hold_pressure(_pressure(oldest=2.75))  # the gate's next message: the same request, counted once
        await _drain_pressure(c)
        assert _outcome("g", 10, "sent") == sent + 1 and c.g().yield_stats.sent == 1
        c.orch.hold_pressure(_pressure(oldest=0.0, held=0))  # the band holds nothing any more: withdrawn
        await _drain_pressure(c)
        assert c.orch.lease("A", "g").yield_request is None
        c.orch.hold_pressure(_pressure(oldest=3.0, pool="pool-b"))  # another pool's pressure asks nobody here
        await _drain_pressure(c)
        assert c.orch.lease("A", "g").yield_request is None
    finally:
        await c.orch.close()


async def _drain_pressure(c: Core) -> None:
    """Wait until group ``g`` took the pressure just posted (its handler does not suspend)."""
    await c.g().wait_until(lambda g: g._queue.empty(), 5)


async def test_a_yield_counts_honoured_with_its_delay_and_a_deadline_passed_counts_ignored():
    c = Core(min_training_s=0)
    try:
        await c.orch.acquire("A", "g")
        honoured, ignored = _outcome("g", 7, "honoured"), _outcome("g", 7, "ignored")
        delays = _metric("llmd_timeslice_orchestrator_yield_request_seconds_sum", group="g")
        assert (await c.orch.request_yield("g", "eval", band=7, hold_deadline_s=4)).requested
        c.clock.advance(1.5)
        await c.orch.yield_("A", "g")
        assert _outcome("g", 7, "honoured") == honoured + 1 and _outcome("g", 7, "ignored") == ignored
        assert _metric("llmd_timeslice_orchestrator_yield_request_seconds_sum", group="g") == pytest.approx(delays + 1.5)

        await c.g().wait_until(lambda g: g.phase.name == "SERVING", 5)
        await c.orch.acquire("A", "g")
        assert c.orch.lease("A", "g").yield_request is None, "a new grant starts without a request"
        assert (await c.orch.request_yield("g", "eval", band=7, hold_deadline_s=4)).requested
        c.clock.advance(4.0)  # the deadline passes while A keeps the group
        await c.g().wait_until(lambda g: g.yield_stats.ignored == 1, 5)
        assert _outcome("g", 7, "ignored") == ignored + 1
        assert c.g().holder == "A", "cooperative: the holder keeps the group"
        await c.orch.yield_("A", "g")  # late: still counted honoured, the histogram says how late
        assert c.g().yield_stats.honoured == 2 and c.g().yield_stats.ignored == 1
    finally:
        await c.orch.close()


async def test_each_policy_knob_suppresses_a_request_and_the_answer_names_it():
    c = Core(yield_request_bands=[10], job_yield_opt_out=["B"], min_training_s=10)
    try:
        await c.orch.acquire("A", "g")
        a = await c.orch.request_yield("g", band=3, hold_deadline_s=5)
        assert not a.requested and a.holder == "A"
        assert a.detail == "policy: band 3 may not request a yield (yield_request_bands: [10])"
        suppressed = _outcome("g", 10, "suppressed")
        for _ in range(3):  # the gate repeats its pressure every 0.25 s: counted once per grant, band and knob
            c.orch.hold_pressure(_pressure(oldest=4.0))
            await _drain_pressure(c)
        assert _outcome("g", 10, "suppressed") == suppressed + 1
        a = await c.orch.request_yield("g", band=10, hold_deadline_s=5)  # an operator's ask counts each time
        assert not a.requested and "min_training_s (10 s)" in a.detail and "trained 0.0 s" in a.detail
        assert _outcome("g", 10, "suppressed") == suppressed + 2
        c.clock.advance(10.0)
        assert (await c.orch.request_yield("g", band=10, hold_deadline_s=5)).requested
        await c.orch.yield_("A", "g")

        await c.orch.acquire("B", "t")
        c.clock.advance(60.0)
        a = await c.orch.request_yield("t", band=10, hold_deadline_s=5)
        assert not a.requested and a.detail == "policy: job 'B' opted out of yield requests (job_yield_opt_out)"
    finally:
        await c.orch.close()


async def test_without_yield_request_bands_only_a_band_with_a_hold_deadline_may_ask_and_an_empty_list_none():
    c = Core(min_training_s=0)
    try:
        await c.orch.acquire("A", "t")
        a = await c.orch.request_yield("t", band=5, hold_deadline_s=0)
        assert not a.requested and "band 5 declares no hold deadline" in a.detail and "yield_request_bands" in a.detail
        assert (await c.orch.request_yield("t", band=5, hold_deadline_s=2)).requested
    finally:
        await c.orch.close()
    c = Core(min_training_s=0, yield_request_bands=[])
    try:
        await c.orch.acquire("A", "t")
        a = await c.orch.request_yield("t", band=5, hold_deadline_s=2)
        assert not a.requested and a.detail == "policy: band 5 may not request a yield (yield_request_bands: [])"
    finally:
        await c.orch.close()


@pytest.mark.parametrize(
    ("group", "band", "deadline", "error", "match"),
    [
        ("", 1, 1.0, InvalidArgument, "group_id is required"),
        ("nope", 1, 1.0, UnknownGroup, r"unknown group 'nope'; known groups: \['g', 't'\]"),
        ("g", 1, -1.0, InvalidArgument, r"hold_deadline_s must be a finite number of seconds >= 0.*got -1.0"),
        ("g", 1, math.nan, InvalidArgument, r"hold_deadline_s .* got nan"),
        ("g", 2**31, 1.0, InvalidArgument, r"band must be an int32.*got 2147483648"),
    ],
    ids=["empty-group", "unknown-group", "negative-deadline", "nan-deadline", "band-out-of-int32"],
)
async def test_a_malformed_yield_request_is_refused_naming_the_input(group, band, deadline, error, match):
    c = Core()
    try:
        with pytest.raises(error, match=match):
            await c.orch.request_yield(group, band=band, hold_deadline_s=deadline)
    finally:
        await c.orch.close()


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("yield_request_fraction", 0, "yield_request_fraction"),
        ("yield_request_fraction", 1.5, "yield_request_fraction"),
        ("min_training_s", -1, "min_training_s"),
        ("min_training_s", "inf", "min_training_s"),
        ("yield_request_bands", ["eval"], "yield_request_bands"),
    ],
)
def test_policy_settings_out_of_range_are_refused_by_the_model_naming_the_key(key, value, match):
    with pytest.raises(ValidationError, match=match):
        Inventory.model_validate({"groups": [{"group_id": "g", key: value}]})


# ---------------------------------------------------------------------------------------------- over gRPC
INV = Inventory.model_validate(
    {
        "groups": [
            {
                "group_id": "served",
                "lease_ttl_s": 0.6,
                "min_training_s": 0,
                "samplers": [{"pool": "pool-a", "address": "127.0.0.1:8001", "sidecar": "127.0.0.1:9101", "job_id": "s0"}],
            },
            {"group_id": "bands-10", "yield_request_bands": [10], "min_training_s": 0},
            {"group_id": "idle"},
        ]
    }
)


@pytest.fixture(scope="module")
def orch():
    from tests.conftest import LoopThread

    lt = LoopThread()
    srv = OrchestratorServer(INV, port=0, actions=RecordingActions(), token=TOKEN)
    lt.run(srv.start())
    srv.loop_thread = lt
    srv.target = f"127.0.0.1:{srv.port}"
    yield srv
    lt.run(srv.stop())
    lt.close()


class GateStream:
    """A gate's side of ``GateStateService.Connect`` over real gRPC: hello, acks of every state update, and the
    ``hold_pressure`` messages the gate sends while a band with a hold deadline holds requests."""

    def __init__(self, target: str, gate_id: str = "gate-a") -> None:
        self._out: queue.Queue = queue.Queue()
        self._out.put(gspb.GateMessage(hello=gspb.GateHello(gate_id=gate_id, pools=["pool-a"], stale_after_s=3)))
        self._ch = grpc.insecure_channel(target)
        self._call = gspb_grpc.GateStateServiceStub(self._ch).Connect(self._messages(), metadata=auth.call_metadata(TOKEN))
        self.snapshot = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _messages(self):
        while (m := self._out.get()) is not None:
            yield m

    def _read(self) -> None:
        try:
            for cmd in self._call:
                if cmd.HasField("state"):
                    self.snapshot.set()
                    self._out.put(gspb.GateMessage(ack=gspb.EpochAck(epoch=cmd.state.epoch)))
        except grpc.RpcError:
            pass

    def pressure(self, oldest: float, held: int = 2, band: int = 10, deadline: float = 5.0) -> None:
        self._out.put(
            gspb.GateMessage(
                hold_pressure=gspb.HoldPressure(
                    pool="pool-a", band=band, objective="eval", oldest_held_s=oldest, hold_deadline_s=deadline, held=held
                )
            )
        )

    def close(self) -> None:
        self._out.put(None)
        self._call.cancel()
        self._ch.close()


def _request_yield(orch, group: str, band: int = 10, deadline: float = 5.0, reason: str = "test"):
    with grpc.insecure_channel(orch.target) as ch:
        return lease_pb2_grpc.LeaseServiceStub(ch).RequestYield(
            lease_pb2.RequestYieldRequest(group_id=group, reason=reason, band=band, hold_deadline_s=deadline),
            timeout=10,
            metadata=auth.call_metadata(TOKEN),
        )


def test_gate_hold_pressure_reaches_the_holder_on_its_heartbeat_and_its_yield_counts_honoured(orch):
    gate = GateStream(orch.target)
    seen: list = []
    try:
        assert gate.snapshot.wait(10), "the gate stream is up"
        with TimeSliceOrchestratorClient(orch.target, job_id="trainer-0", group_id="served", token=TOKEN) as c:
            c.on_yield_requested(seen.append)
            c.acquire()
            assert c.yield_requested() is None and c.wait_yield_requested(timeout_s=0.3) is None
            gate.pressure(oldest=1.0)  # below half the 5 s deadline: not yet
            gate.pressure(oldest=2.6)
            req = c.wait_yield_requested(timeout_s=10)
            assert req is not None, "the heartbeat answer carried the request"
            assert (req.group_id, req.band, req.objective, req.pool, req.hold_deadline_s) == ("served", 10, "eval", "pool-a", 5.0)
            assert "oldest held request 2.6 s of a 5 s hold deadline" in req.reason
            assert c.yield_requested() == req
            gate.pressure(oldest=2.9)  # repeated: the same request, the callback ran once
            time.sleep(0.5)
            assert len(seen) == 1 and seen[0].reason == req.reason
            status = _status_text(orch)
            assert "yield requests" in status and "band 10 (eval), asked" in status, status
            c.release()
        g = orch.orchestrator.groups["served"]
        assert (g.yield_stats.sent, g.yield_stats.honoured) == (1, 1)
        status = _status_text(orch)
        assert re.search(r"served\s*│\s*1\s*│\s*1\s*│\s*0\s*│\s*0\s*│\s*-\s*│\s*-", status), status  # sent, honoured
    finally:
        gate.close()
    orch.loop_thread.run(orch.orchestrator.groups["served"].wait_until(lambda g: g.phase.name == "SERVING", 10))


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def _status_text(orch) -> str:
    console = Console(record=True, width=300)
    import os

    old = os.environ.get(auth.TOKEN_ENV)
    os.environ[auth.TOKEN_ENV] = TOKEN
    try:
        print_status(orch.target, [], console=console)
    finally:
        if old is None:
            os.environ.pop(auth.TOKEN_ENV, None)
        else:
            os.environ[auth.TOKEN_ENV] = old
    return console.export_text()


def test_request_yield_answers_each_bad_input_clearly(orch):
    with pytest.raises(grpc.RpcError) as err:
        _request_yield(orch, "nope")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "unknown group 'nope'" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        _request_yield(orch, "")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "group_id is required" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        _request_yield(orch, "idle", deadline=-2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "got -2.0" in err.value.details()
    r = _request_yield(orch, "idle")
    assert not r.requested and r.holder == "" and r.detail.startswith("group 'idle' is not held (phase FREE)"), r
    with TimeSliceOrchestratorClient(orch.target, job_id="job-b", group_id="bands-10", token=TOKEN) as c:
        c.acquire()
        r = _request_yield(orch, "bands-10", band=3)
        assert not r.requested and r.holder == "job-b"
        assert r.detail == "policy: band 3 may not request a yield (yield_request_bands: [10])"
        assert _request_yield(orch, "bands-10", band=10).requested
        c.release()
        with pytest.raises(LeaseError, match=r"yield 'bands-10' as 'job-b': FAILED_PRECONDITION: job 'job-b' does not hold"):
            c.release()  # a holder that yields twice


def test_a_job_token_may_not_push_another_job_off_its_group(loop_thread):
    inv = Inventory.model_validate({"groups": [{"group_id": "g", "min_training_s": 0}]})
    srv = OrchestratorServer(inv, port=0, actions=RecordingActions(), token=TOKEN, job_tokens={"job-x": "x-token"})
    loop_thread.run(srv.start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = lease_pb2_grpc.LeaseServiceStub(ch)
            req = lease_pb2.RequestYieldRequest(group_id="g", band=1, hold_deadline_s=1)
            with pytest.raises(grpc.RpcError) as err:
                stub.RequestYield(req, timeout=10, metadata=auth.call_metadata("x-token"))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "job 'job-x'" in err.value.details()
            assert not stub.RequestYield(req, timeout=10, metadata=auth.call_metadata(TOKEN)).requested  # nobody holds
    finally:
        loop_thread.run(srv.stop())


def test_the_asyncio_client_learns_a_yield_request_from_its_heartbeats(orch):
    async def run() -> tuple:
        seen: list = []
        async with AsyncTimeSliceOrchestratorClient(orch.target, job_id="trainer-a", group_id="served", token=TOKEN) as c:
            c.on_yield_requested(seen.append)
            await c.acquire()
            assert await c.wait_yield_requested(timeout_s=0.2) is None
            r = await asyncio.to_thread(_request_yield, orch, "served", 10, 5.0, "operator says so")
            assert r.requested and r.holder == "trainer-a"
            req = await c.wait_yield_requested(timeout_s=10)
            await c.release()
            return req, seen

    req, seen = asyncio.run(run())
    assert req is not None and req.reason == "operator says so" and seen == [req]
    orch.loop_thread.run(orch.orchestrator.groups["served"].wait_until(lambda g: g.phase.name == "SERVING", 10))


def test_the_phase_callback_yields_at_its_next_step_boundary_and_acquires_again(orch):
    g = orch.orchestrator.groups["served"]
    client = TimeSliceOrchestratorClient(orch.target, job_id="rl-job", token=TOKEN)
    locks = RoleLocks("rl-job", orch.target, "served", "served", client=client)  # trainer co-located on the samplers
    cb = TimesliceCallback(locks)
    try:
        honoured, tokens = g.yield_stats.honoured, []
        cb.on_phase_begin("train", "trainer")
        tokens.append(client.fencing_token(group_id="served"))
        assert cb.at_step_boundary("train", "trainer") is False, "no request: the step goes on"
        assert _request_yield(orch, "served", reason="eval band waits").requested
        assert client.wait_yield_requested(timeout_s=10, group_id="served") is not None
        assert locks.yield_requested("trainer").reason == "eval band waits"
        assert cb.at_step_boundary("train", "trainer") is True
        tokens.append(client.fencing_token(group_id="served"))
        assert g.holder == "rl-job" and tokens[1] > tokens[0], "yielded, then granted again (a new fencing token)"
        assert g.yield_stats.honoured == honoured + 1
        assert [r.kind for r in list(g.history)[-2:]] == ["to_samplers", "to_job"], "the samplers served in between"
        assert locks.yield_requested("trainer") is None and cb.at_step_boundary("train", "trainer") is False
        cb.on_phase_end("train", "trainer")
        assert g.holder is None
    finally:
        cb.close()
        client.close()
    orch.loop_thread.run(g.wait_until(lambda g: g.phase.name == "SERVING", 10))


def test_hold_pressure_is_summed_over_gate_replicas_and_withdrawn_when_no_gate_holds_any(orch):
    gates = [GateStream(orch.target, "gate-1"), GateStream(orch.target, "gate-2")]
    g = orch.orchestrator.groups["served"]
    try:
        assert all(gate.snapshot.wait(10) for gate in gates)
        with TimeSliceOrchestratorClient(orch.target, job_id="trainer-s", group_id="served", token=TOKEN) as c:
            c.acquire()
            before = _metric("llmd_timeslice_orchestrator_hold_pressure_messages_total")
            gates[0].pressure(oldest=1.0, held=2)  # below half the deadline: no request yet
            _wait_for(lambda: _metric("llmd_timeslice_orchestrator_hold_pressure_messages_total") > before)
            gates[1].pressure(oldest=2.7, held=1)  # the longest wait of either gate decides, the held add up
            req = c.wait_yield_requested(timeout_s=10)
            assert req is not None and "oldest held request 2.7 s" in req.reason and "3 held in pool pool-a" in req.reason
            gates[1].close()  # a gate whose stream ends stops counting; gate-1 still holds two
            gates[0].pressure(oldest=3.0, held=2)
            time.sleep(0.3)
            assert orch.orchestrator.lease("trainer-s", "served").yield_request is not None
            gates[0].pressure(oldest=0.0, held=0)  # nothing held anywhere: the request is withdrawn
            orch.loop_thread.run(g.wait_until(lambda g: g.lease is not None and g.lease.yield_request is None, 10))
            c.release()
    finally:
        gates[0].close()
    orch.loop_thread.run(g.wait_until(lambda g: g.phase.name == "SERVING", 10))
