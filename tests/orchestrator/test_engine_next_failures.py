"""The field's next failure kinds (issue 24 §3), against the fake engines over real HTTP, and where the outcome is the
group's, through the real orchestrator, sidecars and gate over gRPC:

1. a vLLM engine left paused after a wake (a ``/pause`` without the matching ``/resume``);
2. a vLLM engine whose ``/sleep`` answers 200 and whose engine core then dies (the API server stays up);
3. an SGLang engine that comes back from a full release answering garbage, and an SGLang release while requests are
   still queued on the engine.

LoRA adapters across sleep levels 1 and 2 run on real vLLM (tests/snapshot/test_snapshot_vllm.py) and, for what the CPU build
cannot play, here too.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from epp_plugin.gate.pool_state import EndpointState
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2_grpc as xpb_grpc
from llmd_timeslice.snapshot.backends.base import BackendError, EngineDead, EnginePaused, SuspendMode
from llmd_timeslice.snapshot.backends.sglang import SglangBackend
from llmd_timeslice.snapshot.backends.vllm import ProbeMismatch, VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from tests.orchestrator.test_engine_field_failures import backend, fake_vllm, group, quick_repair  # noqa: F401 - pytest fixtures
from tests.orchestrator.test_weight_sync import _audited_sampler_at_v1
from tests.support.fake_engines import FakeSglang
from tests.support.waits import until as _until

# ---------------------------------------------------------------- 1. left paused after a wake


async def test_engine_paused_by_another_client_right_after_the_wake_fails_the_wake_and_is_not_resumed(
    fake_vllm,  # noqa: F811
    backend,  # noqa: F811
):
    eng = fake_vllm()
    b = backend(eng)
    await b.suspend(SuspendMode.OFFLOAD, [])
    eng.pause_after_next_wake = True  # another client's POST /pause lands just after the wake; no /resume follows
    eng.calls.clear()
    with pytest.raises(
        EnginePaused,
        match=r"awake but its scheduler is paused .*POST /pause without the matching POST /resume.*stays out of service",
    ):
        await b.resume([])
    assert eng.paused and "/resume" not in eng.paths(), "another client's pause is not lifted behind its back"
    eng.calls.clear()
    with pytest.raises(EnginePaused):  # the repair of an awake engine paused by another client does not touch it
        await b.resume([])
    assert "/wake_up" not in eng.paths(), "on vLLM 0.32 a /wake_up would resume the other client's pause"
    httpx.post(eng.url + "/resume")  # that client is done
    await b.resume([])  # the next repair serves it again: awake, not paused, probe as before
    assert not eng.paused and eng.level == 0


async def test_a_weight_sync_into_an_awake_engine_paused_by_another_client_leaves_it_paused(
    fake_vllm,  # noqa: F811
    backend,  # noqa: F811
    tmp_path,
):
    from llmd_timeslice.weights.update import WeightUpdate

    eng = fake_vllm()
    httpx.post(eng.url + "/pause", params={"mode": "keep"})  # another client, while it serves
    b = backend(eng)  # a restarted sidecar: the engine's state is unknown to it
    with pytest.raises(EnginePaused, match="GET /is_paused: true"):
        await b.resume_with_weights([], WeightUpdate(1, "files", str(tmp_path)))
    assert eng.paused and "/wake_up" not in eng.paths() and "/sleep" not in eng.paths()


async def test_a_wake_that_leaves_the_scheduler_paused_is_not_reported_done(fake_vllm, backend):  # noqa: F811
    eng = fake_vllm()
    eng.wake_resumes_pause = False  # a vLLM whose full wake does not lift the pause (0.32's does: EngineCore.wake_up)
    b = backend(eng)
    await b.suspend(SuspendMode.OFFLOAD, [])  # its POST /pause?mode=abort after the sleep pauses the scheduler
    with pytest.raises(EnginePaused, match=r"GET /is_paused: true"):
        await b.resume([])
    assert "/v1/completions" not in eng.paths()[-3:], "no probe sent to a paused engine (it would wait)"


async def test_a_sampler_left_paused_after_a_wake_is_never_published_serving_and_serves_once_resumed(group):  # noqa: F811
    engines, addrs, orch, gate, client = group
    quick_repair(orch)
    pool = gate.pools["default"]
    await client.acquire(timeout_sec=30)
    engines[0].pause_after_next_wake = True
    await client.release()
    await _until(lambda: pool.serving() == (addrs[1],), what="the other sampler serving")
    g = orch.orchestrator.groups["g"]
    await _until(lambda: addrs[0] in g.sampler_errors, what="the error recorded")
    assert "scheduler is paused" in g.sampler_errors[addrs[0]], g.sampler_errors
    assert pool.endpoints[addrs[0]].state is not EndpointState.SERVING
    assert engines[0].completions_while_asleep == 0, "no request routed to the paused engine"
    httpx.post(engines[0].url + "/resume")  # the other client resumes it: the repair loop (quick_repair) serves it
    await _until(lambda: set(pool.serving()) == set(addrs), timeout_s=15, what="the resumed sampler serving")


# ---------------------------------------------------------------- 2. /sleep answers 200, then the engine core dies


async def test_engine_core_dying_right_after_sleep_answers_200_fails_the_sleep_as_a_dead_engine(fake_vllm, backend):  # noqa: F811
    eng = fake_vllm()
    eng.die_after_next_sleep = True
    b = backend(eng)
    with pytest.raises(EngineDead, match=r"GET /is_sleeping answered 500 .*GET /health answers 503: its engine core is dead"):
        await b.suspend(SuspendMode.OFFLOAD, [])


async def test_engine_core_dying_while_asleep_is_read_as_a_dead_engine_by_the_audit_and_the_next_wake(fake_vllm):  # noqa: F811
    eng = fake_vllm()
    b = VllmBackend(eng.url, idle_timeout_s=1, memory_reader=lambda: None)
    srv = SidecarServer({"s": b}, port=0)
    await srv.start()
    try:
        await b.suspend(SuspendMode.OFFLOAD, [])  # verified asleep; then the core dies (OOM killer, a crash)
        eng.core_dead = True
        assert "weights_offloaded" in httpx.get(eng.url + "/metrics").text, "its metrics still say asleep"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            r = await xpb_grpc.SnapshotOperationsServiceStub(ch).GetServedWeightVersion(
                xpb.GetServedWeightVersionRequest(job_id="s"), timeout=10
            )
        assert "engine core is dead" in r.engine_unreachable, r  # the engine audit reads it, not skips it
        with pytest.raises(EngineDead):
            await b.resume([])
    finally:
        await srv.stop()


async def test_a_dead_engine_core_while_asleep_is_found_at_the_wake_and_repaired_once_the_engine_restarts(group):  # noqa: F811
    engines, addrs, orch, gate, client = group
    quick_repair(orch)
    pool = gate.pools["default"]
    await client.acquire(timeout_sec=30)
    engines[0].core_dead = True  # died while the trainer held the accelerators
    await client.release()
    await _until(lambda: pool.serving() == (addrs[1],), what="the other sampler serving")
    g = orch.orchestrator.groups["g"]
    await _until(lambda: addrs[0] in g.sampler_errors, what="the error recorded")
    assert "engine core is dead" in g.sampler_errors[addrs[0]], g.sampler_errors
    engines[0].restart()  # kubelet restarts the container: a live core, awake
    await _until(lambda: set(pool.serving()) == set(addrs), timeout_s=20, what="the restarted sampler serving")


async def test_a_dead_engine_core_behind_a_live_api_server_is_taken_out_of_service_by_the_engine_audit(tmp_path):
    async with _audited_sampler_at_v1(tmp_path, 0.3) as st:
        engine, addr, pool, g = st.engine, st.addr, st.pool, st.g
        engine.core_dead = True  # serving, with VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1: the API server answers 500s
        await _until(lambda: pool.serving() == (), timeout_s=5, what="out of service")
        await _until(lambda: addr in g.sampler_errors, timeout_s=5, what="the error recorded")
        assert "engine core is dead" in g.sampler_errors[addr], g.sampler_errors
        await asyncio.sleep(0.5)
        engine.restart()  # back with its initial weights: repaired at the group's version
        await _until(lambda: pool.serving(min_version=1) == (addr,) and not g.sampler_errors, timeout_s=20)
        assert engine.weight_version == "1"


# ---------------------------------------------------------------- 3. SGLang: garbage after a full release, busy release


@pytest.fixture
async def sglang():
    made: list[tuple[FakeSglang, SglangBackend]] = []

    def make(**kw) -> tuple[FakeSglang, SglangBackend]:
        eng = FakeSglang().start()
        made.append((eng, SglangBackend(eng.url, **{"memory_reader": lambda: None, "idle_timeout_s": 1, **kw})))
        return made[-1]

    yield make
    for eng, b in made:
        await b.close()
        eng.stop()


async def test_sglang_engine_answering_garbage_after_a_full_release_fails_the_probe_and_is_released_again(sglang):
    eng, b = sglang()
    await b.suspend(SuspendMode.DISCARD, [])  # idle: the reference of its weight version, recorded before the release
    assert set(b.probe_references) == {"default"}
    await b.resume([])  # same tokens: served
    await b.suspend(SuspendMode.DISCARD, [])
    eng.garble_next_resume = True  # answers (HTTP 200, text present) but other tokens: the old check passed this
    with pytest.raises(ProbeMismatch, match=r"answers the probe prompts differently from weight version default's"):
        await b.resume([])
    assert eng.released == set(FakeSglang.ALL_TAGS) and await b.is_suspended(), "released again, not serving garbage"
    eng.restart()  # its pod restarted: the right weights again
    await b.resume([])
    assert not eng.released and not await b.is_suspended()


async def test_sglang_release_waits_for_the_requests_still_queued_on_the_engine(sglang):
    eng, b = sglang(idle_timeout_s=10)
    eng.queue(3, for_s=0.4)  # straight to the engine, or left when the drain ended
    await b.suspend(SuspendMode.OFFLOAD, [])
    assert eng.released_while_busy == 0 and eng.aborted == 0, "waited for them to finish; none cut"
    assert "/pause_generation" not in eng.paths()


async def test_sglang_release_of_an_engine_still_busy_after_the_idle_timeout_pauses_it_first(sglang):
    eng, b = sglang(idle_timeout_s=0.2)
    eng.queue(2, for_s=60)
    await b.suspend(SuspendMode.OFFLOAD, [])
    assert ("POST", "/pause_generation", {"mode": "abort"}) in eng.calls
    assert eng.released_while_busy == 0 and eng.aborted == 2 and eng.released
    await b.resume([])
    posts = eng.paths()
    assert posts.index("/continue_generation") < len(posts) - 1 and posts[-1] == "/generate", posts
    assert not eng.paused, "generation continued after the resume, before the probe"


async def test_sglang_without_load_metrics_pauses_before_every_release(sglang):
    eng, b = sglang()
    eng.metrics = False  # no --enable-metrics: the load is unknown
    await b.suspend(SuspendMode.OFFLOAD, [])
    assert ("POST", "/pause_generation", {"mode": "abort"}) in eng.calls
    await b.resume([])
    assert not eng.paused


async def test_sglang_release_refused_after_a_pause_continues_generation(sglang):
    eng, b = sglang(idle_timeout_s=0.1)
    eng.queue(1, for_s=60)
    eng.fail_release = True
    with pytest.raises(BackendError, match="answered 400"):
        await b.suspend(SuspendMode.OFFLOAD, [])
    assert not eng.paused, "a failed release leaves generation running, not paused"


def test_sglang_pause_mode_is_checked_and_maps_the_vllm_modes():
    assert SglangBackend("http://127.0.0.1:1", pause_mode="keep").pause_mode == "retract"
    assert SglangBackend("http://127.0.0.1:1", pause_mode="wait").pause_mode == "abort"
    with pytest.raises(ValueError, match="SGLang pause_mode must be one of"):
        SglangBackend("http://127.0.0.1:1", pause_mode="in_place")


# ---------------------------------------------------------------- 4. LoRA adapters (what the CPU build cannot play)


async def test_lora_adapter_answering_wrong_after_a_wake_fails_the_probe_naming_it_and_the_reload_repairs_it(
    fake_vllm,  # noqa: F811
    backend,  # noqa: F811
):
    eng = fake_vllm()
    eng.lora_adapters = ["ad-a", "ad-b"]
    b = backend(eng)
    await b.suspend(SuspendMode.DISCARD, [])  # references of the base model and of each adapter, before sleeping
    assert set(b.probe_references[0]) == {"fake", "ad-a", "ad-b"}
    await b.resume([])
    await b.suspend(SuspendMode.OFFLOAD, [])
    eng.garble_adapter_next_wake = "ad-b"  # its slot's memory lost (a GPU discard) and not reloaded: base model fine
    with pytest.raises(ProbeMismatch, match=r"through LoRA adapter 'ad-b' ->"):
        await b.resume([])
    assert eng.level == 2, "put back to sleep: the next restore reloads the weights (vLLM resets its LoRA state then)"
    await b.resume([])
    assert eng.level == 0 and not eng.garbled_adapter


async def test_lora_adapter_unloaded_while_asleep_is_forgotten_with_a_warning_not_a_failed_wake(
    fake_vllm,  # noqa: F811
    backend,  # noqa: F811
    caplog,
):
    eng = fake_vllm()
    eng.lora_adapters = ["ad-a"]
    b = backend(eng)
    await b.suspend(SuspendMode.OFFLOAD, [])
    eng.lora_adapters = []  # POST /v1/unload_lora_adapter while it slept: its requests get vLLM's 404
    await b.resume([])
    assert "no longer serves LoRA adapter 'ad-a'" in caplog.text
    assert set(b.probe_references[0]) == {"fake"}
