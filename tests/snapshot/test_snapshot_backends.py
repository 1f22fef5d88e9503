"""Snapshot backends against small fakes: a vLLM that lies, SGLang's dialect, the cuda-checkpoint CLI.

Real vLLM is covered in tests/snapshot/test_snapshot_vllm.py; these cover what it cannot show here
(an engine that answers 200 and does nothing, device memory, SGLang, cuda-checkpoint).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

import pytest

from llmd_timeslice.snapshot.backends.base import BackendError, SuspendMode
from llmd_timeslice.snapshot.backends.cuda import CudaCheckpointBackend
from llmd_timeslice.snapshot.backends.device_memory import device_reader, open_nvml
from llmd_timeslice.snapshot.backends.sglang import SglangBackend
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from tests.support.fake_engines import FakeSglang, FakeVllm

FAKE_CLI = Path(__file__).parents[1] / "support" / "fake_cuda_checkpoint.py"


@pytest.fixture
def fake_vllm():
    engines: list[FakeVllm] = []

    def make(**kw) -> FakeVllm:
        engines.append(FakeVllm(**kw).start())
        return engines[-1]

    yield make
    for e in engines:
        e.stop()


async def test_engine_that_answers_sleep_200_but_stays_awake_fails_the_snapshot(fake_vllm):
    eng = fake_vllm(lie_on_sleep=True)
    b = VllmBackend(eng.url, memory_reader=lambda: None)
    try:
        with pytest.raises(BackendError, match="200 but /is_sleeping says awake"):
            await b.suspend(SuspendMode.OFFLOAD, [])
    finally:
        await b.close()


async def test_engine_that_answers_wake_200_but_stays_asleep_fails_the_restore(fake_vllm):
    eng = fake_vllm(lie_on_wake=True)
    b = VllmBackend(eng.url, memory_reader=lambda: None)
    try:
        await b.suspend(SuspendMode.OFFLOAD, [])  # (records the probe reference before sleeping)
        eng.calls.clear()
        with pytest.raises(BackendError, match="still says asleep"):
            await b.resume([])
        assert "/v1/completions" not in eng.paths(), "no probe once verification failed"
    finally:
        await b.close()


async def test_level2_wake_reloads_weights_then_kv_cache_then_resets_prefix_cache(fake_vllm):
    eng = fake_vllm()
    b = VllmBackend(eng.url, memory_reader=lambda: None)
    try:
        await b.suspend(SuspendMode.DISCARD, [])
        assert ("POST", "/sleep", {"level": "2", "mode": "wait"}) in eng.calls
        eng.calls.clear()
        await b.resume([])
        posts = [(p, q) for m, p, q in eng.calls if m == "POST"]
        assert posts == [
            ("/wake_up", {"tags": "weights"}),
            ("/collective_rpc", {"method": "reload_weights"}),
            ("/wake_up", {"tags": "kv_cache"}),
            ("/reset_prefix_cache", {}),
            ("/v1/completions", posts[-1][1]),
        ]
    finally:
        await b.close()


async def test_sidecar_restart_between_sleep_and_wake_reads_the_level_from_the_engine(fake_vllm):
    eng = fake_vllm()
    b1, b2 = VllmBackend(eng.url, memory_reader=lambda: None), VllmBackend(eng.url, memory_reader=lambda: None)
    try:
        await b1.suspend(SuspendMode.DISCARD, [])
        await b2.resume([])  # a fresh backend: level 2 learned from vllm:engine_sleep_state
        assert "/collective_rpc" in eng.paths()
    finally:
        await b1.close()
        await b2.close()


async def test_device_memory_check_with_an_injected_reader(fake_vllm):
    eng = fake_vllm()
    readings = iter([10_000, 9_000])  # before, after: only 10 % freed
    fast = {"memory_poll_s": 0.0, "memory_settle_timeout_s": 0.5}
    b = VllmBackend(eng.url, memory_reader=lambda: next(readings, 9_000), min_freed_fraction=0.5, **fast)
    try:
        with pytest.raises(BackendError, match=r"freed 0\.00 GiB of 0\.00 GiB \(10% < 50%\)"):
            await b.suspend(SuspendMode.OFFLOAD, [])
        await b.resume([])
        readings = iter([10_000, 1_000])
        b.memory.source = device_reader(lambda: next(readings, 1_000))
        res = await b.suspend(SuspendMode.OFFLOAD, [])
        assert res.device_bytes_freed == 9_000
    finally:
        await b.close()


def test_nvml_is_none_without_nvidia_ml_py_or_a_driver():
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert open_nvml() is None
    else:  # pragma: no cover - only where nvidia-ml-py is installed
        open_nvml()  # None without a driver; never raises


def test_bad_pause_mode_is_refused():
    with pytest.raises(ValueError, match="pause_mode"):
        VllmBackend("http://127.0.0.1:1", pause_mode="later")


async def test_sglang_release_and_resume_with_json_tags_and_a_probe():
    eng = FakeSglang().start()
    b = SglangBackend(eng.url, memory_reader=lambda: None)
    try:
        await b.suspend(SuspendMode.OFFLOAD, [])
        assert eng.calls[-1] == ("POST", "/release_memory_occupation", {"tags": None})
        assert eng.released == set(FakeSglang.ALL_TAGS) and await b.is_suspended()
        await b.resume([])
        assert eng.released == set() and not await b.is_suspended()
        assert eng.paths()[-1] == "/generate"
        eng.calls.clear()
        await b.suspend(SuspendMode.DISCARD, ["weights", "kv_cache"])
        await b.resume(["weights"])  # partial: no probe yet
        assert eng.paths() == ["/release_memory_occupation", "/resume_memory_occupation"]
        await b.resume(["kv_cache"])
        posts = [c for c in eng.calls if c[0] == "POST"]
        assert posts[-2] == ("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})
        assert eng.paths()[-1] == "/generate"
    finally:
        await b.close()
        eng.stop()


async def test_sglang_error_answer_fails_with_what_to_do():
    eng = FakeSglang(fail_release=True).start()
    b = SglangBackend(eng.url, memory_reader=lambda: None)
    try:
        with pytest.raises(BackendError, match=r"answered 400.*--enable-memory-saver"):
            await b.suspend(SuspendMode.OFFLOAD, [])
    finally:
        await b.close()
        eng.stop()


@pytest.fixture
def cuda_cli(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_STATE_DIR", str(tmp_path))
    exe = tmp_path / "cuda-checkpoint"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_CLI} "$@"\n')
    exe.chmod(0o755)
    return exe


@pytest.mark.parametrize("api", ["toggle", "action"])
async def test_cuda_checkpoint_round_trip_verified_by_get_state(cuda_cli, monkeypatch, api):
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_API", api)
    b = CudaCheckpointBackend([os.getpid()], binary=str(cuda_cli), timeout_s=20)
    await b.suspend(SuspendMode.OFFLOAD, [])
    assert await b.is_suspended()
    await b.resume([])
    assert not await b.is_suspended()
    calls = (cuda_cli.parent / "calls.log").read_text().splitlines()
    if api == "action":
        assert [c.split()[1] for c in calls] == ["lock", "checkpoint", "restore", "unlock"]
    else:
        assert calls == [f"--toggle --pid {os.getpid()}"] * 2


async def test_cuda_checkpoint_missing_binary_says_what_to_install():
    b = CudaCheckpointBackend([os.getpid()], binary="/nonexistent/cuda-checkpoint")
    with pytest.raises(BackendError, match=r"not found.*install NVIDIA's cuda-checkpoint"):
        await b.suspend(SuspendMode.OFFLOAD, [])


async def test_cuda_checkpoint_without_driver_says_so(cuda_cli, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_FAIL", "driver")
    b = CudaCheckpointBackend([os.getpid()], binary=str(cuda_cli), api="toggle")
    with pytest.raises(BackendError, match="no usable NVIDIA driver"):
        await b.suspend(SuspendMode.OFFLOAD, [])


async def test_cuda_checkpoint_timeout_and_lie_and_unknown_pid(cuda_cli, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_HANG", "5")
    b = CudaCheckpointBackend([os.getpid()], binary=str(cuda_cli), api="toggle", timeout_s=0.5, state_timeout_s=0.5)
    with pytest.raises(BackendError, match=r"took more than 0\.5 s and was killed"):
        await b.suspend(SuspendMode.OFFLOAD, [])
    monkeypatch.delenv("FAKE_CUDA_CHECKPOINT_HANG")
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_LIE", "1")
    b = CudaCheckpointBackend([os.getpid()], binary=str(cuda_cli), api="toggle")
    with pytest.raises(BackendError, match="returned 0 but its state is 'running'"):
        await b.suspend(SuspendMode.OFFLOAD, [])
    b = CudaCheckpointBackend([2**22 + 12345], binary=str(cuda_cli), api="toggle")
    with pytest.raises(BackendError, match="Could not find process"):
        await b.suspend(SuspendMode.OFFLOAD, [])
    with pytest.raises(BackendError, match="only offloads"):
        await b.suspend(SuspendMode.DISCARD, [])


async def test_sidecar_reports_device_bytes_freed_and_faults_a_lying_engine(fake_vllm):
    from grpc import aio

    from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
    from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2_grpc as xpb_grpc
    from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
    from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
    from llmd_timeslice.snapshot.server import SidecarServer

    good, liar = fake_vllm(), fake_vllm(lie_on_wake=True)
    readings = iter([8_000, 1_000])
    srv = SidecarServer(
        {
            "good": VllmBackend(good.url, memory_reader=lambda: next(readings, 1_000)),
            "liar": VllmBackend(liar.url, memory_reader=lambda: None),
        },
        port=0,
    )
    await srv.start()
    ch = aio.insecure_channel(f"127.0.0.1:{srv.port}")
    stub, ops = pb_grpc.SnapshotAgentServiceStub(ch), xpb_grpc.SnapshotOperationsServiceStub(ch)

    async def run(rpc, req):
        op = (await rpc(req)).operation_id
        return await ops.WaitOperation(xpb.WaitOperationRequest(operation_id=op, timeout_s=10))

    try:
        r = await run(stub.Snapshot, pb.SnapshotRequest(job_id="good"))
        assert r.status == pb.OPERATION_STATUS_COMPLETE and r.snapshot_device_bytes == 7_000
        assert (await run(stub.Snapshot, pb.SnapshotRequest(job_id="liar"))).status == pb.OPERATION_STATUS_COMPLETE
        r = await run(stub.Restore, pb.RestoreRequest(job_id="liar"))
        assert r.status == pb.OPERATION_STATUS_FAILED and "still says asleep" in r.error
        states = {s.job_id: s.state for s in (await stub.Status(pb.StatusRequest())).job_statuses}
        assert states == {"good": pb.JOB_STATE_SAVED, "liar": pb.JOB_STATE_FAULTED}
    finally:
        await ch.close()
        await srv.stop()


async def test_sidecar_stop_lets_a_running_operation_finish_then_cancels_one_past_the_grace(fake_vllm, caplog):
    """Stopping the sidecar mid-operation: within the grace the sleep completes; past it the operation is
    cancelled and reported FAILED (never left RUNNING, never a call on a closed HTTP client)."""
    from grpc import aio

    from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
    from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
    from llmd_timeslice.snapshot.server import SidecarServer

    for grace_s, slow_s, want in ((5.0, 0.3, pb.OPERATION_STATUS_COMPLETE), (0.2, 3.0, pb.OPERATION_STATUS_FAILED)):
        engine = fake_vllm(sleep_delay_s=slow_s)
        srv = SidecarServer({"s": VllmBackend(engine.url, idle_timeout_s=0.1)}, port=0)
        await srv.start()
        async with aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            op_id = (await pb_grpc.SnapshotAgentServiceStub(ch).Snapshot(pb.SnapshotRequest(job_id="s"))).operation_id
        await asyncio.sleep(0.1)
        with caplog.at_level(logging.ERROR, logger="llmd_timeslice.snapshot.server"):
            await srv.stop(operation_grace_s=grace_s)
        op = srv.servicer.operations[op_id]
        assert op.done.is_set() and op.status == want, (grace_s, op.status, op.error)
        assert "crashed" not in caplog.text
        if want == pb.OPERATION_STATUS_FAILED:
            assert "sidecar is stopping" in op.error and srv.servicer.states["s"] == "FAULTED"


async def test_served_weight_version_rpc_answers_each_bad_input_with_its_status(fake_vllm, tmp_path):
    """GetServedWeightVersion: empty job id -> INVALID_ARGUMENT, unknown job -> NOT_FOUND, a backend without
    weight versions (cuda-checkpoint) -> FAILED_PRECONDITION, an engine that answers nonsense -> UNAVAILABLE
    (no verdict); an engine that refuses connections -> engine_unreachable; a live engine -> its own label."""
    import grpc
    from grpc import aio

    from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
    from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2_grpc as xpb_grpc
    from llmd_timeslice.snapshot.server import SidecarServer

    live, dead = fake_vllm(), fake_vllm()
    dead.kill()
    not_vllm = FakeSglang().start()  # no /weight_info, no /is_sleeping
    srv = SidecarServer(
        {
            "live": VllmBackend(live.url),
            "dead": VllmBackend(dead.url),
            "odd": VllmBackend(not_vllm.url),
            "cuda": CudaCheckpointBackend(pids=[1], binary=str(tmp_path / "none")),
        },
        port=0,
    )
    await srv.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = xpb_grpc.SnapshotOperationsServiceStub(ch)
            r = await stub.GetServedWeightVersion(xpb.GetServedWeightVersionRequest(job_id="live"), timeout=10)
            assert (r.weight_version, r.known, r.sleeping, r.engine_unreachable) == ("default", True, False, "")
            r = await stub.GetServedWeightVersion(xpb.GetServedWeightVersionRequest(job_id="dead"), timeout=10)
            assert "did not answer" in r.engine_unreachable and not r.known
            for job, code in (
                ("", grpc.StatusCode.INVALID_ARGUMENT),
                ("nobody", grpc.StatusCode.NOT_FOUND),
                ("cuda", grpc.StatusCode.FAILED_PRECONDITION),
                ("odd", grpc.StatusCode.UNAVAILABLE),
            ):
                with pytest.raises(aio.AioRpcError) as e:
                    await stub.GetServedWeightVersion(xpb.GetServedWeightVersionRequest(job_id=job), timeout=10)
                assert e.value.code() is code and e.value.details(), (job, e.value.code())
    finally:
        await srv.stop()
        not_vllm.stop()


async def test_a_level1_wake_resets_the_prefix_cache_and_an_awake_engine_is_not_reset(fake_vllm):
    """Issue 38 §4: level 1 frees the KV cache too, so cached prefixes must not point at discarded blocks."""
    eng = fake_vllm()
    b = VllmBackend(eng.url, memory_reader=lambda: None)
    try:
        await b.suspend(SuspendMode.OFFLOAD, [])
        await b.resume([])
        posts = eng.paths()
        assert posts.index("/reset_prefix_cache") > posts.index("/wake_up")
        n = posts.count("/reset_prefix_cache")
        await b.resume([])  # already awake: nothing was discarded, nothing to reset
        assert eng.paths().count("/reset_prefix_cache") == n
    finally:
        await b.close()
