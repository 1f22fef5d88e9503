"""Unit tests of the gate core (no I/O)."""

from __future__ import annotations

import asyncio

import pytest

from epp_plugin.gate.pool_state import EndpointState, HoldExpired, PoolState, QueueFull

S, D, A = EndpointState.SERVING, EndpointState.DRAINING, EndpointState.ASLEEP


async def test_admits_at_once_with_serving_endpoints_as_candidates():
    pool = PoolState("p")
    pool.set_states([("10.0.0.1:8000", S, 1), ("10.0.0.2:8000", A, 1)])
    adm = await pool.admit()
    assert adm.candidates == ("10.0.0.1:8000",)
    assert adm.hold_s == 0


async def test_request_to_sleeping_pool_is_held_then_released_in_fifo_order():
    pool = PoolState("p", release_rate_per_s=0)
    pool.set_states([("e1:1", A, 0)])
    order = []

    async def one(i):
        adm = await pool.admit()
        order.append(i)
        return adm

    tasks = [asyncio.create_task(one(i)) for i in range(20)]
    await asyncio.sleep(0.05)
    assert pool.held == 20 and not order
    pool.set_states([("e1:1", S, 0)])
    adms = await asyncio.gather(*tasks)
    assert order == list(range(20)), f"release order {order} is not FIFO"
    assert all(a.candidates == ("e1:1",) for a in adms)
    assert pool.held == 0


async def test_cancelled_held_request_leaves_the_queue_at_once():
    pool = PoolState("p")
    pool.set_states([("e1:1", A, 0)])
    t = asyncio.create_task(pool.admit())
    await asyncio.sleep(0.01)
    assert pool.held == 1
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert pool.held == 0


async def test_queue_full_and_hold_expiry_raise_typed_refusals():
    pool = PoolState("p", max_held=1, max_hold_s=0.05)
    pool.set_states([("e1:1", A, 0)])
    t = asyncio.create_task(pool.admit())
    await asyncio.sleep(0.01)
    with pytest.raises(QueueFull) as full:
        await pool.admit()
    assert full.value.http_status == 429
    with pytest.raises(HoldExpired) as expired:
        await t
    assert expired.value.http_status == 503 and expired.value.retry_after_s
    assert pool.held == 0


async def test_drain_barrier_waits_for_requests_admitted_before_draining():
    pool = PoolState("p")
    pool.set_states([("e1:1", S, 0), ("e2:1", S, 0)])
    old = await pool.admit()  # may reach either endpoint
    pool.set_states([("e1:1", D, 0)])
    new = await pool.admit()
    assert new.candidates == ("e2:1",), "a request admitted after DRAINING must not be steered to it"
    drained, in_flight = await pool.wait_drained(["e1:1"], 0.05)
    assert not drained and in_flight == {"e1:1": 1}
    waiter = asyncio.create_task(pool.wait_drained(["e1:1"], 5))
    await asyncio.sleep(0.01)
    pool.on_served(old, "e2:1")  # the response path says it went to e2: e1 is free
    drained, in_flight = await asyncio.wait_for(waiter, 1)
    assert drained and in_flight == {"e1:1": 0}
    pool.finish(old)
    pool.finish(new)
    assert pool.in_flight(["e1:1", "e2:1"]) == {"e1:1": 0, "e2:1": 0}


async def test_min_weight_version_holds_until_an_endpoint_at_that_version_serves():
    pool = PoolState("p", release_rate_per_s=0)
    pool.set_states([("e1:1", S, 3)])
    t = asyncio.create_task(pool.admit(min_version=4))
    await asyncio.sleep(0.01)
    assert not t.done() and pool.held == 1
    pool.set_states([("e2:1", S, 4)])
    adm = await asyncio.wait_for(t, 1)
    assert adm.candidates == ("e2:1",)


async def test_close_refuses_held_requests():
    pool = PoolState("p")
    pool.set_states([("e1:1", A, 0)])
    t = asyncio.create_task(pool.admit())
    await asyncio.sleep(0.01)
    pool.close()
    with pytest.raises(Exception) as err:
        await t
    assert getattr(err.value, "reason", "") == "gate_shutting_down"


async def test_drain_deadline_cuts_requests_whose_response_has_not_started_and_lets_responding_ones_finish():
    pool = PoolState("p")
    pool.set_states([("e1:1", S, 0), ("e2:1", S, 0)])
    answers: dict[str, object] = {}

    def edge(adm, name):  # an edge that answers the cut request and then sees its stream end (as Envoy closes it)
        def on_cut(err):
            answers[name] = err
            asyncio.get_running_loop().call_soon(pool.finish, adm)

        adm.request_id, adm.on_cut = name, on_cut
        return adm

    travelling = edge(await pool.admit(), "travelling")  # in the EPP / connecting: no response yet
    responding = edge(await pool.admit(), "responding")
    pool.on_served(responding, "e1:1")  # its response started on e1
    elsewhere = edge(await pool.admit(), "elsewhere")
    pool.on_served(elsewhere, "e2:1")  # served by the endpoint that keeps serving
    no_edge = await pool.admit()  # an edge that cannot answer after admission (no on_cut)
    pool.set_states([("e1:1", D, 0)])

    outcome = await pool.drain(["e1:1"], timeout_s=0.05, cut_grace_s=1.0)

    assert [a.request_id for a in outcome.cut] == ["travelling"]
    err = answers.pop("travelling")
    assert (err.http_status, err.reason, err.retry_after_s) == (503, "drain_deadline", 1) and "e1:1" in err.message
    assert answers == {}, "only the request that could still reach the draining endpoint unanswered is cut"
    assert not outcome.drained and outcome.in_flight == {"e1:1": 2}, "responding and edge-less requests still count"
    assert travelling.finished and not responding.finished
    for adm in (responding, elsewhere, no_edge):
        pool.finish(adm)
    assert (await pool.drain(["e1:1"], timeout_s=0.05)).drained


