"""Gates subscribe to the orchestrator's state stream: snapshot, acks, drain queries, resync."""

from __future__ import annotations

import asyncio

import port_for
import pytest

from epp_plugin.gate import subscription
from epp_plugin.gate.pool_state import EndpointState
from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as gpb
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from tests.support.tcp_proxy import TcpProxy
from tests.support.waits import until as _until

INV = Inventory.model_validate({"groups": [{"group_id": "g"}]})
E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"
SERVING, DRAINING = gpb.ENDPOINT_STATE_SERVING, gpb.ENDPOINT_STATE_DRAINING


async def _orchestrator(port: int = 0) -> OrchestratorServer:
    o = OrchestratorServer(INV, port=port, token="tok", reconcile_on_start=False)
    await o.start()
    return o


async def _gate(orch_port: int, gate_id: str = "gate-a") -> GateServer:
    g = GateServer(
        GateConfig(ext_proc_port=0, control_port=0, orchestrator=f"127.0.0.1:{orch_port}", token="tok", gate_id=gate_id)
    )
    await g.start()
    await asyncio.wait_for(g.subscription.connected.wait(), 10)
    return g


async def test_publish_waits_for_the_gates_ack_and_the_gate_applies_it():
    orch = await _orchestrator()
    await orch.hub.publish("default", [(E1, SERVING, 1), (E2, SERVING, 1)])
    gate = await _gate(orch.port)  # connects after the publish: gets it in the snapshot
    try:
        assert gate.pools["default"].serving() == (E1, E2)
        epoch, laggards = await orch.hub.publish("default", [(E1, DRAINING, None)])
        assert laggards == [] and gate.subscription.synced_epoch == epoch
        assert gate.pools["default"].serving() == (E2,), "after the ack the gate must no longer steer to a DRAINING endpoint"
        assert gate.pools["default"].endpoints[E1].weight_version == 1, "an update without a version keeps the old one"
    finally:
        await gate.stop()
        await orch.stop()


async def test_drain_query_answers_only_when_requests_admitted_before_draining_end():
    orch = await _orchestrator()
    await orch.hub.publish("default", [(E1, SERVING, 0)])
    gate = await _gate(orch.port)
    try:
        adm = await gate.pools["default"].admit()
        await orch.hub.publish("default", [(E1, DRAINING, None)])
        drained, left = await orch.hub.wait_drained("default", [E1], 0.2)
        assert not drained and left == {E1: 1}
        waiter = asyncio.create_task(orch.hub.wait_drained("default", [E1], 5))
        await asyncio.sleep(0.05)
        gate.pools["default"].finish(adm)
        drained, left = await asyncio.wait_for(waiter, 5)
        assert drained and left == {E1: 0}
    finally:
        await gate.stop()
        await orch.stop()


async def test_gate_keeps_last_known_state_while_orchestrator_is_down_and_resyncs_on_reconnect():
    port = port_for.select_random()
    orch = await _orchestrator(port)
    await orch.hub.publish("default", [(E1, SERVING, 0)])
    gate = await _gate(port)
    try:
        await orch.stop()
        await _until(lambda: not gate.subscription.connected.is_set())
        assert gate.pools["default"].serving() == (E1,), "last known state is kept while disconnected"
        assert (await gate.pools["default"].admit()).candidates == (E1,)
        orch = await _orchestrator(port)  # restarted orchestrator: new state (E2 only)
        await orch.hub.publish("default", [(E2, SERVING, 0)])
        resyncs = gate.subscription.resyncs
        await _until(lambda: gate.subscription.resyncs > resyncs and gate.pools["default"].serving() == (E2,), 15)
        assert E1 in gate.pools["default"].endpoints and gate.pools["default"].endpoints[E1].state is EndpointState.DRAINING, (
            "an endpoint dropped from the snapshot with a request in flight is kept DRAINING until it ends"
        )
    finally:
        await gate.stop()
        await orch.stop()


async def test_every_retry_of_a_lost_state_stream_dials_the_orchestrator_anew(monkeypatch, caplog):
    """A session's channel does not share its connection with the sessions before it: with gRPC's shared subchannel,
    a retry while that subchannel backed off (1 s, growing) failed at once without dialling, so the first session after
    a healed partition came up to that back-off late, on top of the gate's own waits (``RECONNECT_FIRST_S`` doubling
    up to ``RECONNECT_MAX_S``). Here: each failed session is one refused connection at the proxy."""
    monkeypatch.setattr(subscription, "RECONNECT_FIRST_S", 0.05)  # the gate's waits: 0.05, 0.1, 0.1, ... s
    monkeypatch.setattr(subscription, "RECONNECT_MAX_S", 0.1)
    orch = await _orchestrator()
    proxy = await TcpProxy("127.0.0.1", orch.port).start()
    gate = await _gate(proxy.port)  # through the proxy: 127.0.0.1:<proxy port>
    try:
        caplog.set_level("WARNING", logger=subscription.__name__)
        proxy.cut()

        def lost() -> int:  # sessions ended since the cut: the synced one the cut reset, then the failed retries
            return sum("state stream to" in r.getMessage() and " lost: " in r.getMessage() for r in caplog.records)

        await _until(lambda: lost() >= 6, what="six lost sessions")
        assert proxy.refused >= lost() - 2, f"{lost()} sessions lost, {proxy.refused} connections dialled"
        proxy.heal()
        await _until(lambda: gate.subscription.connected.is_set(), what="the gate back on the state stream")
    finally:
        await gate.stop()
        await proxy.stop()
        await orch.stop()


async def test_restarted_gate_with_the_same_id_replaces_its_stream_and_gets_the_snapshot():
    orch = await _orchestrator()
    await orch.hub.publish("default", [(E1, SERVING, 3)])
    g1 = await _gate(orch.port, "gate-x")
    await g1.stop()
    g2 = await _gate(orch.port, "gate-x")
    try:
        assert g2.pools["default"].serving(3) == (E1,)
        await _until(lambda: orch.hub.gate_ids == ["gate-x"])
        _, laggards = await orch.hub.publish("default", [(E1, DRAINING, None)])
        assert laggards == []
    finally:
        await g2.stop()
        await orch.stop()


@pytest.mark.parametrize("token", [None, "wrong"])
async def test_gate_with_a_wrong_token_is_refused_and_never_synced(token):
    orch = await _orchestrator()
    g = GateServer(GateConfig(ext_proc_port=0, control_port=0, orchestrator=f"127.0.0.1:{orch.port}", token=token))
    await g.start()
    try:
        await asyncio.sleep(0.5)
        assert not g.subscription.connected.is_set() and orch.hub.gate_ids == []
    finally:
        await g.stop()
        await orch.stop()


async def test_with_accept_new_pools_off_a_pool_the_orchestrator_names_is_not_created():
    orch = await _orchestrator()
    await orch.hub.publish("other", [(E1, SERVING, 1)])
    g = GateServer(
        GateConfig(
            ext_proc_port=0,
            control_port=0,
            orchestrator=f"127.0.0.1:{orch.port}",
            token="tok",
            gate_id="gate-a",
            accept_new_pools=False,
        )
    )
    await g.start()
    try:
        await asyncio.wait_for(g.subscription.connected.wait(), 10)
        epoch, laggards = await orch.hub.publish("other", [(E2, SERVING, 1)])
        assert laggards == [] and g.subscription.synced_epoch == epoch, "an ignored pool's update is still acked"
        assert "other" not in g.pools, f"the gate created pool 'other' (its pools: {sorted(g.pools)})"
    finally:
        await g.stop()
        await orch.stop()
