"""The upstream-compatible phase callback against the real orchestrator over gRPC (in-memory switch actions).

The driver sequences replay upstream's own protocol tests (llm-d-incubation/llm-d-rl-time-slicing @ 6cf8e9b,
``pkg/integrations/slime/tests/test_callback.py``: the sync driver ``train.py`` with offload/create/eval options,
the async driver ``train_async.py`` with a weight-sync interval) and check the same properties: trainer group
never requested while only the sampler group is held, both held during ``weight_sync``, nothing held afterwards.
Here the orchestrator is the real one, so the holders it reports are checked too.
"""

from __future__ import annotations

import logging
import time

import pytest

from llmd_timeslice.client import AcquireTimeout, AsyncTimeSliceOrchestratorClient, LeaseLost, TimeSliceOrchestratorClient
from llmd_timeslice.client.integrations import (
    AsyncRoleLocks,
    AsyncTimesliceCallback,
    LockOrderViolation,
    RoleLocks,
    TimesliceCallback,
    TimeSliceConfigError,
    UnknownPhase,
    UnknownRole,
    phase,
)
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from tests.orchestrator.test_orchestrator import RecordingActions

pytestmark = pytest.mark.torch  # in the xdist worker that imports torch (tests/conftest.py)

TOKEN = "cb-token"
INVENTORY = Inventory.model_validate(
    {
        "groups": [
            {"group_id": "trainers"},
            {"group_id": "samplers"},
            {"group_id": "short-lease", "lease_ttl_s": 0.3},
            {
                "group_id": "served",
                "samplers": [
                    {"pool": "default", "address": "127.0.0.1:8001", "sidecar": "127.0.0.1:9101", "job_id": "sampler-0"}
                ],
            },
        ]
    }
)


class RecordingClient(TimeSliceOrchestratorClient):
    """The real client, recording each acquire/release that reaches the orchestrator (at its asyncio core, which
    the sync face and the role locks both call)."""

    def __init__(self, *a, events: list, **kw) -> None:
        super().__init__(*a, **kw)
        self.events = events
        core = self._core
        acquire, release = core.acquire, core.release

        async def recorded_acquire(job_id=None, group_id=None, timeout_sec=None, **hints):
            r = await acquire(job_id, group_id, timeout_sec, **hints)
            events.append(("acquire", group_id))
            return r

        async def recorded_release(job_id=None, group_id=None, weights=None):
            r = await release(job_id, group_id, weights)
            events.append(("release", group_id))
            return r

        core.acquire, core.release = recorded_acquire, recorded_release


@pytest.fixture(scope="module")
def orch():
    from tests.conftest import LoopThread

    lt = LoopThread()
    srv = OrchestratorServer(INVENTORY, port=0, actions=RecordingActions(), token=TOKEN)
    lt.run(srv.start())
    srv.loop_thread = lt
    srv.target = f"127.0.0.1:{srv.port}"
    yield srv
    lt.run(srv.stop())
    lt.close()


