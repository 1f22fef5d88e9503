"""Scenarios of the group state machine (``test_group_machine.py`` walks them all): an unexpected exception in a
handler puts the group in a safe phase, tells the error, and the repair path takes over."""

from __future__ import annotations

import pytest

from llmd_timeslice.domain.group_settings import GroupSpec
from llmd_timeslice.orchestrator import service
from llmd_timeslice.orchestrator.errors import GroupFault, NotHolder
from tests.orchestrator.group_machine_support import (
    S1,
    S2,
    S3,
    Bug,
    C,
    Env,
    MalformedReading,
    P,
)


# ---- an unexpected exception in a handler: a safe phase, the error told, the repair path takes over
async def _fault_free_acquire(e: Env):
    e.boom[("t", P.FREE, C.ACQUIRE, P.HELD)] = Bug("grant")
    with pytest.raises(GroupFault, match=r"internal error in ACQUIRE during phase FREE: Bug\('grant'\)"):
        await e.orch.acquire("A", "t")
    g = e.g("t")
    assert g.phase is P.FREE and g.holder is None and "ACQUIRE during phase FREE" in g.last_error
    await e.held("t")  # the group works on
    assert g.holder == "A"


async def _fault_free_spec_adds_samplers(e: Env):
    e.boom[("t", P.FREE, C.SPEC_UPDATE, P.RESUMING)] = Bug()
    with pytest.raises(GroupFault, match="SPEC_UPDATE during phase FREE"):
        await e.orch.update_spec(GroupSpec("t", [S3]))
    g = e.g("t")
    assert g.phase is P.OUT_OF_SERVICE and "state unknown" in g.sampler_errors[S3.address]
    assert service.weight_status(g).samplers[0].in_service is False
    e.clock.advance(2.0)  # the repair timer wakes and verifies the sampler whose state is unknown
    await e.wait(P.SERVING, "t")
    assert e.acts.calls[-1] == ("resume", "t", [S3.address]) and not g.sampler_errors


async def _fault_serving_malformed_engine_reading(e: Env):
    e.orch.start_repair(audit_interval_s=10)
    e.acts.readings = {S1.address: MalformedReading()}
    e.clock.advance(10)
    await e.wait(P.OUT_OF_SERVICE)
    g = e.g()
    assert set(g.sampler_errors) == {S1.address, S2.address}
    assert "AUDITED during phase SERVING" in service.weight_status(g).last_error
    e.acts.readings = {}
    e.clock.advance(2.0)
    await e.wait(P.SERVING)
    assert e.acts.calls[-1] == ("resume", "s", [S1.address, S2.address]) and e.g().history[-1].kind == "repair"


async def _fault_oos_acquire(e: Env):
    await e.out_of_service()
    e.boom[("s", P.OUT_OF_SERVICE, C.ACQUIRE, P.DRAINING)] = Bug()
    with pytest.raises(GroupFault, match="ACQUIRE during phase OUT_OF_SERVICE"):
        await e.orch.acquire("B", "s")
    assert e.g().phase is P.OUT_OF_SERVICE and not e.g().waiters and e.clock.pending()
    e.clock.advance(2.0)
    await e.wait(P.SERVING)


async def _fault_draining(e: Env):
    await e.draining()
    b = await e.queued("B")
    e.boom[("s", P.DRAINING, C.DRAINED, P.SUSPENDING)] = Bug()
    e.acts.release("drain")
    with pytest.raises(GroupFault, match="DRAINED during phase DRAINING"):
        await e.tasks[0]
    with pytest.raises(GroupFault):  # a queued waiter gets the error too, it does not hang
        await b
    assert e.g().phase is P.OUT_OF_SERVICE and e.g().holder is None
    e.clock.advance(2.0)
    await e.wait(P.SERVING)
    assert [c[0] for c in e.acts.calls] == ["drain", "resume"]


async def _fault_suspending_metrics_callback(e: Env):
    await e.suspending()

    def on_switch(record):
        raise Bug("metrics")

    e.orch._on_switch = on_switch
    e.acts.release("suspend")
    with pytest.raises(GroupFault, match="SUSPENDED during phase SUSPENDING"):
        await e.tasks[-1]
    e.orch._on_switch = None
    assert e.g().phase is P.OUT_OF_SERVICE and e.g().holder is None and not e.g().waiters
    e.clock.advance(2.0)  # the engines went to sleep: the repair wakes and verifies them
    await e.wait(P.SERVING)
    assert e.acts.calls[-1] == ("resume", "s", [S1.address, S2.address])


