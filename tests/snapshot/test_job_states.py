"""The sidecar's job-state table, edge by edge: every listed move is taken, every other one is refused naming both
states and leaves the state as it was."""

from __future__ import annotations

import pytest

from llmd_timeslice.snapshot.job_states import TRANSITIONS, IllegalJobTransition, JobState, move

EDGES = [(a, b) for a, targets in TRANSITIONS.items() for b in sorted(targets)]
MISSING = [(a, b) for a in JobState for b in JobState if b not in TRANSITIONS[a]]


@pytest.mark.parametrize(("current", "target"), EDGES, ids=[f"{a}->{b}" for a, b in EDGES])
def test_every_listed_move_is_taken(current, target):
    states = {"j": current}
    move(states, "j", target)
    assert states == {"j": target}


@pytest.mark.parametrize(("current", "target"), MISSING, ids=[f"{a}->{b}" for a, b in MISSING])
def test_every_move_not_listed_is_refused_and_changes_nothing(current, target):
    states = {"j": current}
    with pytest.raises(IllegalJobTransition, match=f"job 'j': no move from {current} to {target}"):
        move(states, "j", target)
    assert states == {"j": current}


def test_the_table_names_every_state_and_the_sidecar_cycle_is_in_it():
    assert set(TRANSITIONS) == set(JobState)
    cycle = [JobState.RUNNING, JobState.TRANSITIONING, JobState.SAVED, JobState.TRANSITIONING, JobState.RUNNING]
    states = {"j": cycle[0]}
    for target in cycle[1:]:
        move(states, "j", target)
    assert states["j"] == "RUNNING", "job states compare equal to the Snapshot Agent's names"


def test_a_new_job_starts_idle_and_may_only_start_running():
    states: dict[str, JobState] = {}
    with pytest.raises(IllegalJobTransition, match="from IDLE to SAVED"):
        move(states, "new", JobState.SAVED)
    assert states == {}
    move(states, "new", JobState.RUNNING)
    assert states == {"new": JobState.RUNNING}


def test_the_table_refuses_a_sleep_or_a_wake_outside_an_operation():
    assert JobState.SAVED not in TRANSITIONS[JobState.RUNNING]
    assert JobState.RUNNING not in TRANSITIONS[JobState.SAVED]
    assert JobState.TRANSITIONING not in TRANSITIONS[JobState.TRANSITIONING], "one operation at a time per job"