@pytest.fixture
def env(monkeypatch, orch):
    for name in (
        "TIMESLICE_JOB_ID",
        "TIMESLICE_ORCH_ADDR",
        "TIMESLICE_TRAINER_GROUP",
        "TIMESLICE_SAMPLER_GROUP",
        "LLMD_TIMESLICE_WEIGHTS_DIR",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLMD_TIMESLICE_TOKEN", TOKEN)
    return monkeypatch


def _locks(orch, events, job="job-a", trainer="trainers", sampler="samplers", **kw) -> RoleLocks:
    client = RecordingClient(orch.target, job_id=job, events=events)
    return RoleLocks(job, orch.target, trainer, sampler, client=client, **kw)


def _holder(orch, group) -> str | None:
    return orch.orchestrator.groups[group].holder


def _held_after(events) -> set:
    held: set = set()
    for op, group in events:
        if op == "acquire":
            assert group not in held, f"double acquire of {group}: {events}"
            held.add(group)
        else:
            assert group in held, f"release of un-held {group}: {events}"
            held.discard(group)
    return held


def _trainer_first(events, trainer="trainers", sampler="samplers") -> None:
    held: set = set()
    for op, group in events:
        if op == "acquire":
            if group == trainer:
                assert sampler not in held, f"trainer group acquired while the sampler group was held: {events}"
            held.add(group)
        else:
            held.discard(group)


def run_sync_driver(cb, orch, n_steps, offload_rollout=False, release_train=False, with_eval=False) -> None:
    """Upstream's sync driver sequence (train.py), with the holders checked at the real orchestrator."""
    cb.on_phase_begin("init", "both")
    assert (_holder(orch, "trainers"), _holder(orch, "samplers")) == ("job-a", "job-a")
    cb.on_phase_end("init", "both")
    for step in range(n_steps):
        ctx = {"rollout_id": step}
        cb.on_phase_begin("generate", "sampler", ctx)
        assert _holder(orch, "samplers") == "job-a" and _holder(orch, "trainers") is None
        cb.on_phase_end("generate", "sampler", ctx)
        if offload_rollout:
            cb.on_phase_begin("offload", "sampler", ctx)
            cb.on_phase_end("offload", "sampler", ctx)
        if release_train:
            cb.on_phase_begin("create", "trainer", ctx)
            cb.on_phase_end("create", "trainer", ctx)
        cb.on_phase_begin("train", "trainer", ctx)
        assert cb.locks.held("trainer") and not cb.locks.held("sampler")
        assert _holder(orch, "trainers") == "job-a" and _holder(orch, "samplers") is None
        cb.on_phase_end("train", "trainer", ctx)
        if offload_rollout and not release_train:
            cb.on_phase_begin("onload", "sampler", ctx)
            cb.on_phase_end("onload", "sampler", ctx)
        cb.on_phase_begin("weight_sync", "both", ctx)
        assert (_holder(orch, "trainers"), _holder(orch, "samplers")) == ("job-a", "job-a"), "weight sync holds both"
        cb.on_phase_end("weight_sync", "both", ctx)
        assert not cb.locks.held("trainer") and not cb.locks.held("sampler")
        if offload_rollout:
            cb.on_phase_begin("onload", "sampler", ctx)
            cb.on_phase_end("onload", "sampler", ctx)
        if with_eval:
            cb.on_phase_begin("eval", "sampler", ctx)
            cb.on_phase_end("eval", "sampler", ctx)
    cb.close()


def run_async_driver(cb, orch, n_steps, sync_interval=1, with_eval=False) -> None:
    """Upstream's async driver sequence (train_async.py): generation N+1 dispatched while training N holds the
    trainer group, so the sampler group is taken second."""
    cb.on_phase_begin("init", "both")
    cb.on_phase_end("init", "both")
    cb.on_phase_begin("generate", "sampler", {"rollout_id": 0})
    for step in range(n_steps):
        ctx = {"rollout_id": step}
        cb.on_phase_end("generate", "sampler", ctx)
        cb.on_phase_begin("train", "trainer", ctx)
        assert cb.locks.held("trainer")
        if step + 1 < n_steps:
            cb.on_phase_begin("generate", "sampler", {"rollout_id": step + 1})
            assert (_holder(orch, "trainers"), _holder(orch, "samplers")) == ("job-a", "job-a"), (
                "async: sampler group held while training"
            )
        cb.on_phase_end("train", "trainer", ctx)
        if (step + 1) % sync_interval == 0:
            if step + 1 < n_steps and cb.locks.held("sampler"):
                cb.on_phase_end("generate", "sampler", ctx)
            cb.on_phase_begin("weight_sync", "both", ctx)
            assert cb.locks.held("trainer") and cb.locks.held("sampler")
            cb.on_phase_end("weight_sync", "both", ctx)
        if with_eval:
            cb.on_phase_begin("eval", "sampler", ctx)
            cb.on_phase_end("eval", "sampler", ctx)
    cb.close()


@pytest.mark.parametrize(
    "options", [{}, {"offload_rollout": True, "release_train": True, "with_eval": True}], ids=["basic", "all-options"]
)
def test_upstream_sync_driver_sequence_takes_trainer_then_sampler_and_leaks_no_lock(env, orch, options):
    events: list = []
    cb = TimesliceCallback(_locks(orch, events))
    assert not cb.locks.router_mode
    run_sync_driver(cb, orch, 3, **options)
    assert _held_after(events) == set()
    _trainer_first(events)
    assert _holder(orch, "trainers") is None and _holder(orch, "samplers") is None
    assert events[:4] == [("acquire", "trainers"), ("acquire", "samplers"), ("release", "samplers"), ("release", "trainers")], (
        "init: trainer, sampler; released in reverse"
    )


@pytest.mark.parametrize("sync_interval", [1, 3])
def test_upstream_async_driver_sequence_holds_both_for_weight_sync_in_lock_order(env, orch, sync_interval):
    events: list = []
    cb = TimesliceCallback(_locks(orch, events))
    run_async_driver(cb, orch, 6, sync_interval=sync_interval, with_eval=True)
    assert _held_after(events) == set()
    _trainer_first(events)


def test_callback_reads_the_upstream_environment_contract(env, orch):
    env.setenv("TIMESLICE_JOB_ID", "job-a")
    env.setenv("TIMESLICE_ORCH_ADDR", orch.target)
    env.setenv("TIMESLICE_TRAINER_GROUP", "trainers")
    env.setenv("TIMESLICE_SAMPLER_GROUP", "samplers")
    cb = TimesliceCallback()  # upstream's constructor takes no argument
    with phase(cb, "train"):
        assert _holder(orch, "trainers") == "job-a"
    assert _holder(orch, "trainers") is None
    cb.close()


def test_without_a_job_id_every_phase_is_a_noop(env):
    cb = TimesliceCallback()  # TIMESLICE_JOB_ID unset: the same image runs without time-slicing
    assert not cb.locks.enabled
    for ph, role in [
        ("init", "both"),
        ("generate", "sampler"),
        ("train", "trainer"),
        ("weight_sync", "both"),
        ("offload", "sampler"),
        ("onload", "sampler"),
        ("eval", "sampler"),
        ("create", "trainer"),
        ("save", "trainer"),
    ]:
        cb.on_phase_begin(ph, role)
        cb.on_phase_end(ph, role)
    cb.close()


def test_bad_input_is_named(env, orch):
    cb = TimesliceCallback(_locks(orch, []))
    with pytest.raises(
        UnknownPhase,
        match=r"unknown phase 'rollout'; known phases: init, generate, train, "
        r"weight_sync, save, offload, onload, eval, create",
    ):
        cb.on_phase_begin("rollout", "sampler")
    with pytest.raises(UnknownRole, match=r"unknown role 'actor' \(phase 'train'\); known roles: trainer, sampler, both"):
        cb.on_phase_begin("train", "actor")
    assert cb.locks.plan.held == {}, "bad input takes no lock"
    noop = TimesliceCallback()
    with pytest.raises(UnknownPhase):
        noop.on_phase_end("warmup", "trainer")  # checked without time-slicing too
    cb.close()


def test_job_id_without_orchestrator_address_fails_at_start(env):
    env.setenv("TIMESLICE_JOB_ID", "job-a")
    env.setenv("TIMESLICE_TRAINER_GROUP", "trainers")
    env.setenv("TIMESLICE_SAMPLER_GROUP", "samplers")
    with pytest.raises(TimeSliceConfigError, match=r"TIMESLICE_JOB_ID='job-a' .* TIMESLICE_ORCH_ADDR is not set"):
        TimesliceCallback()
    env.setenv("TIMESLICE_ORCH_ADDR", "127.0.0.1:1")
    env.delenv("TIMESLICE_SAMPLER_GROUP")
    with pytest.raises(TimeSliceConfigError, match="TIMESLICE_SAMPLER_GROUP is not set"):
        TimesliceCallback()


def test_unknown_or_equal_groups_fail_at_start(env, orch):
    with pytest.raises(TimeSliceConfigError, match=r"TIMESLICE_SAMPLER_GROUP='nope'.*NOT_FOUND"):
        _locks(orch, [], sampler="nope")
    with pytest.raises(TimeSliceConfigError, match=r"TIMESLICE_TRAINER_GROUP='nope'.*NOT_FOUND"):
        _locks(orch, [], trainer="nope")
    with pytest.raises(TimeSliceConfigError, match="must be distinct groups"):
        _locks(orch, [], trainer="samplers", sampler="samplers")


def test_trainer_requested_while_only_the_sampler_is_held_is_a_lock_order_error(env, orch):
    cb = TimesliceCallback(_locks(orch, []))
    cb.on_phase_begin("generate", "sampler")
    with pytest.raises(LockOrderViolation, match="trainer first"):
        cb.on_phase_begin("train", "trainer")
    cb.close()
    assert _holder(orch, "samplers") is None


def test_a_refused_acquire_raises_and_a_lost_lease_surfaces_at_the_phase_end(env, orch):
    other = TimeSliceOrchestratorClient(orch.target, job_id="job-b", group_id="trainers", token=TOKEN)
    other.acquire()
    cb = TimesliceCallback(_locks(orch, []))
    cb.locks.DEFAULT_ACQUIRE_TIMEOUT_SEC = 0.5
    with pytest.raises(AcquireTimeout):
        cb.on_phase_begin("train", "trainer")
    assert not cb.locks.held("trainer"), "a refused acquire never leaves the phase running as if it held the lock"
    other.release()
    other.close()
    cb.close()

    cb = TimesliceCallback(_locks(orch, [], trainer="short-lease"))
    cb.on_phase_begin("train", "trainer")
    cb.locks.client._beats[("job-a", "short-lease")].stop()  # the trainer hangs: no heartbeats (test-only access)
    time.sleep(0.8)
    with pytest.raises(LeaseLost, match=r"no longer held .short-lease. .* lease .* expired"):
        cb.on_phase_end("train", "trainer")
    cb.close()


def test_router_mode_generate_takes_no_lock_and_weight_sync_publishes_the_next_version(env, orch, tmp_path):
    events: list = []
    locks = _locks(orch, events, job="job-r", trainer="trainers", sampler="served")
    cb = TimesliceCallback(locks)
    assert locks.router_mode and cb.weight_version == 0
    cb.on_phase_begin("generate", "sampler")
    assert _holder(orch, "served") is None, "rollouts go through the gate: the samplers stay awake"
    cb.on_phase_end("generate", "sampler")
    cb.on_phase_begin("train", "trainer")
    cb.on_phase_end("train", "trainer")
    cb.on_phase_begin("weight_sync", "both")
    assert _holder(orch, "served") == "job-r", "weight sync: the samplers drain and sleep"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"\0" * 64)
    cb.on_phase_end("weight_sync", "both", {"checkpoint_dir": str(ckpt)})
    assert cb.weight_version == 1
    status = locks.client.weight_status("served")
    assert max(status.serving_version, status.pending.version) == 1
    assert events == [
        ("acquire", "trainers"),
        ("release", "trainers"),
        ("acquire", "trainers"),
        ("acquire", "served"),
        ("release", "served"),
        ("release", "trainers"),
    ]
    cb.close()


