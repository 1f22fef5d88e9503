"""The group's tasks: its steps are kept while they run (garbage collection), and the next acquire warns about the
samplers still without the published weights."""

from __future__ import annotations

import asyncio
import gc
import weakref

from llmd_timeslice.weights.update import WeightUpdate
from tests.orchestrator.group_machine_support import (
    S1,
    S2,
    Env,
    P,
)


# -------------------------------------------------------------------------------------------------- tasks
async def test_a_groups_steps_are_kept_while_they_run_and_survive_garbage_collection():
    """Bug 4 of issue 16: tasks the core creates are referenced by their group, so a step awaiting something only
    it references is not collected mid-flight."""
    e = Env()
    release: list[weakref.ref] = []

    async def drain(spec, record):
        fut = asyncio.get_running_loop().create_future()  # referenced only by this coroutine
        release.append(weakref.ref(fut))
        await fut

    e.acts.drain_samplers = drain  # type: ignore[method-assign]
    try:
        acquire = e.task(e.orch.acquire("A", "s"))
        await e.wait(P.DRAINING)
        await asyncio.sleep(0)
        gc.collect()
        fut = release[0]()
        assert fut is not None, "the drain step was collected mid-flight"
        fut.set_result(None)
        await asyncio.wait_for(acquire, 5)
        assert e.g().holder == "A"
    finally:
        await e.close()


async def test_the_next_acquire_warns_only_about_samplers_still_without_the_published_version():
    """Issue 38 §5: a version that failed to load on two samplers, one repaired since: the publisher's next acquire
    names the other only; once both are repaired it warns about nothing."""
    e = Env()
    try:
        await e.held()
        await e.orch.publish_weights("A", "s", WeightUpdate(1, location="/w/1"))
        e.acts.fail_samplers = {S1.address, S2.address}
        await e.orch.yield_("A", "s")
        await e.wait(P.OUT_OF_SERVICE)
        e.acts.fail_samplers = {S2.address}
        e.clock.advance(2.0)  # the repair wakes both; S1 loads version 1 now
        await e.wait(P.OUT_OF_SERVICE, pred=lambda g: set(g.sampler_errors) == {S2.address})
        res = await e.orch.acquire("A", "s")
        assert "did not load on 1 of 2 sampler(s)" in res.weight_sync_error, res
        assert S2.address in res.weight_sync_error and S1.address not in res.weight_sync_error, res
        e.acts.fail_samplers = set()
        await e.orch.yield_("A", "s")
        await e.wait(P.SERVING)
        assert (await e.orch.acquire("A", "s")).weight_sync_error == ""
    finally:
        await e.close()
