"""Issue 16 bug 4 in the gate: tasks it creates are kept by their owner until they end (the event loop keeps only
weak references to tasks, so a task nobody references can be collected mid-flight)."""

from __future__ import annotations

import asyncio
import gc
import weakref

from epp_plugin.gate.pool_state import EndpointState, PoolState
from epp_plugin.gate.server import READINESS_SERVICE, GateConfig, GateServer


async def test_drain_notification_is_kept_by_the_pool_until_it_ran_and_survives_a_collection():
    pool = PoolState("p")
    pool.set_states([("e1:1", EndpointState.SERVING, 0)])
    adm = await pool.admit()
    waiter = asyncio.create_task(pool.wait_drained(["e1:1"], 5))
    await asyncio.sleep(0.01)
    async with pool.drains._changed:  # the notification must wait for the condition's lock: it is in flight meanwhile
        pool.finish(adm)
        assert len(pool.drains._tasks) == 1, "the request's end must notify the drain waiter through a task the pool keeps"
        ref = weakref.ref(next(iter(pool.drains._tasks)))
        gc.collect()
        assert ref() is not None and not ref().done()
    drained, in_flight = await asyncio.wait_for(waiter, 5)
    assert drained and in_flight == {"e1:1": 0}
    assert not pool.drains._tasks, "a finished notification is dropped"


async def test_readiness_update_after_a_sync_is_kept_by_the_gate_until_it_ran():
    from grpc_health.v1 import health_pb2

    gate = GateServer(GateConfig(ext_proc_port=0, control_port=0))
    await gate.start()
    try:
        await gate._health.set(READINESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        gate._synced()  # what the subscription calls once the orchestrator's first snapshot is applied
        assert len(gate._tasks) == 1
        ref = weakref.ref(next(iter(gate._tasks)))
        gc.collect()
        assert ref() is not None
        await asyncio.wait_for(ref(), 5)
        assert not gate._tasks
        answer = await gate._health.Check(health_pb2.HealthCheckRequest(service=READINESS_SERVICE), None)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await gate.stop()