def test_router_mode_with_a_co_located_trainer_publishes_when_training_ends(env, orch, tmp_path):
    import torch

    events: list = []
    cb = TimesliceCallback(
        _locks(orch, events, job="job-c", trainer="served", sampler="served", weights_dir=tmp_path / "weights")
    )
    start = cb.weight_version
    cb.on_phase_begin("generate", "sampler")
    cb.on_phase_end("generate", "sampler")
    cb.on_phase_begin("train", "trainer")
    assert _holder(orch, "served") == "job-c"
    cb.on_phase_end("train", "trainer", {"model": {"w": torch.zeros(4)}})
    assert cb.weight_version == start + 1
    assert (tmp_path / "weights" / f"v{start + 1}" / "weights-manifest.json").is_file()
    cb.on_phase_begin("weight_sync", "both")  # one group for both roles: taken once, given back once
    cb.on_phase_end("weight_sync", "both")
    assert events == [("acquire", "served"), ("release", "served"), ("acquire", "served"), ("release", "served")]
    cb.close()


def test_asyncio_callback_follows_the_same_sequence(env, orch):
    async def main() -> None:
        env.setenv("TIMESLICE_JOB_ID", "job-a")
        env.setenv("TIMESLICE_ORCH_ADDR", orch.target)
        env.setenv("TIMESLICE_TRAINER_GROUP", "trainers")
        env.setenv("TIMESLICE_SAMPLER_GROUP", "samplers")
        cb = await AsyncTimesliceCallback.from_env()
        await cb.on_phase_begin("init", "both")
        assert (_holder(orch, "trainers"), _holder(orch, "samplers")) == ("job-a", "job-a")
        await cb.on_phase_end("init", "both")
        await cb.on_phase_begin("train", "trainer")
        with pytest.raises(UnknownRole):
            await cb.on_phase_begin("train", "learner")
        await cb.on_phase_begin("generate", "sampler")
        await cb.on_phase_end("train", "trainer")
        await cb.on_phase_end("generate", "sampler")
        await cb.close()
        assert _holder(orch, "trainers") is None and _holder(orch, "samplers") is None
        env.delenv("TIMESLICE_ORCH_ADDR")
        with pytest.raises(TimeSliceConfigError, match="TIMESLICE_ORCH_ADDR is not set"):
            await AsyncRoleLocks.from_env()

    orch.loop_thread.run(main())


