"""Stalls: a component frozen for longer than each of its peers' deadlines, then let go (issue 24).

Here the gate's own event loop is blocked (a stall inside the process: what a CPU-throttled container or a long
pause looks like from inside) while the orchestrator goes on without it; the gate runs in a thread of its own so
the orchestrator (in the test's loop) keeps running. Process freezes (SIGSTOP/SIGCONT of the gate and of the
orchestrator processes, behind a real Envoy, under load) are in tests/faults/test_freeze_processes.py.

What must hold (docs/gate.md, "When the gate's view counts as current"): the first request after the stall is
held, not steered by the view from before it (the orchestrator put an engine to sleep meanwhile); the backlog of
commands queued during the stall is not taken as current; the gate resubscribes by itself, even though its stream
stayed up, and steers again from a fresh snapshot within a second.
"""

from __future__ import annotations

import asyncio
import threading
import time

from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as gpb
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from tests.conftest import LoopThread
from tests.support.waits import until

INV = Inventory.model_validate({"groups": [{"group_id": "g"}]})
E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"
SERVING, DRAINING, ASLEEP = gpb.ENDPOINT_STATE_SERVING, gpb.ENDPOINT_STATE_DRAINING, gpb.ENDPOINT_STATE_ASLEEP
STALE_AFTER_S = 1.0


async def _gate_in_thread(lt: LoopThread, orch_port: int) -> GateServer:
    cfg = GateConfig(
        ext_proc_port=0, control_port=0, orchestrator=f"127.0.0.1:{orch_port}", token="tok", stale_after_s=STALE_AFTER_S
    )

    async def start() -> GateServer:
        g = GateServer(cfg)
        await g.start()
        await asyncio.wait_for(g.subscription.connected.wait(), 10)
        return g

    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(start(), lt.loop))


def _in_gate(lt: LoopThread, fn):
    """``fn()`` run in the gate's loop (as its data path would), once that loop runs again."""
    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_call(fn), lt.loop))


async def _call(fn):
    return fn()


async def test_gate_loop_stalled_past_stale_after_holds_first_then_resubscribes_without_a_reconnect_of_the_peer():
    orch = OrchestratorServer(INV, port=0, token="tok", reconcile_on_start=False)
    orch.hub.ack_timeout_s = 0.5
    await orch.start()
    await orch.hub.publish("default", [(E1, SERVING, 1), (E2, SERVING, 1)])
    lt = LoopThread()
    gate = await _gate_in_thread(lt, orch.port)
    pool = gate.pools["default"]
    try:
        assert await _in_gate(lt, pool.serving) == (E1, E2)
        resubscribes, resyncs = gate.subscription.resubscribes, gate.subscription.resyncs
        # Block the gate's loop until the test lets it go. Meanwhile the orchestrator drains E1 (no ack: the gate is
        # stuck; it waits until the gate has been silent for stale_after_s) and puts it to sleep.
        stall = threading.Event()
        lt.loop.call_soon_threadsafe(stall.wait, 30)
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        _, laggards = await orch.hub.publish("default", [(E1, DRAINING, None)])
        assert laggards == [gate.subscription.gate_id]
        assert time.monotonic() - t0 >= STALE_AFTER_S * 0.9, "the orchestrator waits for the lost gate to hold by itself"
        await orch.hub.publish("default", [(E1, ASLEEP, None)])
        # Let go once the data path's next call waits behind the stall (longer than stale_after_s: the drain waited
        # that long): the first thing the data path does must not steer to E1 (asleep by now).
        first_call = _in_gate(lt, pool.serving)
        stall.set()
        first = await asyncio.wait_for(first_call, 10)
        assert E1 not in first, f"the first request after the stall was steered by the old view: {first}"
        # It comes back by itself, from a fresh snapshot: E1 asleep, E2 serving.
        t_resume = time.monotonic()
        await until(lambda: gate.subscription.resyncs > resyncs and not gate.subscription.stale, 10, what="the resync")
        assert await _in_gate(lt, pool.serving) == (E2,)
        assert gate.subscription.resubscribes > resubscribes, "the gate dropped its own stream to get a current view"
        print(f"steering again {time.monotonic() - t_resume:.2f} s after the loop ran again")
    finally:
        stall.set()
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(gate.stop(), lt.loop))
        lt.close()
        await orch.stop()


