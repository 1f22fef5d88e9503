"""The lease queue on its own (orchestrator/lease_queue.py): admission of waiters, the waiter policy, grants and their
fencing tokens, the holder checks, heartbeats, expiry (with a stall credited) and reclaiming. No group: a ManualClock
and waiters with their futures."""

from __future__ import annotations

import asyncio

import pytest

from llmd_timeslice.orchestrator.clock import ManualClock
from llmd_timeslice.orchestrator.errors import NotHolder, StaleFencingToken
from llmd_timeslice.orchestrator.lease import Waiter
from llmd_timeslice.orchestrator.lease_queue import LeaseQueue


def _queue() -> tuple[LeaseQueue, ManualClock, list[int]]:
    clock, fired = ManualClock(), []
    return LeaseQueue("g", clock, fired.append), clock, fired


def _waiter(job: str, clock: ManualClock) -> Waiter:
    return Waiter(job, clock.now(), asyncio.get_running_loop().create_future())


async def test_a_job_that_holds_or_waits_is_not_admitted_again() -> None:
    q, clock, _ = _queue()
    q.admit("A")
    q.enqueue(_waiter("A", clock))
    with pytest.raises(NotHolder, match="already waiting"):
        q.admit("A")
    q.grant("B", 30.0)
    with pytest.raises(NotHolder, match="already holds group 'g'; yield before acquiring again"):
        q.admit("B")


async def test_waiters_that_gave_up_are_not_waiting_and_the_policy_picks_among_the_rest() -> None:
    q, clock, _ = _queue()
    a, b, c = (_waiter(j, clock) for j in "ABC")
    for w in (a, b, c):
        q.enqueue(w)
    assert q.abandon(a) and a.future.cancelled() and q.waiters == (b, c)
    assert q.next_waiter("fifo", {}) is b
    assert q.next_waiter("priority", {"C": 5}) is c
    q.grant("B", 0.0)
    q.grant("C", 0.0)
    assert q.next_waiter("round_robin", {}) is b, "granted least recently"
    b.future.set_result(None)  # type: ignore[arg-type]
    assert not q.abandon(b), "granted before it gave up"
    assert q.waiters == (c,) and q.queued


async def test_each_grant_takes_the_next_fencing_token_and_forgets_a_reclaimed_lease() -> None:
    q, _, _ = _queue()
    q.expired_jobs["A"] = "its lease expired"
    q.deferred_job = "Z"
    first = q.grant("A", 30.0)
    assert (first.token, q.holder, q.deferred_job, q.expired_jobs) == (1, "A", None, {})
    q.end()
    assert q.holder is None and q.lease is None
    assert q.grant("B", 30.0).token == 2 and q.last_granted == {"A": 1, "B": 2}
    q.take_back()
    assert q.holder is None and q.last_token == 2, "a token taken back is never handed out again"


async def test_holder_calls_are_checked_by_job_and_fencing_token() -> None:
    q, _, _ = _queue()
    q.expired_jobs["A"] = "its lease (token 1) expired"
    with pytest.raises(NotHolder, match=r"does not hold group 'g' \(holder: None\); its lease \(token 1\) expired"):
        q.check_holder("A", 1, heartbeat=False)
    q.grant("B", 30.0)
    q.check_holder("B", None, heartbeat=False)  # never heartbeated: the job id is enough
    with pytest.raises(StaleFencingToken, match="fencing token 5 of job 'B' is stale"):
        q.check_holder("B", 5, heartbeat=True)
    q.renew()
    q.check_holder("B", None, heartbeat=True)
    with pytest.raises(StaleFencingToken, match="must carry its fencing token"):
        q.check_holder("B", None, heartbeat=False)
    q.check_holder("B", q.last_token, heartbeat=False)


async def test_the_first_heartbeat_arms_the_expiry_and_a_late_timer_finds_the_lease_renewed() -> None:
    q, clock, fired = _queue()
    lease = q.grant("A", 10.0)
    assert q.renew(), "armed now: worth saving"
    assert lease.expires_at == clock.now() + 10.0
    clock.advance(6.0)
    assert not q.renew(), "already armed"
    clock.advance(6.0)
    assert fired == [], "renewed: the first timer was disarmed"
    assert q.due(lease.token) is None
    clock.advance(5.0)
    assert fired == [lease.token]
    assert q.due(lease.token) is lease and q.due(lease.token + 1) is None
    why = q.expire(lease)
    assert "no heartbeat for 10 s" in why and q.expired_jobs == {"A": why}


async def test_a_lease_of_ttl_zero_never_expires() -> None:
    q, clock, fired = _queue()
    lease = q.grant("A", 0.0)
    assert not q.renew() and lease.expires_at is None
    clock.advance(1e6)
    assert fired == []


async def test_a_stall_of_the_orchestrator_is_credited_to_the_holder_once() -> None:
    q, clock, fired = _queue()
    lease = q.grant("A", 10.0)
    q.renew()
    clock.advance(2.0)
    clock.stall(5.0)
    clock.advance(3.0)
    assert fired == [lease.token]
    assert q.due(lease.token) is None, "5 s of the 10 the orchestrator could not run: the holder gets them"
    assert lease.stall_credit_s == pytest.approx(5.0) and lease.expires_at == pytest.approx(clock.now() + 5.0)
    clock.advance(5.0)
    assert q.due(lease.token) is lease, "the same stall is credited once"


async def test_an_internal_error_reclaims_the_lease_of_the_holder_and_of_the_asking_job() -> None:
    q, clock, _ = _queue()
    q.grant("A", 10.0)
    q.renew()
    held = (q.holder, q.lease.token if q.lease else None)
    assert q.intact(*held) and not q.intact("A", 99)
    w = _waiter("B", clock)
    q.enqueue(w)
    q.reclaim("internal error in YIELD during phase HELD: Bug()", asked="C")
    assert q.holder is None and q.lease is None and not q.intact(*held)
    assert set(q.expired_jobs) == {"A", "C"} and "lease was reclaimed after an internal error" in q.expired_jobs["A"]
    err = RuntimeError("boom")
    q.fail_waiters(err)
    assert w.future.exception() is err and not q.queued


async def test_a_restored_holder_is_granted_now_and_an_armed_lease_expires_a_ttl_from_now() -> None:
    q, clock, fired = _queue()
    q.restore_holder("A", "A", 7, 10.0, armed=True)
    assert q.holder == "A" and q.lease is not None and q.lease.granted_at == clock.now()
    clock.advance(10.0)
    assert fired == [7]
    q2, clock2, fired2 = _queue()
    q2.restore_holder("A", "A", 7, 10.0, armed=False)
    clock2.advance(100.0)
    assert fired2 == [] and q2.lease is not None and q2.lease.expires_at is None
