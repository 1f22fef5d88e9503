"""A sleep counts only when the memory is really free (issue 38 §1): the residual after each sleep, read through the
NVML adapter over a fake ``pynvml`` (tests/support/fake_nvml.py: no GPU here), polled until it settles, checked
against a budget, in the figures of the field reports the inputs are named after."""

from __future__ import annotations

import logging

import pytest
from grpc import aio

from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2_grpc as xpb_grpc
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from llmd_timeslice.snapshot.backends import device_memory
from llmd_timeslice.snapshot.backends.base import SuspendMode
from llmd_timeslice.snapshot.backends.device_memory import NvmlMemory, engine_pids, open_nvml
from llmd_timeslice.snapshot.backends.sglang import SglangBackend
from llmd_timeslice.snapshot.backends.sleep_memory import GIB, MemoryNotFreed, SleepMemoryCheck
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from tests.support.fake_engines import FakeSglang, FakeVllm
from tests.support.fake_nvml import FakeNvml

PID = 4242  # the engine's process as NVML lists it
HELD = 70 * GIB  # what the engine holds while serving
# The scripted readings keep their last value: a residual over budget stays over it, so the check's verdict is the
# same after 0.2 s of polling as after 60 s (the product default); a residual within budget ends the wait at once.
FAST = {"memory_poll_s": 0.01, "memory_settle_timeout_s": 0.2, "engine_pids": [PID]}


@pytest.fixture
def engine():
    eng = FakeVllm().start()
    yield eng
    eng.stop()


async def cycle(b: VllmBackend, nvml: FakeNvml, residual: int):
    """One sleep whose engine held HELD before it and ``residual`` after, then a wake when it was verified."""
    nvml.script(PID, HELD, residual)
    try:
        return await b.suspend(SuspendMode.OFFLOAD, [])
    finally:
        await b.resume([])


async def test_residuals_growing_4_11_25_gib_are_refused_by_the_third_sleep_with_the_figures(engine):
    nvml = FakeNvml()
    b = VllmBackend(engine.url, probe=False, nvml=nvml, residual_margin_bytes=8 * GIB, **FAST)
    try:
        first = await cycle(b, nvml, 4 * GIB)
        assert first.residual.bytes == 4 * GIB and first.residual.scope == "process" and first.residual.budget is None
        second = await cycle(b, nvml, 11 * GIB)  # within 4 GiB + 8 GiB margin
        assert second.residual.budget == 12 * GIB
        with pytest.raises(MemoryNotFreed) as caught:
            await cycle(b, nvml, 25 * GIB)
        msg = str(caught.value)
        assert "still holds 25.00 GiB" in msg and "budget of 12.00 GiB" in msg
        assert "first verified sleep's 4.00 GiB + 8.00 GiB margin" in msg and "per process" in msg
        assert caught.value.residual.bytes == 25 * GIB
    finally:
        await b.close()


async def test_default_margin_refuses_the_second_of_4_then_11_gib(engine):
    nvml = FakeNvml()
    b = VllmBackend(engine.url, probe=False, nvml=nvml, **FAST)  # margin 1 GiB
    try:
        await cycle(b, nvml, 4 * GIB)
        with pytest.raises(MemoryNotFreed, match=r"still holds 11\.00 GiB .*budget of 5\.00 GiB"):
            await cycle(b, nvml, 11 * GIB)
    finally:
        await b.close()


async def test_a_sleep_that_frees_0_bytes_is_refused(engine):
    nvml = FakeNvml()
    b = VllmBackend(engine.url, probe=False, nvml=nvml, **FAST)
    try:
        with pytest.raises(MemoryNotFreed, match=r"still holds 70\.00 GiB .*freed 0\.00 GiB of 70\.00 GiB \(0% < 50%\)"):
            await cycle(b, nvml, HELD)
    finally:
        await b.close()


async def test_a_slowly_settling_free_is_verified_once_it_settles(engine):
    """SGLang-style early 200: the memory stays held for a few readings after the answer, then is freed."""
    nvml = FakeNvml()
    b = VllmBackend(engine.url, probe=False, nvml=nvml, memory_poll_s=0.0, memory_settle_timeout_s=30, engine_pids=[PID])
    try:
        nvml.script(PID, HELD, *[HELD] * 6, 9 * GIB, 3 * GIB, 3 * GIB)
        res = await b.suspend(SuspendMode.OFFLOAD, [])
        assert res.residual.bytes == 3 * GIB and res.device_bytes_freed == HELD - 3 * GIB
        assert b.memory.first_residual == {1: 3 * GIB}  # the settled figure is the baseline, not 9 GiB
    finally:
        await b.close()


async def test_an_absolute_budget_per_level_from_the_group_wins(engine):
    nvml = FakeNvml()
    b = VllmBackend(engine.url, probe=False, nvml=nvml, **FAST)
    try:
        nvml.script(PID, HELD, 3 * GIB)
        with pytest.raises(MemoryNotFreed, match=r"budget of 2\.00 GiB .*the group's residual_budget_bytes"):
            await b.suspend(SuspendMode.OFFLOAD, [], residual_budget_bytes=2 * GIB)
    finally:
        await b.close()