async def test_gate_loop_stalled_on_an_idle_stream_comes_back_and_releases_what_it_held():
    """The reported outage: a stall on a stream that stays connected (only keepalives) left the gate holding every
    request for good. Now it resubscribes, and a request held during the stale time is released."""
    orch = OrchestratorServer(INV, port=0, token="tok", reconcile_on_start=False)
    await orch.start()
    await orch.hub.publish("default", [(E1, SERVING, 1)])
    lt = LoopThread()
    gate = await _gate_in_thread(lt, orch.port)
    pool = gate.pools["default"]
    try:
        lt.loop.call_soon_threadsafe(time.sleep, 1.5 * STALE_AFTER_S)
        await asyncio.sleep(0.2)
        held = asyncio.run_coroutine_threadsafe(pool.admit(), lt.loop)  # runs once the loop is let go
        adm = await asyncio.wait_for(asyncio.wrap_future(held), 10)
        assert adm.candidates == (E1,)
        assert not gate.subscription.stale
        assert orch.hub.gate_ids == [gate.subscription.gate_id]
    finally:
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(gate.stop(), lt.loop))
        lt.close()
        await orch.stop()


async def test_a_3000_request_hold_built_after_a_stall_is_released():
    """After the stall the gate must not stay stale: a hold of 3,000 requests built while the pool sleeps (a trainer
    holds it) is released when the engines serve again (before: all 3,000 ended in hold_expired)."""
    orch = OrchestratorServer(INV, port=0, token="tok", reconcile_on_start=False)
    await orch.start()
    await orch.hub.publish("default", [(E1, SERVING, 1), (E2, SERVING, 1)])
    lt = LoopThread()
    gate = await _gate_in_thread(lt, orch.port)
    pool = gate.pools["default"]
    try:
        lt.loop.call_soon_threadsafe(time.sleep, 1.5 * STALE_AFTER_S)
        await asyncio.sleep(0.2)
        await orch.hub.publish("default", [(E1, DRAINING, None), (E2, DRAINING, None)])
        await orch.hub.publish("default", [(E1, ASLEEP, None), (E2, ASLEEP, None)])
        await until(lambda: not gate.subscription.stale and pool.endpoints[E1].state.value == "ASLEEP", 10, what="resync")

        async def hold_many() -> list:
            return await asyncio.gather(*(pool.admit() for _ in range(3000)))

        held = asyncio.run_coroutine_threadsafe(hold_many(), lt.loop)
        await until(lambda: pool.held == 3000, 20, what="3,000 held")
        await orch.hub.publish("default", [(E1, SERVING, 2), (E2, SERVING, 2)])
        admitted = await asyncio.wait_for(asyncio.wrap_future(held), 30)
        assert len(admitted) == 3000 and {a.candidates for a in admitted} == {(E1, E2)}
    finally:
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(gate.stop(), lt.loop))
        lt.close()
        await orch.stop()


TRAINER = """
import sys, time
from llmd_timeslice.client import LeaseLost, TimeSliceOrchestratorClient
c = TimeSliceOrchestratorClient(sys.argv[1], job_id="trainer", group_id="g", token="tok")
c.acquire(timeout_sec=30)
print("held", flush=True)
while not (why := c.lease_lost()):
    time.sleep(0.01)
print(f"lost {time.monotonic():.3f} {why}", flush=True)
try:
    c.release()
    print("released", flush=True)
except LeaseLost as exc:
    print(f"LeaseLost {exc}", flush=True)
"""


async def test_a_trainer_paused_past_its_lease_learns_it_lost_the_group_at_once_on_resume():
    """SIGSTOP of the trainer's own process past its TTL: the orchestrator reclaims the group; on SIGCONT the
    client says so before any call (``lease_lost()``), and the yield raises LeaseLost naming the expiry."""
    import signal
    import subprocess
    import sys

    inv = Inventory.model_validate({"groups": [{"group_id": "g", "lease_ttl_s": 1.0}]})
    orch = OrchestratorServer(inv, port=0, token="tok", reconcile_on_start=False)
    await orch.start()
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER, f"127.0.0.1:{orch.port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.strip() == "held", line  # acquire() returned once a heartbeat armed the 1 s lease
        proc.send_signal(signal.SIGSTOP)
        await until(lambda: orch.orchestrator.groups["g"].holder is None, 10, what="the orchestrator reclaims the group")
        await asyncio.sleep(0.5)
        resumed = time.monotonic()
        proc.send_signal(signal.SIGCONT)
        out, _ = await asyncio.wait_for(asyncio.to_thread(proc.communicate), 30)
        lost = next(x for x in out.splitlines() if x.startswith("lost "))
        assert float(lost.split()[1]) - resumed < 2.0, f"learnt {float(lost.split()[1]) - resumed:.2f} s after SIGCONT"
        assert "LeaseLost" in out and "expired" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await orch.stop()
