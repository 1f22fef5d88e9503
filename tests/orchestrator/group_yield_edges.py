"""Scenarios of the group state machine (``test_group_machine.py`` walks them all): yield requests in each phase, and
a held group whose engine was down at the sleep."""

from __future__ import annotations

from llmd_timeslice.domain.switches import EngineReading
from llmd_timeslice.orchestrator.groups import Command
from tests.orchestrator.group_machine_support import (
    S1,
    S2,
    C,
    Env,
    P,
)


async def _asked_nobody_holds(e: Env, gid: str = "s") -> None:
    a = await e.orch.request_yield(gid, "eval waits", band=10, hold_deadline_s=5)
    assert not a.requested and a.holder == "" and f"group {gid!r} is not held" in a.detail, a


async def _yield_request_free_serving_deferred(e: Env):
    await _asked_nobody_holds(e, "t")  # FREE
    await _asked_nobody_holds(e, "s")  # SERVING
    await e.deferred()
    await _asked_nobody_holds(e, "t")


async def _yield_request_draining_suspending(e: Env):
    await e.draining()
    await _asked_nobody_holds(e)
    e.acts.hold.add("suspend")
    e.acts.release("drain")
    await e.wait(P.SUSPENDING)
    await _asked_nobody_holds(e)
    e.acts.release("suspend")
    await e.tasks[0]
    assert e.g().holder == "A"


async def _yield_request_resuming_out_of_service_repairing(e: Env):
    await e.resuming()
    await _asked_nobody_holds(e)
    e.acts.fail_samplers = {S2.address}
    e.acts.release("resume")
    await e.wait(P.OUT_OF_SERVICE)
    await _asked_nobody_holds(e)
    e.acts.fail_samplers = set()
    e.acts.hold.add("resume")
    e.clock.advance(2.0)
    await e.wait(P.REPAIRING)
    await _asked_nobody_holds(e)
    e.acts.release("resume")
    await e.wait(P.SERVING)


async def _yield_request_held_honoured(e: Env):
    await e.held()
    e.clock.advance(10.0)  # min_training_s (default 10 s) since the grant
    a = await e.orch.request_yield("s", "eval waits", band=10, hold_deadline_s=5)
    assert a.requested and a.holder == "A" and not a.detail
    assert e.orch.lease("A", "s").yield_request.band == 10
    again = await e.orch.request_yield("s", "eval waits more", band=10, hold_deadline_s=5)
    assert again.requested and "already requested" in again.detail
    e.clock.advance(1.5)
    await e.orch.yield_("A", "s")
    st = e.g().yield_stats
    assert (st.sent, st.honoured, st.ignored) == (1, 1, 0)


async def _yield_request_held_ignored_past_the_deadline(e: Env):
    await e.held()
    e.clock.advance(10.0)
    assert (await e.orch.request_yield("s", "eval waits", band=10, hold_deadline_s=5)).requested
    e.clock.advance(5.0)  # the band's deadline passes while A keeps the group
    await e.g().wait_until(lambda g: g.yield_stats.ignored == 1, 5)
    assert e.g().holder == "A", "yielding stays cooperative: A keeps the group"


async def _held_with_an_engine_down_at_the_sleep_put_to_sleep_once_it_answers(e: Env):
    e.acts.down = {S2.address}
    await e.held()  # granted: the down engine holds no accelerator memory
    g = e.g()
    assert S2.address in g.sampler_errors and S2.address in g.unreachable_engines
    e.acts.readings = {S2.address: EngineReading(None, False, "connection refused")}
    g.post(Command(C.AUDIT_TICK))  # still down: nothing to do
    await g.wait_until(lambda g: ("read", "s", [S2.address]) in e.acts.calls and not g.repair.reading, 5)
    assert S2.address in g.sampler_errors
    e.acts.down = set()
    e.acts.readings = {S2.address: EngineReading("default", False)}  # back from its restart, awake
    g.post(Command(C.AUDIT_TICK))
    await g.wait_until(lambda g: S2.address not in g.sampler_errors, 5)
    assert ("suspend", "s", [S2.address]) in e.acts.calls and g.phase is P.HELD and g.holder == "A"
    await e.orch.yield_("A", "s")
    await e.wait(P.SERVING)
    assert e.acts.calls[-1] == ("resume", "s", [S1.address, S2.address])


async def _held_with_an_engine_down_at_the_sleep_that_comes_back_asleep(e: Env):
    e.acts.down = {S2.address}
    await e.held()
    e.acts.readings = {S2.address: EngineReading(None, True)}  # e.g. restarted and put to sleep by its own start-up
    e.g().post(Command(C.AUDIT_TICK))
    await e.g().wait_until(lambda g: S2.address not in g.sampler_errors, 5)
    assert ("suspend", "s", [S2.address]) not in e.acts.calls