async def test_engine_pids_not_listed_falls_back_to_the_device_and_says_so(engine):
    """In a pod without hostPID, NVML's pids are not the pod's: the device's used memory is read instead."""
    nvml = FakeNvml(other_bytes=2 * GIB)
    b = VllmBackend(engine.url, probe=False, nvml=nvml, memory_poll_s=0.01, memory_settle_timeout_s=0.2, engine_pids=[1])
    try:
        nvml.script(PID, HELD, HELD)
        with pytest.raises(MemoryNotFreed, match=r"72\.00 GiB .*the device's used memory"):
            await b.suspend(SuspendMode.OFFLOAD, [])
    finally:
        await b.close()


def test_a_process_gone_from_nvml_after_the_sleep_holds_0_bytes():
    nvml = FakeNvml()
    nvml.script(PID, HELD, None)
    source = NvmlMemory(open_nvml(nvml), pids=[PID])
    before = source(None)
    assert before.scope == "process" and before.bytes == HELD
    assert source("process").bytes == 0


async def test_sglang_early_200_release_is_checked_the_same_way():
    eng = FakeSglang().start()
    nvml = FakeNvml()
    b = SglangBackend(eng.url, probe=False, nvml=nvml, **FAST)
    try:
        nvml.script(PID, HELD, HELD)
        with pytest.raises(MemoryNotFreed, match=r"SGLang .* freed 0\.00 GiB"):
            await b.suspend(SuspendMode.OFFLOAD, [])
    finally:
        await b.close()
        eng.stop()


def test_without_nvml_one_line_says_memory_is_not_checked(monkeypatch, caplog):
    monkeypatch.setattr(device_memory, "_said_unavailable", type(device_memory._said_unavailable)())
    with caplog.at_level(logging.WARNING, logger=device_memory.__name__):
        assert open_nvml(FakeNvml(fail_init="Driver Not Loaded")) is None
        assert open_nvml(FakeNvml(fail_init="Driver Not Loaded")) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "NOT checked" in lines[0] and "Driver Not Loaded" in lines[0]


async def test_without_nvml_sleeps_are_verified_as_before(engine, monkeypatch):
    b = VllmBackend(engine.url, probe=False, nvml=FakeNvml(fail_init="Driver Not Loaded"))
    try:
        assert b.memory.source is None
        res = await b.suspend(SuspendMode.OFFLOAD, [])
        assert res.residual is None and res.device_bytes_freed is None
        await b.resume([])
    finally:
        await b.close()


def test_bad_check_settings_are_refused():
    with pytest.raises(ValueError, match="min_freed_fraction"):
        SleepMemoryCheck(None, min_freed_fraction=1.5)
    with pytest.raises(ValueError, match="settle_reads"):
        SleepMemoryCheck(None, settle_reads=1)


def test_engine_pids_finds_the_listener_on_a_local_port():
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert os.getpid() in engine_pids(f"http://127.0.0.1:{port}")
    assert engine_pids("http://10.0.0.7:8000") == []


async def test_sidecar_sends_the_group_budget_and_exports_each_residual(engine):
    from prometheus_client import REGISTRY

    nvml = FakeNvml()
    srv = SidecarServer({"s": VllmBackend(engine.url, probe=False, nvml=nvml, **FAST)}, port=0)
    await srv.start()
    ch = aio.insecure_channel(f"127.0.0.1:{srv.port}")
    stub, ops = pb_grpc.SnapshotAgentServiceStub(ch), xpb_grpc.SnapshotOperationsServiceStub(ch)

    async def snapshot(**kw):
        op = (await stub.Snapshot(pb.SnapshotRequest(job_id="s", **kw))).operation_id
        return await ops.WaitOperation(xpb.WaitOperationRequest(operation_id=op, timeout_s=10))

    def sample(name):
        return REGISTRY.get_sample_value(name, {"job_id": "s", "level": "1"})

    try:
        over_before = sample("llmd_timeslice_sidecar_sleeps_over_budget_total") or 0
        nvml.script(PID, HELD, 3 * GIB)
        r = await snapshot(device_residual_budget_bytes=4 * GIB)
        assert r.status == pb.OPERATION_STATUS_COMPLETE
        assert sample("llmd_timeslice_sidecar_sleep_residual_bytes") == 3 * GIB
        assert sample("llmd_timeslice_sidecar_sleep_residual_budget_bytes") == 4 * GIB
        await stub.Restore(pb.RestoreRequest(job_id="s"))
        await srv.servicer.finish_operations(10)
        nvml.script(PID, HELD, 5 * GIB)
        r = await snapshot(device_residual_budget_bytes=4 * GIB)
        assert r.status == pb.OPERATION_STATUS_FAILED and "still holds 5.00 GiB" in r.error
        assert sample("llmd_timeslice_sidecar_sleep_residual_bytes") == 5 * GIB
        assert sample("llmd_timeslice_sidecar_sleeps_over_budget_total") == over_before + 1
    finally:
        await ch.close()
        await srv.stop()
