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
    assert any(e.startswith(f"{f}[1] (job b).rollout_s") for e in exc.value.errors)
    f.write_text("- {job_id: a, rollout_s: 1, train_s: 1}\n- {job_id: a, rollout_s: 1, train_s: 1}\n")
    with pytest.raises(ProfileError, match="job a given twice"):
        load_profiles([f])


@pytest.mark.parametrize(
    "entry,line",
    [
        ("rollout_s: abc, train_s: 1", "rollout_s: expected seconds: a number or a non-empty list of numbers, got 'abc'"),
        ("rollout_s: 1, train_s: [1, x]", "train_s: expected seconds: a number or a non-empty list of numbers, got [1, 'x']"),
        (
            "rollout_s: 1, train_s: 1, accelerators: many",
            "accelerators: expected a whole number of accelerators, or a mapping of phase to it, got 'many'",
        ),
        (
            "rollout_s: 1, train_s: 1, accelerators: {train: 1.5}",
            "accelerators: phase train: expected a whole number of accelerators, got 1.5",
        ),
        (
            "rollout_s: 1, train_s: 1, state_bytes: {train: lots}",
            "state_bytes: phase train: expected a size (bytes, or 80GiB), got 'lots'",
        ),
        (
            "rollout_s: 1, train_s: 1, switch_s: {rolout: 1}",
            "switch_s: unknown phase 'rolout'; phases: rollout, cpu_gap, train, weight_sync",
        ),
    ],
    ids=["rollout_s-text", "train_s-list-item", "accelerators-text", "accelerators-per-phase", "state_bytes", "switch_s-phase"],
)
def test_a_value_of_the_wrong_type_is_one_line_naming_the_job_and_field(tmp_path, entry, line):
    """The fresh-clone trial: `rollout_s: abc` printed two pydantic lines (`rollout_s.float: ...`, `rollout_s.list[float]:
    ...`), one per member of the field's union type. One line, naming the entry, its job and the field."""
    f = tmp_path / "p.yaml"
    f.write_text(f"- {{job_id: a, rollout_s: 1, train_s: 1}}\n- {{job_id: b, {entry}}}\n")
    with pytest.raises(ProfileError) as exc:
        load_profiles([f])
    assert exc.value.errors == [f"{f}[1] (job b).{line}"]


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
