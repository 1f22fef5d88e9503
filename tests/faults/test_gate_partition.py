"""Fault: the network between a gate and the orchestrator fails (black hole, then reset) while a trainer
acquires. The orchestrator must not put an engine to sleep while a gate may still steer requests to it by
its last known state: it waits until the lost gate holds by itself (stale_after_s). Found by this suite:
before, the orchestrator went ahead after a 5 s ack timeout while the partitioned gate kept routing to the
engine it was putting to sleep (the hazard case below shows it)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from epp_plugin.gate import subscription
from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
from llmd_timeslice.orchestrator.server import OrchestratorServer
from tests.support.one_sampler import one_sampler
from tests.support.tcp_proxy import TcpProxy

TOKEN = "t"


async def _stack(stale_after_s: float):
    engine, addr, sidecar, inv = await one_sampler(TOKEN)
    orch = OrchestratorServer(inv, port=0, token=TOKEN)
    orch.hub.ack_timeout_s = 0.5  # a gate that has not acked a drain by then is lost (5 s by default)
    await orch.start()
    proxy = await TcpProxy("127.0.0.1", orch.port).start()
    gate = GateServer(
        GateConfig(ext_proc_port=0, control_port=0, orchestrator=proxy.address, token=TOKEN, stale_after_s=stale_after_s)
    )
    await gate.start()
    await asyncio.wait_for(gate.subscription.connected.wait(), 10)
    client = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="g", token=TOKEN)
    return engine, addr, sidecar, orch, proxy, gate, client


async def _teardown(engine, sidecar, orch, proxy, gate, client) -> None:
    await client.close()
    await gate.stop()
    await proxy.stop()
    await orch.stop()
    await sidecar.stop()
    engine.stop()


async def _watch(engine, pool, marks: dict) -> None:
    loop = asyncio.get_running_loop()
    while True:
        if "stale" not in marks and pool.stale:
            marks["stale"] = loop.time()
        if "asleep" not in marks and engine.level != 0:
            marks["asleep"] = loop.time()
            marks["steerable_when_asleep"] = pool.serving()
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("cut", ["blackhole", "reset"])
async def test_partitioned_gate_holds_before_its_engine_sleeps_and_recovers_after_heal(cut, monkeypatch):
    # The gate's reconnect back-off cap, scaled down like its stale_after_s: its tries while the proxy refuses them
    # back off (0.2 s, doubling), and with the 5 s cap the one after the heal came up to ~1.5 s later.
    monkeypatch.setattr(subscription, "RECONNECT_MAX_S", 0.5)
    engine, addr, sidecar, orch, proxy, gate, client = await _stack(stale_after_s=1.0)
    pool = gate.pools["default"]
    marks: dict = {}
    watcher = asyncio.create_task(_watch(engine, pool, marks))
    try:
        assert pool.serving() == (addr,)
        proxy.blackhole() if cut == "blackhole" else proxy.cut()
        await client.acquire(timeout_sec=30)
        assert engine.level == 1
        assert "stale" in marks and marks["stale"] <= marks["asleep"], marks
        assert marks["steerable_when_asleep"] == (), "no request can be steered to the engine once it sleeps"
        held = asyncio.create_task(pool.admit())
        await asyncio.sleep(0.3)
        assert not held.done(), "a stale gate holds new requests"
        proxy.heal()
        await asyncio.wait_for(gate.subscription.connected.wait(), 10)
        await asyncio.sleep(0.3)
        assert not pool.stale and not held.done(), "resynced: the engine is ASLEEP, so still held"
        await client.release()
        adm = await asyncio.wait_for(held, 10)
        assert adm.candidates == (addr,) and engine.level == 0
        pool.finish(adm)
    finally:
        watcher.cancel()
        await _teardown(engine, sidecar, orch, proxy, gate, client)


async def test_hazard_without_the_grace_is_logged_and_shows_what_the_grace_prevents(caplog):
    """stale_after_s 0 (the old behaviour, still selectable): the partitioned gate keeps steering to the
    engine that sleeps; the orchestrator says so in its log."""
    engine, addr, sidecar, orch, proxy, gate, client = await _stack(stale_after_s=0)
    pool = gate.pools["default"]
    try:
        proxy.blackhole()
        with caplog.at_level(logging.ERROR):
            await client.acquire(timeout_sec=30)
        assert engine.level == 1 and pool.serving() == (addr,), "the hazard: a sleeping engine still steerable"
        assert "announced stale_after_s 0" in caplog.text
        await client.release()
    finally:
        await _teardown(engine, sidecar, orch, proxy, gate, client)


async def test_restarted_orchestrator_waits_for_gates_it_knew_before_sleeping_engines(tmp_path):
    """The orchestrator restarts (state file) while the network to a gate is down: it must not put the engine
    to sleep before that gate, which it knows only from its persisted state, holds by itself."""
    from llmd_timeslice.orchestrator.persistence import FileStateStore

    engine, _, sidecar, inv = await one_sampler(TOKEN)
    store = FileStateStore(tmp_path / "state.json")
    orch = OrchestratorServer(inv, port=0, token=TOKEN, state_store=store)
    await orch.start()
    proxy = await TcpProxy("127.0.0.1", orch.port).start()
    gate = GateServer(GateConfig(ext_proc_port=0, control_port=0, orchestrator=proxy.address, token=TOKEN, stale_after_s=1.0))
    await gate.start()
    await asyncio.wait_for(gate.subscription.connected.wait(), 10)
    pool = gate.pools["default"]
    client = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="g", token=TOKEN)
    marks: dict = {}
    watcher = asyncio.create_task(_watch(engine, pool, marks))
    try:
        proxy.blackhole()
        await orch.stop()
        orch = OrchestratorServer(inv, port=orch.port, token=TOKEN, state_store=FileStateStore(tmp_path / "state.json"))
        await orch.start()
        assert orch.hub.gate_ids == [] and gate.subscription.gate_id in orch.hub.known_gates()
        await client.acquire(timeout_sec=30)
        assert marks["stale"] <= marks["asleep"] and marks["steerable_when_asleep"] == (), marks
        await client.release()
    finally:
        watcher.cancel()
        await _teardown(engine, sidecar, orch, proxy, gate, client)


async def test_switch_back_to_serving_does_not_wait_for_a_lost_gate():
    """Only taking an engine out of service must wait for a lost gate to hold by itself. Putting it back in
    service must not: the partitioned gate keeps holding (it never saw the engine wake) until it resyncs, which
    is safe, and every other gate serves at once."""
    from llmd_timeslice.orchestrator.groups import SAMPLERS
    from llmd_timeslice.orchestrator.phases import GroupState

    engine, addr, sidecar, orch, proxy, gate, client = await _stack(stale_after_s=8.0)
    pool = gate.pools["default"]
    g = orch.orchestrator.groups["g"]
    try:
        await client.acquire(timeout_sec=30)  # connected: acked at once
        assert engine.level == 1 and pool.serving() == ()
        proxy.blackhole()
        await client.release()
        for _ in range(1000):
            if g.state is GroupState.IDLE and g.loaded_job == SAMPLERS:
                break
            await asyncio.sleep(0.01)
        assert g.state is GroupState.IDLE and g.loaded_job == SAMPLERS and engine.level == 0
        assert not pool.stale, "the switch back finished before the lost gate's stale_after_s (8 s) ran out"
        assert pool.serving() == (), "the partitioned gate never saw the wake: it still holds"
        proxy.heal()
        await asyncio.wait_for(gate.subscription.connected.wait(), 15)
        for _ in range(500):
            if pool.serving() == (addr,):
                break
            await asyncio.sleep(0.01)
        assert pool.serving() == (addr,), "resynced: serving again"
    finally:
        await _teardown(engine, sidecar, orch, proxy, gate, client)
