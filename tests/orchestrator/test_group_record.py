"""A group's persisted record on its own (orchestrator/group_record.py): written from the parts, read back into new
parts, with an unreadable weight version left out and samplers no longer in the group ignored."""

from __future__ import annotations

import json
import logging

from llmd_timeslice.orchestrator.clock import ManualClock
from llmd_timeslice.orchestrator.group_record import group_record, load_record
from llmd_timeslice.orchestrator.lease_queue import LeaseQueue
from llmd_timeslice.orchestrator.phases import GroupPhase, GroupState
from llmd_timeslice.orchestrator.sampler_fleet import SamplerFleet
from llmd_timeslice.orchestrator.weight_ledger import RejectedWeights, WeightLedger
from llmd_timeslice.weights.update import WeightUpdate

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def _parts(clock: ManualClock, fired: list[int], addresses: list[str]) -> tuple[LeaseQueue, WeightLedger, SamplerFleet]:
    return LeaseQueue("g", clock, fired.append), WeightLedger("g"), SamplerFleet(addresses, clock)


def test_a_held_group_round_trips_through_json_and_its_armed_lease_expires_a_ttl_after_the_restore() -> None:
    clock, fired = ManualClock(), []
    leases, ledger, fleet = _parts(clock, fired, [A, B])
    leases.expired_jobs["old"] = "its lease expired"
    leases.grant("trainer", 30.0)
    leases.renew()
    ledger.publish("trainer", WeightUpdate(3, location="/w/v3"))
    ledger.last_good = WeightUpdate(2, location="/w/v2")
    ledger.rejected = RejectedWeights(3, "bad shard")
    fleet.versions.update({A: 2, B: 2})
    saved = json.loads(json.dumps(group_record(GroupState.LOCKED, GroupPhase.HELD, leases, ledger, fleet)))
    assert saved["holder"] == saved["loaded_job"] == "trainer" and saved["lease"]["armed"] and saved["last_token"] == 1

    clock2, fired2 = ManualClock(start=50.0), []
    leases2, ledger2, fleet2 = _parts(clock2, fired2, [A])
    assert load_record("g", saved, leases2, ledger2, fleet2, known={A}) is GroupPhase.HELD
    assert (leases2.holder, leases2.last_token, leases2.expired_jobs) == ("trainer", 1, {"old": "its lease expired"})
    assert ledger2.weights == ledger.weights and ledger2.last_good == ledger.last_good and ledger2.rejected == ledger.rejected
    assert ledger2.publisher == "trainer" and ledger2.publishers == {"trainer"}
    assert fleet2.versions == {A: 2}, "a sampler no longer in the group is ignored"
    clock2.advance(30.0)
    assert fired2 == [1]


def test_a_deferred_job_of_a_group_without_samplers_is_restored_and_a_bad_weight_version_left_out(caplog) -> None:
    clock, fired = ManualClock(), []
    leases, ledger, fleet = _parts(clock, fired, [])
    leases.deferred_job = "trainer"
    saved = group_record(GroupState.IDLE_YIELDED, GroupPhase.DEFERRED, leases, ledger, fleet)
    assert saved["loaded_job"] == "trainer" and saved["holder"] is None
    saved["weights"] = {"version": 0}
    leases2, ledger2, fleet2 = _parts(clock, fired, [])
    with caplog.at_level(logging.ERROR, logger="llmd_timeslice.orchestrator.group"):
        assert load_record("g", saved, leases2, ledger2, fleet2, known=set()) is GroupPhase.DEFERRED
    assert leases2.deferred_job == "trainer" and ledger2.weights is None
    assert "group=g persisted weights ignored" in caplog.text


def test_an_idle_group_with_samplers_leaves_the_phase_to_them() -> None:
    clock, fired = ManualClock(), []
    leases, ledger, fleet = _parts(clock, fired, [A])
    saved = group_record(GroupState.IDLE, GroupPhase.SERVING, leases, ledger, fleet)
    assert load_record("g", saved, *_parts(clock, fired, [A]), known={A}) is None