async def _fault_held_heartbeat(e: Env):
    await e.held()
    b = await e.queued("B")
    token = e.orch.lease("A", "s").token
    e.boom[("s", P.HELD, C.HEARTBEAT, P.HELD)] = Bug()
    with pytest.raises(GroupFault, match="HEARTBEAT during phase HELD"):
        await e.orch.heartbeat("A", "s", token)
    assert e.g().phase is P.HELD and e.g().holder == "A", "an intact lease is kept: the job still uses the accelerators"
    assert [w.job_id for w in e.g().waiters] == ["B"], "its queue is intact too: B is granted at the yield"
    await e.orch.yield_("A", "s", token)
    await b
    assert e.g().holder == "B"


async def _fault_held_half_handed_to_the_next_waiter(e: Env):
    await e.held()
    b = await e.queued("B")
    e.boom[("s", P.HELD, C.YIELD, P.HELD)] = Bug()  # A released, B not granted yet
    with pytest.raises(GroupFault):
        await e.orch.yield_("A", "s")
    with pytest.raises(GroupFault, match="YIELD during phase HELD"):  # the waiter hears it, it does not hang
        await b
    assert e.g().phase is P.OUT_OF_SERVICE and e.g().holder is None and not e.g().waiters


async def _fault_held_half_released(e: Env):
    await e.held()
    e.boom[("s", P.HELD, C.YIELD, P.RESUMING)] = Bug()
    with pytest.raises(GroupFault, match="YIELD during phase HELD"):
        await e.orch.yield_("A", "s")
    g = e.g()
    assert g.phase is P.OUT_OF_SERVICE and g.holder is None and g.lease is None
    with pytest.raises(NotHolder, match="reclaimed after an internal error in YIELD"):
        await e.orch.heartbeat("A", "s", 1)
    e.clock.advance(2.0)
    await e.wait(P.SERVING)


async def _fault_held_half_released_no_samplers(e: Env):
    await e.held("t")
    e.boom[("t", P.HELD, C.YIELD, P.DEFERRED)] = Bug()
    with pytest.raises(GroupFault):
        await e.orch.yield_("A", "t")
    assert e.g("t").phase is P.FREE and e.g("t").holder is None and e.g("t").loaded_job is None
    await e.held("t", "B")


async def _fault_deferred_acquire(e: Env):
    await e.deferred()
    e.boom[("t", P.DEFERRED, C.ACQUIRE, P.HELD)] = Bug()
    with pytest.raises(GroupFault, match="ACQUIRE during phase DEFERRED"):
        await e.orch.acquire("A", "t")
    assert e.g("t").phase is P.DEFERRED and e.g("t").loaded_job == "A"


async def _fault_deferred_spec_adds_samplers(e: Env):
    await e.deferred()
    e.boom[("t", P.DEFERRED, C.SPEC_UPDATE, P.RESUMING)] = Bug()
    with pytest.raises(GroupFault):
        await e.orch.update_spec(GroupSpec("t", [S3]))
    assert e.g("t").phase is P.OUT_OF_SERVICE and e.g("t").deferred_job is None


async def _fault_resuming(e: Env):
    await e.resuming()
    e.boom[("s", P.RESUMING, C.RESUMED, P.SERVING)] = Bug()
    e.acts.release("resume")
    await e.wait(P.OUT_OF_SERVICE)
    assert "RESUMED during phase RESUMING" in e.g().last_error
    e.clock.advance(2.0)
    await e.wait(P.SERVING)


async def _fault_repairing(e: Env):
    await e.repairing()
    e.boom[("s", P.REPAIRING, C.REPAIRED, P.SERVING)] = Bug()
    e.acts.release("resume")
    await e.wait(P.OUT_OF_SERVICE, pred=lambda g: "REPAIRED" in g.last_error)
    assert set(e.g().sampler_errors) == {S1.address, S2.address}
    assert min(e.clock.pending()) == pytest.approx(e.clock.now() + 4.0), "the repair back-off doubles"