async def test_drain_that_holds_in_time_cuts_nothing():
    pool = PoolState("p")
    pool.set_states([("e1:1", S, 0)])
    adm = await pool.admit()
    adm.on_cut = lambda err: pytest.fail(f"cut although the barrier held: {err}")
    pool.set_states([("e1:1", D, 0)])
    asyncio.get_running_loop().call_later(0.02, pool.finish, adm)
    outcome = await pool.drain(["e1:1"], timeout_s=2)
    assert outcome.drained and outcome.cut == []


async def test_release_keeps_to_its_rate_bursts_on_a_schedule():
    """200 held, 1,000/s in bursts of 50: bursts at 0, 50, 100 and 150 ms, never faster (the time spent releasing
    counts against the pause, so the rate is the configured one, not lower)."""
    pool = PoolState("p", release_rate_per_s=1000, release_burst=50)
    pool.set_states([("e1:1", A, 0)])
    loop = asyncio.get_running_loop()
    tasks = [asyncio.create_task(pool.admit()) for _ in range(200)]
    await asyncio.sleep(0.02)
    t0 = loop.time()
    pool.set_states([("e1:1", S, 0)])
    done_at = []
    for t in asyncio.as_completed(tasks):
        await t
        done_at.append(loop.time() - t0)
    assert done_at[49] < 0.05 <= done_at[50], "the second burst waits for its slot"
    assert done_at[-1] >= 0.15, "four bursts of 50 at 1,000/s take at least 150 ms"


async def test_a_lost_completion_costs_one_drain_not_every_later_one():
    """An access-log entry Envoy dropped (the gate was stalled): the admission stays counted against its endpoint.
    Once that endpoint is verified asleep, nothing counted against it can be at the engine: the count ends, so the
    next drain of it is immediate instead of waiting to its deadline again (until the age rule, 76 min)."""
    pool = PoolState("p")
    pool.set_states([("e1:1", S, 0), ("e2:1", S, 0)])
    lost = await pool.admit()
    pool.on_served(lost, "e1:1")  # its completion never comes
    hinted = await pool.admit()  # a subset hint of both endpoints, not yet served
    assert hinted.candidates == ("e1:1", "e2:1")
    pool.set_states([("e1:1", D, None)])
    drained, left = await pool.wait_drained(["e1:1"], 0.05)
    assert not drained and left == {"e1:1": 2}, "the first drain meets the lost completion"
    pool.set_states([("e1:1", A, None)])  # the orchestrator verified it asleep
    assert pool.in_flight(["e1:1"]) == {"e1:1": 0} and lost.finished
    assert not hinted.finished and hinted.candidates == ("e2:1",), "the other candidate keeps its count"
    assert pool.forgotten_at_sleep_total == 1
    pool.set_states([("e1:1", S, None)])
    pool.set_states([("e1:1", D, None)])
    assert await pool.wait_drained(["e1:1"], 5) == (True, {"e1:1": 0}), "later drains are immediate"
    pool.finish(lost)  # a late access-log entry: idempotent
    pool.finish(hinted)
    assert pool.in_flight(["e1:1", "e2:1"]) == {"e1:1": 0, "e2:1": 0}


async def test_serving_answer_follows_every_change_after_being_asked():
    """serving() keeps its answer per min_version between changes: each kind of change must show at once."""
    pool = PoolState("p")
    e1, e2 = "10.0.0.1:8000", "10.0.0.2:8000"
    pool.set_states([(e1, S, 1), (e2, S, 2)])
    assert pool.serving() == (e1, e2) and pool.serving(2) == (e2,)
    pool.set_states([(e1, S, 3)])  # a new weight version
    assert pool.serving(2) == (e1, e2), "a version change must show in serving(min_version)"
    pool.set_states([(e2, A, None)])
    assert pool.serving() == (e1,), "a state change must show"
    pool.mark_failed(e1, 0.05)
    assert pool.serving() == (), "a failed mark must show"
    await asyncio.sleep(0.1)
    assert pool.serving() == (e1,), "the failed mark's expiry must show"
    pool.set_states([(e2, S, None)])
    assert pool.serving() == (e1, e2)
    pool.replace_states([(e1, S, 3)])  # e2 listed no more, nothing in flight: removed
    assert pool.serving() == (e1,), "a removed endpoint must not stay a candidate"
    pool.set_stale(True)
    assert pool.serving() == ()
    pool.set_stale(False)
    assert pool.serving() == (e1,)
    assert pool.try_admit().candidates == (e1,)
