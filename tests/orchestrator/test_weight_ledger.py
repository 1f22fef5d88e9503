"""The weight ledger on its own (orchestrator/weight_ledger.py): publishing, the target a wake converges to, a
version rejected by every sampler or refused by some, the last good version, the problems told at the publisher's
next acquire (only those not repaired meanwhile), and who counts as a publisher. Also the wake record the phase
switch builds from the ledger's target (orchestrator/phase_switch.py ``resume_record``)."""

from __future__ import annotations

import pytest

from llmd_timeslice.domain.group_settings import SamplerEndpoint
from llmd_timeslice.domain.switches import SwitchKind, SwitchRecord
from llmd_timeslice.orchestrator.errors import InvalidArgument, StaleWeightVersion
from llmd_timeslice.orchestrator.phase_switch import resume_record
from llmd_timeslice.orchestrator.weight_ledger import RejectedWeights, WeightLedger
from llmd_timeslice.weights.update import WeightUpdate

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def _v(n: int) -> WeightUpdate:
    return WeightUpdate(n, location=f"/w/v{n}")


def _wake(weights: WeightUpdate, versions: dict[str, int], errors=None, rejected=None) -> SwitchRecord:
    rec = SwitchRecord("g", SwitchKind.TO_SAMPLERS, "trainer", 0.0, weights=weights)
    rec.sampler_versions.update(versions)
    rec.sampler_errors.update(errors or {})
    rec.weights_rejected.update(rejected or {})
    return rec


def test_a_version_must_be_a_weight_update_newer_than_every_one_published_or_served() -> None:
    ledger = WeightLedger("g")
    with pytest.raises(InvalidArgument, match="must be a WeightUpdate"):
        ledger.check_publish("v2", {})
    with pytest.raises(StaleWeightVersion, match=r"not newer than group 'g''s latest \(3\)"):
        ledger.check_publish(_v(3), {A: 3})
    ledger.publish("trainer", ledger.check_publish(_v(4), {A: 3}))
    assert ledger.target == _v(4) and ledger.publisher == "trainer" and ledger.published_in_grant
    with pytest.raises(StaleWeightVersion):
        ledger.check_publish(_v(4), {A: 3})
    assert ledger.ahead_of(3) and not ledger.ahead_of(4)


def test_a_version_every_sampler_rejects_is_not_the_target_until_a_newer_one_is_published() -> None:
    ledger = WeightLedger("g")
    ledger.publish("trainer", _v(1))
    ledger.take_wake(_wake(_v(1), {A: 1, B: 1}), serving_version=1)
    assert ledger.last_good == _v(1)
    ledger.publish("trainer", _v(2))
    ledger.take_wake(_wake(_v(2), {A: 1, B: 1}, rejected={A: "bad shard", B: "bad shard"}), serving_version=1)
    assert ledger.rejected == RejectedWeights(2, f"{A}: bad shard; {B}: bad shard")
    assert ledger.target == _v(1), "the last good version while the latest is rejected"
    problems = ledger.sync_errors["trainer"]
    assert [p.kind for p in problems] == ["rejected"] and problems[0].serving == 1
    ledger.publish("trainer", _v(3))
    assert ledger.rejected is None and ledger.target == _v(3)


def test_a_version_some_samplers_refuse_is_kept_and_their_problem_told_once_if_not_repaired() -> None:
    ledger = WeightLedger("g")
    ledger.publish("trainer", _v(2))
    ledger.take_wake(_wake(_v(2), {A: 2, B: 1}, rejected={B: "bad shard"}), serving_version=2)
    assert ledger.rejected is None and ledger.last_good == _v(2)
    text = ledger.sync_error_for("trainer", {}, {A: 2, B: 1})
    assert text.startswith("weight version 2 was refused by 1 of 2 sampler(s)") and B in text
    assert ledger.sync_error_for("trainer", {}, {A: 2, B: 1}) == "", "told once"


def test_a_problem_repaired_before_the_next_acquire_is_not_told() -> None:
    ledger = WeightLedger("g")
    ledger.publish("trainer", _v(2))
    ledger.take_wake(_wake(_v(2), {A: 2, B: 1}, errors={B: "its engine did not wake"}), serving_version=2)
    assert [p.kind for p in ledger.sync_errors["trainer"]] == ["not_loaded"]
    assert ledger.sync_error_for("trainer", {}, {A: 2, B: 2}) == "", "B loaded version 2 in a repair meanwhile"


def test_a_job_stays_a_publisher_only_while_it_publishes_in_each_grant() -> None:
    ledger = WeightLedger("g")
    ledger.publish("trainer", _v(1))
    ledger.released("trainer")
    assert ledger.publishers == {"trainer"}
    ledger.new_grant()
    ledger.released("trainer")
    assert ledger.publishers == set(), "a grant without a publish: the auto sleep level no longer counts it"


def test_a_wake_record_loads_the_target_where_a_sampler_is_below_it_and_always_on_repair() -> None:
    samplers = [SamplerEndpoint("p", A, "10.0.0.1:9001", "s1"), SamplerEndpoint("p", B, "10.0.0.2:9001", "s2")]
    rec = resume_record("g", SwitchKind.TO_SAMPLERS, "trainer", samplers, {A: 2, B: 2}, _v(2), 5.0)
    assert rec.sampler_versions == {A: 2, B: 2} and rec.weights is None and rec.started_at == 5.0
    assert resume_record("g", SwitchKind.TO_SAMPLERS, "", samplers, {A: 2}, _v(2), 0.0).weights == _v(2), "B at 0"
    assert resume_record("g", SwitchKind.REPAIR, "", samplers[:1], {A: 2}, _v(2), 0.0).weights == _v(2)
    assert resume_record("g", SwitchKind.RECONCILE, "", samplers, {}, None, 0.0).weights is None
