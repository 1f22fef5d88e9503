"""Phase profiles (placement/profile.py) and the offer with its residency packing (placement/offer.py)."""

from __future__ import annotations

import pytest

from llmd_timeslice.placement.offer import DoesNotFit, GroupNeed, parse_offer, place_groups
from llmd_timeslice.placement.profile import (
    MAX_SAMPLES,
    IncompleteProfile,
    JobProfile,
    PhaseKind,
    PhaseStats,
    ProfileError,
    hand_profile,
    load_profiles,
)

GIB = 2**30


def test_hand_profile_reads_numbers_lists_sizes_and_per_phase_accelerators():
    p = hand_profile(
        job_id="a", rollout_s=[1, 2, 3], train_s=2, cpu_gap_s=4, accelerators={"rollout": 2, "train": 8}, state_bytes="2GiB"
    )
    assert p.mean_s(PhaseKind.ROLLOUT) == 2 and p.phase(PhaseKind.ROLLOUT).quantile_s(0.5) == 2
    assert p.alone_period_s == 8 and p.accelerators_of(PhaseKind.TRAIN) == 8
    assert p.state_bytes_total == 2 * GIB and p.busy_accelerator_s == 2 * 2 + 2 * 8
    p.check_complete()


def test_phase_stats_keep_the_most_recent_samples():
    s = PhaseStats()
    for i in range(MAX_SAMPLES + 10):
        s.add(float(i))
    assert s.count == MAX_SAMPLES + 10 and len(s.samples_s) == MAX_SAMPLES and s.samples_s[-1] == MAX_SAMPLES + 9


def test_a_measured_profile_without_a_rollout_has_no_complete_period():
    p = JobProfile(job_id="half", source="measured", phases={PhaseKind.TRAIN: PhaseStats.of([3, 3, 3])})
    with pytest.raises(IncompleteProfile, match=r"job half: no complete period \(saw train x3; a period needs a rollout"):
        p.check_complete()


def test_a_measured_profile_without_a_next_iteration_has_no_complete_period():
    p = JobProfile(
        job_id="once", source="measured", phases={PhaseKind.ROLLOUT: PhaseStats.of([1]), PhaseKind.TRAIN: PhaseStats.of([1])}
    )
    with pytest.raises(IncompleteProfile, match="not yet the start of a next iteration"):
        p.check_complete()


def test_profiles_file_errors_are_one_line_each(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("profiles:\n  - {job_id: a, rolout_s: 1, train_s: 1}\n  - {job_id: b, rollout_s: -1, train_s: 1}\n")
    with pytest.raises(ProfileError) as exc:
        load_profiles([f])
    assert any("rolout_s: unknown key (did you mean" in e for e in exc.value.errors)
    assert any(e.startswith(f"{f}[1].rollout_s") for e in exc.value.errors)
    f.write_text("- {job_id: a, rollout_s: 1, train_s: 1}\n- {job_id: a, rollout_s: 1, train_s: 1}\n")
    with pytest.raises(ProfileError, match="job a given twice"):
        load_profiles([f])


def test_a_saved_profile_reads_back_equal(tmp_path):
    p = hand_profile(job_id="a", rollout_s=[1, 2], train_s=3, accelerators=2, state_bytes="1GiB")
    f = tmp_path / "p.json"
    f.write_text('{"profiles": [' + p.model_dump_json() + "]}")
    assert load_profiles([f]) == [p]


def test_offer_short_form_and_its_errors():
    offer = parse_offer("2x8:1TiB, 4x4:512GiB")
    assert offer.accelerators == 32 and offer.nodes[1].host_memory == 512 * GIB
    with pytest.raises(ValueError, match="expected COUNTxACCELERATORS"):
        parse_offer("eight gpus")


def test_groups_are_packed_onto_nodes_within_their_host_memory():
    offer = parse_offer("2x8:100GiB")
    placed = place_groups([GroupNeed("big", 16, 0), GroupNeed("a", 4, 50 * GIB)], parse_offer("3x8:100GiB"))
    assert len(placed["big"]) == 2 and len(placed["a"]) == 1
    placed = place_groups([GroupNeed("a", 4, 60 * GIB), GroupNeed("b", 4, 60 * GIB)], offer)
    assert placed["a"] != placed["b"]  # 120 GiB of states do not fit one node's 100 GiB
    with pytest.raises(DoesNotFit, match="c: needs 4 accelerators"):
        place_groups([GroupNeed(n, 4, 60 * GIB) for n in "abc"], offer)
    with pytest.raises(DoesNotFit, match="host memory per node"):
        place_groups([GroupNeed("huge", 4, 200 * GIB)], offer)
