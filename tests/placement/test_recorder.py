"""Phase profiles from lease events (placement/recorder.py), the hints a client sends (its acquire's metadata), and
the profiles through a real orchestrator's ListProfiles, kept across a restart."""

from __future__ import annotations

import pytest

from llmd_timeslice.client import client as client_mod
from llmd_timeslice.orchestrator import placement_watch as watch_mod
from llmd_timeslice.placement.profile import PhaseKind
from llmd_timeslice.placement.recorder import Hints, ProfileRecorder

ROLLOUT, TRAIN = Hints(PhaseKind.ROLLOUT, accelerators=2), Hints(PhaseKind.TRAIN, accelerators=4, state_bytes=10)


def _iteration(r: ProfileRecorder, t: float, job: str = "a", group: str = "g") -> float:
    """One role-lock iteration at ``t``: rollout 3 s, CPU gap 2 s, train 4 s, weight sync 1 s (10 s)."""
    r.acquired(job, group, ROLLOUT, at=t)
    r.granted(job, group, at=t)
    r.released(job, group, waiters=False, at=t + 3)
    r.acquired(job, group, TRAIN, at=t + 5)
    r.granted(job, group, at=t + 5)
    r.released(job, group, waiters=False, at=t + 9)
    return t + 10


def test_role_lock_holds_and_gaps_become_the_four_phases_and_the_period():
    r = ProfileRecorder()
    t = 0.0
    for _ in range(3):
        t = _iteration(r, t)
    r.acquired("a", "g", ROLLOUT, at=t)
    (p,) = r.profiles()
    assert p.mean_s(PhaseKind.ROLLOUT) == 3 and p.mean_s(PhaseKind.TRAIN) == 4
    assert p.mean_s(PhaseKind.CPU_GAP) == 2 and p.mean_s(PhaseKind.WEIGHT_SYNC) == 1
    assert p.periods.samples_s == [10, 10, 10] and p.accelerators_of(PhaseKind.TRAIN) == 4
    assert p.state_bytes_of(PhaseKind.TRAIN) == 10 and p.groups == ["g"]
    assert r.busy_accelerator_s["g"] == 3 * (3 * 2 + 4 * 4)
    p.check_complete()


def test_router_mode_train_holds_make_the_gap_between_them_the_rollout():
    r = ProfileRecorder()
    for i in range(3):
        r.acquired("t", "g", None, at=10.0 * i)
        r.granted("t", "g", at=10.0 * i + 0.5)
        r.released("t", "g", waiters=False, at=10.0 * i + 4.5)
    r.acquired("t", "g", None, at=30.0)
    (p,) = r.profiles()
    assert p.mean_s(PhaseKind.TRAIN) == 4 and p.mean_s(PhaseKind.ROLLOUT) == pytest.approx(5.5)
    assert p.periods.samples_s == [10, 10, 10]


def test_a_long_pause_is_not_a_phase_and_starts_a_new_period():
    r = ProfileRecorder()
    t = _iteration(r, 0.0)
    _iteration(r, t + 10_000)
    (p,) = r.profiles()
    assert p.phase(PhaseKind.WEIGHT_SYNC).count == 0 and p.periods.count == 0


def test_handover_switch_costs_and_snapshot_restore():
    r = ProfileRecorder()
    r.acquired("a", "g", TRAIN, at=0)
    r.granted("a", "g", at=0)
    r.acquired("b", "g", TRAIN, at=1)
    r.released("a", "g", waiters=True, at=2)
    r.granted("b", "g", at=2.25)
    r.switched("to_job", 0.5)
    r.switched("to_samplers", 0.25)
    assert r.costs.handover.samples_s == [0.25] and r.costs.sleep.samples_s == [0.5] and r.costs.served
    again = ProfileRecorder()
    assert again.restore(r.snapshot()) == 2
    assert again.profiles() == r.profiles() and again.costs == r.costs and again.busy_accelerator_s == r.busy_accelerator_s


def test_the_client_sends_the_hints_the_orchestrator_reads():
    assert (client_mod.PHASE_METADATA, client_mod.ACCELERATORS_METADATA, client_mod.STATE_BYTES_METADATA) == (
        watch_mod.PHASE_METADATA,
        watch_mod.ACCELERATORS_METADATA,
        watch_mod.STATE_BYTES_METADATA,
    )
    hints = watch_mod.hints_from_metadata(client_mod._hints("rollout", 2, 1024))
    assert hints == Hints(PhaseKind.ROLLOUT, 2, 1024, None)
    assert watch_mod.hints_from_metadata((("x-llmd-timeslice-phase", "lunch"), ("x-llmd-timeslice-accelerators", "x"))) == Hints()
    with pytest.raises(ValueError, match="phase must be one of"):
        client_mod._hints("generate", None, None)


async def test_profiles_from_a_real_orchestrator_survive_its_restart_and_feed_the_planner(tmp_path):
    """A client names its phases on acquire; ListProfiles serves the profile, the state file keeps it across a restart,
    and `plan --orchestrator` reads it (live.fetch) with the orchestrator's holders."""
    import asyncio

    from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
    from llmd_timeslice.domain.inventory import Inventory
    from llmd_timeslice.orchestrator.persistence import FileStateStore
    from llmd_timeslice.orchestrator.server import OrchestratorServer
    from llmd_timeslice.placement import live
    from tests.orchestrator.test_orchestrator import RecordingActions

    inv = Inventory.model_validate({"groups": [{"group_id": "g0"}]})
    store = FileStateStore(tmp_path / "state.json")
    first = OrchestratorServer(inv, port=0, actions=RecordingActions(), token="t", state_store=store)
    await first.start()
    try:
        c = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{first.port}", job_id="job", group_id="g0", token="t")
        for _ in range(3):
            await c.acquire(phase="rollout", accelerators=2)
            await asyncio.sleep(0.05)
            await c.release()
            await asyncio.sleep(0.02)
            await c.acquire(phase="train", accelerators=2, state_bytes=1000)
            await asyncio.sleep(0.05)
            await c.release()
            await asyncio.sleep(0.02)
        await c.acquire(phase="rollout")
        await c.close()
    finally:
        await first.stop()
    second = OrchestratorServer(inv, port=0, actions=RecordingActions(), token="t", state_store=store)
    await second.start()
    try:
        (tmp_path / "token").write_text("t")
        state = await asyncio.to_thread(live.fetch, f"127.0.0.1:{second.port}", tmp_path / "token")
        (p,) = state.profiles
        assert p.job_id == "job" and p.phase(PhaseKind.ROLLOUT).count == 3 and p.periods.count == 3
        assert p.mean_s(PhaseKind.TRAIN) == pytest.approx(0.05, abs=0.04) and p.state_bytes_of(PhaseKind.TRAIN) == 1000
        assert p.groups == ["g0"] and state.holders == {"g0": "job"}  # held at the restart, still held
        p.check_complete()
    finally:
        await second.stop()
