"""Fencing terms on the wire, in one process over real gRPC: a sidecar and a gate refuse a command whose
``leader_term`` is below the highest they have seen, naming both terms; a missing term (0, an orchestrator without
leader election) is accepted only while no term has been seen (wire compatibility); the refusal reaches the
orchestrator's hooks (which make a deposed leader step down: tests/faults/test_orchestrator_failover.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as spb
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as spb_grpc
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.actions import FENCED_TERM_KEY
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from tests.support.fake_engines import FakeVllm
from tests.support.waits import until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def sidecar():
    engine = FakeVllm().start()
    srv = SidecarServer({"s": VllmBackend(engine.url, idle_timeout_s=1)}, port=0)
    await srv.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}")
    yield srv, spb_grpc.SnapshotAgentServiceStub(ch)
    await ch.close()
    await srv.stop()
    engine.stop()


@pytest.mark.parametrize("late_term", [0, 1], ids=["missing term", "lower term"])
async def test_a_sidecar_refuses_a_term_below_the_highest_it_has_seen(sidecar, late_term):
    srv, stub = sidecar
    await stub.Restore(spb.RestoreRequest(job_id="s"))  # no term, none seen yet: accepted (an unfenced orchestrator)
    await stub.Restore(spb.RestoreRequest(job_id="s", leader_term=2))
    assert srv.servicer.highest_term == 2
    ops = len(srv.servicer.operations)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Snapshot(spb.SnapshotRequest(job_id="s", leader_term=late_term))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == (
        f"fenced: snapshot of job 's' from orchestrator leader term {late_term} refused, this sidecar has seen term 2 "
        "(a newer leader took over)"
    )
    assert (FENCED_TERM_KEY, "2") in tuple(err.value.trailing_metadata())
    assert len(srv.servicer.operations) == ops, "no operation was started"
    await stub.Snapshot(spb.SnapshotRequest(job_id="s", leader_term=3))  # a newer leader is obeyed
    assert srv.servicer.highest_term == 3


INV = Inventory.model_validate({"groups": [{"group_id": "g", "samplers": []}]})


async def test_a_gate_refuses_a_lower_term_answers_fenced_and_applies_nothing():
    """The gate follows the orchestrator at one address; a leader of term 2 there, then (the Service sent the gate's
    next connection to a deposed one) a leader of term 1 at the same address."""
    new = OrchestratorServer(INV, port=0, reconcile_on_start=False)
    await new.start()
    new.hub.term = 2
    gate = GateServer(GateConfig(ext_proc_port=0, control_port=0, orchestrator=f"127.0.0.1:{new.port}", stale_after_s=2))
    await gate.start()
    old = None
    try:
        await asyncio.wait_for(gate.subscription.connected.wait(), 10)
        await until(lambda: gate.subscription.highest_term == 2, what="term 2 seen")
        port = new.port
        await new.stop()
        old = OrchestratorServer(INV, port=port, reconcile_on_start=False)
        old.hub.term = 1
        old.hub.state["default"] = {"10.9.9.9:8000": (1, 0)}  # its stale view: an endpoint the gate must not learn
        refusals: list[tuple[str, int, int]] = []
        old.hub.on_fenced = lambda gate_id, refused, highest: refusals.append((gate_id, refused, highest))
        await old.start()
        await until(lambda: refusals, what="the gate's FencedRefusal")
        assert refusals[0] == (gate.gate_id, 1, 2)
        assert gate.subscription.highest_term == 2
        assert "10.9.9.9:8000" not in gate.pools["default"].endpoints, "nothing of term 1 applied"
    finally:
        await gate.stop()
        if old is not None:
            await old.stop()


async def test_an_unfenced_orchestrator_works_with_a_gate_that_never_saw_a_term():
    srv = OrchestratorServer(INV, port=0, reconcile_on_start=False)
    await srv.start()
    gate = GateServer(GateConfig(ext_proc_port=0, control_port=0, orchestrator=f"127.0.0.1:{srv.port}"))
    await gate.start()
    try:
        await asyncio.wait_for(gate.subscription.connected.wait(), 10)
        epoch, laggards = await srv.hub.publish("default", [])
        assert laggards == []
        await until(lambda: gate.subscription.synced_epoch == epoch, what="the update applied")
        assert gate.subscription.highest_term == 0
    finally:
        await gate.stop()
        await srv.stop()
