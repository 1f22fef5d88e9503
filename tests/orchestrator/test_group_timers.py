"""The group state machine's timers on a manual clock: lease expiry, repair back-off, a stall of the orchestrator,
the engine audit."""

from __future__ import annotations

import asyncio
import time

from llmd_timeslice.domain.switches import EngineReading
from tests.orchestrator.group_machine_support import (
    S1,
    S2,
    Env,
    P,
)


# ------------------------------------------------------------------------------------------------- timers
async def test_lease_expiry_and_repair_back_off_run_on_the_clock_without_sleeping():
    e = Env(repair_first_s=2.0, audit_interval_s=0)
    t0 = time.monotonic()
    try:
        await e.held()
        lease = e.orch.lease("A", "s")
        for _ in range(5):  # heartbeats keep it alive far past the TTL
            await e.orch.heartbeat("A", "s", lease.token)
            e.clock.advance(25)
        await asyncio.sleep(0)
        assert e.g().holder == "A"
        e.acts.fail_samplers = {S1.address, S2.address}  # every wake fails from now on
        e.clock.advance(5.1)  # no heartbeat for 30 s: expired, reclaimed, the samplers are woken (and fail)
        await e.wait(P.OUT_OF_SERVICE)
        assert "expired" in e.g().expired_jobs["A"]
        waits = []
        for _ in range(7):
            due = min(e.clock.pending()) - e.clock.now()
            waits.append(round(due, 3))
            n = len(e.g().history)
            e.clock.advance(due)
            await e.wait(P.OUT_OF_SERVICE, pred=lambda g, n=n: len(g.history) > n)
        assert waits == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
        e.acts.fail_samplers = set()
        e.clock.advance(60)
        await e.wait(P.SERVING)
        assert not e.clock.pending(), "no repair timer left once serving"
    finally:
        await e.close()
    # 242 s of simulated waits: far below them means the clock was simulated (not a speed bound).
    assert time.monotonic() - t0 < 60, "simulated minutes took real minutes"


async def test_a_stall_of_the_orchestrator_does_not_count_against_the_lease_holder():
    """The orchestrator frozen (SIGSTOP) past the holder's TTL: its heartbeats waited in a socket, so the lease is
    kept for the time the orchestrator could not run; a holder that then stays silent expires after that credit."""
    e = Env(audit_interval_s=0)
    try:
        await e.held()
        lease = e.orch.lease("A", "s")
        await e.orch.heartbeat("A", "s", lease.token)  # armed: 30 s TTL from t = 0
        e.clock.advance(10)
        e.clock.stall(25)  # t = 35: the expiry timer fell due during the stall
        await asyncio.sleep(0)
        await e.g().wait_until(lambda g: g.lease is not None and g.lease.stall_credit_s > 0, 5)
        assert e.g().holder == "A", "the lease must not expire for time the orchestrator could not hear the holder"
        await e.orch.heartbeat("A", "s", lease.token)  # the queued heartbeat: kept, credit cleared
        assert e.g().lease.stall_credit_s == 0.0
        e.clock.stall(10)  # a shorter stall inside the TTL changes nothing
        e.clock.advance(20.1)  # 30.1 s since the heartbeat, 10 of them stalled: still held (expires at 40)
        await asyncio.sleep(0)
        assert e.g().holder == "A"
        e.clock.advance(10)  # 40.1 s: expired
        await e.g().wait_until(lambda g: g.holder is None, 5)
        assert "expired" in e.g().expired_jobs["A"]
    finally:
        await e.close()


async def test_engine_audit_runs_every_interval_on_the_clock():
    e = Env(audit_interval_s=10)
    try:
        e.acts.readings = {S1.address: EngineReading(None, False), S2.address: EngineReading(None, False)}
        for i in range(1, 4):
            e.clock.advance(10)
            await e.g().wait_until(lambda g, i=i: sum(c[0] == "read" for c in e.acts.calls) >= i, 5)
        assert e.g().phase is P.SERVING
    finally:
        await e.close()