def test_asyncio_client_lists_groups_reads_status_and_holds_both_groups_in_lock_order(env, orch):
    """The methods the async client had lost (issue 27): list_groups, group_status, fencing_token, on_both_groups."""

    async def main() -> None:
        async with AsyncTimeSliceOrchestratorClient(
            orch.target, job_id="job-c", group_id="trainers", sampler_group_id="samplers", token=TOKEN
        ) as c:
            assert {"trainers", "samplers", "served"} <= set(await c.list_groups())
            assert c.fencing_token() is None
            async with c.on_both_groups() as held:
                assert held is c
                assert (_holder(orch, "trainers"), _holder(orch, "samplers")) == ("job-c", "job-c")
                assert (await c.group_status("samplers")).group.locking_job == "job-c"
                assert c.fencing_token() > 0 and c.fencing_token(group_id="samplers") > 0
            assert _holder(orch, "trainers") is None and _holder(orch, "samplers") is None
            assert c.fencing_token() is None

    orch.loop_thread.run(main())


def test_weights_handed_to_a_sampler_group_without_samplers_are_not_published_and_both_faces_say_so(env, orch, caplog):
    ctx = {"checkpoint_dir": "/ckpt/step-3"}
    cb = TimesliceCallback(_locks(orch, []))
    cb.on_phase_begin("weight_sync", "both")
    with caplog.at_level(logging.WARNING):
        cb.on_phase_end("weight_sync", "both", ctx)
    assert "sampler group 'samplers' has no samplers behind the gate: weights handed to the callback are not" in caplog.text
    cb.close()
    caplog.clear()

    async def main() -> None:
        locks = await AsyncRoleLocks.create("job-a", orch.target, "trainers", "samplers")
        await locks.acquire("trainer")
        await locks.acquire("sampler")
        with caplog.at_level(logging.WARNING):
            await locks.release("sampler", ctx)
        await locks.close()

    orch.loop_thread.run(main())
    assert "sampler group 'samplers' has no samplers behind the gate: weights handed to the callback are not" in caplog.text
    assert _holder(orch, "trainers") is None and _holder(orch, "samplers") is None
