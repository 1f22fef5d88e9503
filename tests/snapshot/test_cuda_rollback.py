"""A process snapshot that fails halfway is rolled back (issue 38 §3): the cuda-checkpoint backend against the
stand-in CLI (tests/support/fake_cuda_checkpoint.py: no driver here) on two real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmd_timeslice.cli import app
from llmd_timeslice.snapshot.backends.base import BackendError, SuspendMode
from llmd_timeslice.snapshot.backends.cuda import CudaCheckpointBackend, UnsupportedWorkload, unsupported_reason

FAKE_CLI = Path(__file__).parents[1] / "support" / "fake_cuda_checkpoint.py"


@pytest.fixture
def cuda_cli(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_STATE_DIR", str(tmp_path))
    exe = tmp_path / "cuda-checkpoint"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_CLI} "$@"\n')
    exe.chmod(0o755)
    return exe


@pytest.fixture
def two_pids():
    procs = [subprocess.Popen(["sleep", "300"]) for _ in range(2)]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


def states(cli: Path, pids: list[int]) -> list[str]:
    return [(cli.parent / str(p)).read_text() if (cli.parent / str(p)).exists() else "running" for p in pids]


@pytest.mark.parametrize("api", ["action", "toggle"])
async def test_a_checkpoint_failing_on_the_second_of_two_pids_leaves_both_running(cuda_cli, two_pids, monkeypatch, api):
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_API", api)
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_FAIL_PID", str(two_pids[1]))
    b = CudaCheckpointBackend(two_pids, binary=str(cuda_cli), api=api, timeout_s=20)
    with pytest.raises(BackendError) as caught:
        await b.suspend(SuspendMode.OFFLOAD, [])
    msg = str(caught.value)
    assert f"Could not checkpoint process {two_pids[1]}: OS call failed" in msg  # the tool's own words
    assert f"rolled back: pid(s) {sorted(two_pids)} running again" in msg
    assert states(cuda_cli, two_pids) == ["running", "running"]
    assert not await b.is_suspended()


async def test_a_resume_from_locked_unlocks(cuda_cli, two_pids, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_API", "action")
    (cuda_cli.parent / str(two_pids[0])).write_text("locked")  # a suspend cut short (the sidecar was killed)
    b = CudaCheckpointBackend(two_pids, binary=str(cuda_cli), api="action", timeout_s=20)
    await b.resume([])
    assert states(cuda_cli, two_pids) == ["running", "running"]
    calls = (cuda_cli.parent / "calls.log").read_text().splitlines()
    assert calls == [f"--action unlock --pid {two_pids[0]}"]


async def test_a_hang_in_get_state_times_out_with_a_named_reason(cuda_cli, two_pids, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_API", "action")
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_HANG_GET_STATE", "30")
    b = CudaCheckpointBackend(two_pids, binary=str(cuda_cli), api="action", state_timeout_s=0.5)
    with pytest.raises(BackendError, match=r"--get-state --pid \d+ took more than 0\.5 s and was killed .*cuda-checkpoint#45"):
        await b.suspend(SuspendMode.OFFLOAD, [])


def test_nccl_mapped_into_the_process_is_refused_at_start(tmp_path):
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"\0" * 4096)
    code = (
        f"import mmap, time; f = open({str(lib)!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); "
        "print(1, flush=True); time.sleep(300)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"1"
        with pytest.raises(UnsupportedWorkload, match=r"libnccl\.so\.2 mapped: NCCL .*does not support UVM or IPC memory"):
            CudaCheckpointBackend([proc.pid], binary="cuda-checkpoint")
        r = CliRunner().invoke(app, ["sidecar", "--job-id", "j", "--port", "0", "--backend", "cuda", "--pid", str(proc.pid)])
        assert r.exit_code == 2 and "libnccl.so.2 mapped" in r.output, r.output
    finally:
        proc.kill()
        proc.wait()


def test_a_node_that_is_not_x86_64_is_refused():
    assert "x64 only" in unsupported_reason([], machine="aarch64")
    assert unsupported_reason([], machine="x86_64") is None
