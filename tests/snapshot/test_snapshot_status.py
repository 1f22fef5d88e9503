"""The sidecar's Status reports job states and accelerator memory (NVML reader injected: no GPU here)."""

from __future__ import annotations

import grpc

from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from llmd_timeslice.snapshot.accelerators import Accelerator, nvml_accelerators
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer


async def test_status_lists_jobs_and_accelerator_memory():
    srv = SidecarServer({"sampler-0": VllmBackend("http://127.0.0.1:9")}, port=0, token="t")
    srv.servicer.accelerator_reader = lambda: [Accelerator("GPU-0", 3 << 30, 80 << 30)]
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            r = await pb_grpc.SnapshotAgentServiceStub(ch).Status(pb.StatusRequest(), metadata=(("authorization", "Bearer t"),))
        assert [(j.job_id, j.state) for j in r.job_statuses] == [("sampler-0", pb.JOB_STATE_RUNNING)]
        assert [(a.id, a.memory_used_bytes, a.memory_total_bytes) for a in r.accelerator_statuses] == [
            ("GPU-0", 3 << 30, 80 << 30)
        ]
    finally:
        await srv.stop()


def test_without_nvml_no_reader_and_no_error():
    assert nvml_accelerators() is None  # this machine: no nvidia-ml-py / no driver
