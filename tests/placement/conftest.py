"""Profiles shared by the planner's tests (hand entries: seconds, accelerators)."""

from __future__ import annotations

import pytest

from llmd_timeslice.placement.profile import hand_profile


@pytest.fixture
def long_gap_jobs():
    """Three jobs with long CPU reward gaps (each holds its accelerators about a third of its period) and one busy
    job (rollout and training back to back, short gaps)."""
    return [
        hand_profile(job_id="env-a", rollout_s=[9, 10, 11], train_s=8, cpu_gap_s=30, weight_sync_s=1, accelerators=4),
        hand_profile(job_id="env-b", rollout_s=10, train_s=[7, 8], cpu_gap_s=32, weight_sync_s=1, accelerators=4),
        hand_profile(job_id="env-c", rollout_s=6, train_s=5, cpu_gap_s=40, weight_sync_s=2, accelerators=4),
        hand_profile(job_id="busy", rollout_s=30, train_s=30, cpu_gap_s=1, weight_sync_s=1, accelerators=4),
    ]
