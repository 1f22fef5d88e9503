"""The orchestrator's wait for gate acks costs O(acks + waiters), not waiters x acks (issue 29, benchmarks/scale.py).

Each sampler's SERVING publication waits for every gate's ack of its own epoch; with many publications in flight,
waking every waiter on every ack grew as N^2 x M per switch. The hub resolves one future per waiter instead and
counts each look at a waiter (``GateHub.ack_checks``).
"""

from __future__ import annotations

import asyncio

import pytest

from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as gpb
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.gate_hub import GateHub, _GateConn
from llmd_timeslice.orchestrator.server import OrchestratorServer

SERVING = gpb.ENDPOINT_STATE_SERVING


async def _checks_for_concurrent_publications(n: int, gates: list[GateServer], orch: OrchestratorServer) -> int:
    """``n`` publications of one endpoint each, all in flight at once (as a release publishes its samplers);
    returns the ack-waiter looks they cost."""
    hub = orch.hub
    before = hub.ack_checks
    results = await asyncio.gather(*(hub.publish("default", [(f"10.0.{n}.{i}:8000", SERVING, 0)]) for i in range(n)))
    assert all(laggards == [] for _, laggards in results), "every gate acked every epoch"
    for g in gates:
        assert g.subscription.synced_epoch == hub.epoch
    return hub.ack_checks - before


async def test_ack_wait_looks_at_each_waiter_about_once_at_two_sizes():
    inv = Inventory.model_validate({"groups": [{"group_id": "g"}]})
    orch = OrchestratorServer(inv, port=0, token="tok", reconcile_on_start=False)
    await orch.start()
    gates = []
    try:
        for i in range(3):
            g = GateServer(
                GateConfig(
                    ext_proc_port=0, control_port=0, orchestrator=f"127.0.0.1:{orch.port}", token="tok", gate_id=f"gate-{i}"
                )
            )
            await g.start()
            gates.append(g)
        for g in gates:
            await asyncio.wait_for(g.subscription.connected.wait(), 10)
        m = len(gates)
        per_waiter = {}
        for n in (8, 64):
            checks = await _checks_for_concurrent_publications(n, gates, orch)
            # one look when a waiter is resolved, at most one more per ack (the first waiter still pending):
            # <= 2 per (publication, gate); a broadcast to every waiter on each ack would be ~n/2 per one.
            assert checks <= 2 * n * m, f"{checks} ack-waiter looks for {n} publications x {m} gates"
            per_waiter[n] = checks / (n * m)
        assert per_waiter[64] <= per_waiter[8] + 0.5, f"looks per waiter grew with the number in flight: {per_waiter}"
    finally:
        for g in gates:
            await g.stop()
        await orch.stop()


async def test_an_ack_resolves_the_waiters_of_its_epoch_and_earlier_and_a_close_resolves_the_rest_as_not_acked():
    hub = GateHub(ack_timeout_s=5)
    conn = _GateConn("gate-a")
    waits = {e: asyncio.create_task(hub._wait_ack(conn, e)) for e in (1, 2, 3, 4)}
    await asyncio.sleep(0)
    conn.acked_epoch = 3  # what _read does on an ack of epoch 3 (acks may skip epochs)
    hub._wake_acked(conn)
    assert [await waits[e] for e in (1, 2, 3)] == [True, True, True]
    await asyncio.sleep(0.01)
    assert not waits[4].done(), "epoch 4 is not acked yet"
    hub._close(conn, "test")
    assert await asyncio.wait_for(waits[4], 1) is False, "a closed stream ends the wait at once, as not acked"
    assert conn.ack_waiters == []


async def test_a_wait_that_timed_out_leaves_nothing_behind_once_a_later_ack_arrives():
    hub = GateHub(ack_timeout_s=0.05)
    conn = _GateConn("gate-a")
    assert await hub._wait_ack(conn, 1) is False
    conn.acked_epoch = 1
    hub._wake_acked(conn)
    assert conn.ack_waiters == []
    assert await hub._wait_ack(conn, 1) is True, "an epoch already acked needs no wait"


async def test_in_service_publications_made_together_share_an_epoch_and_each_is_applied():
    inv = Inventory.model_validate({"groups": [{"group_id": "g"}]})
    orch = OrchestratorServer(inv, port=0, token="tok", reconcile_on_start=False)
    await orch.start()
    gate = GateServer(GateConfig(ext_proc_port=0, control_port=0, orchestrator=f"127.0.0.1:{orch.port}", token="tok"))
    await gate.start()
    try:
        await asyncio.wait_for(gate.subscription.connected.wait(), 10)
        hub, before = orch.hub, orch.hub.epoch
        addrs = [f"10.1.0.{i}:8000" for i in range(10)]
        results = await asyncio.gather(*(hub.publish_coalesced("default", [(a, SERVING, 2)]) for a in addrs))
        epochs = {epoch for epoch, _ in results}
        assert len(epochs) < len(addrs) and hub.epoch - before == len(epochs), f"epochs used: {sorted(epochs)}"
        assert all(laggards == [] for _, laggards in results)
        pool = gate.pools["default"]
        assert set(pool.serving(min_version=2)) == set(addrs), "every endpoint of the shared epoch is applied"
        # one made while the previous epoch waits for its ack goes out in the next one, not later
        first = asyncio.create_task(hub.publish_coalesced("default", [("10.1.1.1:8000", SERVING, 2)]))
        await asyncio.sleep(0)
        second = await hub.publish_coalesced("default", [("10.1.1.2:8000", SERVING, 2)])
        assert second[0] <= (await first)[0] + 1 and "10.1.1.2:8000" in pool.serving()
    finally:
        await gate.stop()
        await orch.stop()


async def test_coalesced_publication_refuses_a_state_that_takes_an_endpoint_out_of_service():
    hub = GateHub()
    with pytest.raises(ValueError, match=r"10\.0\.0\.1:8000.*use publish"):
        await hub.publish_coalesced("default", [("10.0.0.1:8000", gpb.ENDPOINT_STATE_DRAINING, None)])
    assert hub.epoch == 0, "nothing published"
