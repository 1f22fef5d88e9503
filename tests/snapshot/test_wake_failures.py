"""A wake that fails the same way every time is not retried forever (issue 38 §4; e.g. a crash on the first request
after each wake, vllm-project/vllm#55013): after ``max_identical_wake_failures`` in a row the sidecar marks the
engine failed, names the failure, and refuses restores without touching it until a snapshot succeeds again."""

from __future__ import annotations

from grpc import aio

from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2_grpc as xpb_grpc
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer, failure_signature
from tests.support.fake_engines import FakeVllm


def test_failures_differing_only_in_their_figures_are_the_same():
    assert failure_signature("took 12.5 s on pid 41") == failure_signature("took 3.1 s on pid 42")
    assert failure_signature("answered 500") != failure_signature("still says asleep")


async def test_the_same_wake_failure_3_times_marks_the_engine_failed_and_a_good_sleep_clears_it():
    eng = FakeVllm(lie_on_wake=True).start()  # answers /wake_up 200 and stays asleep: the same failure every time
    srv = SidecarServer({"s": VllmBackend(eng.url, idle_timeout_s=1, memory_reader=lambda: None)}, port=0)
    await srv.start()
    ch = aio.insecure_channel(f"127.0.0.1:{srv.port}")
    stub, ops = pb_grpc.SnapshotAgentServiceStub(ch), xpb_grpc.SnapshotOperationsServiceStub(ch)

    async def run(rpc, req) -> xpb.OperationResult:
        op = (await rpc(req)).operation_id
        return await ops.WaitOperationResult(xpb.WaitOperationRequest(operation_id=op, timeout_s=30))

    try:
        assert (await run(stub.Snapshot, pb.SnapshotRequest(job_id="s"))).operation.status == pb.OPERATION_STATUS_COMPLETE
        results = [await run(stub.Restore, pb.RestoreRequest(job_id="s")) for _ in range(3)]
        assert [r.fault for r in results] == [xpb.OPERATION_FAULT_UNSPECIFIED] * 2 + [xpb.OPERATION_FAULT_ENGINE_FAILED]
        assert all("still says asleep" in r.operation.error for r in results)
        assert "marked failed: its wake failed the same way 3 times in a row" in results[2].operation.error
        wakes = eng.paths().count("/wake_up")
        fourth = await run(stub.Restore, pb.RestoreRequest(job_id="s"))
        assert fourth.fault == xpb.OPERATION_FAULT_ENGINE_FAILED and "marked failed" in fourth.operation.error
        assert eng.paths().count("/wake_up") == wakes, "a restore of an engine marked failed touched it"
        eng.lie_on_wake = False  # e.g. the engine restarted and works again
        assert (await run(stub.Snapshot, pb.SnapshotRequest(job_id="s"))).operation.status == pb.OPERATION_STATUS_COMPLETE
        assert (await run(stub.Restore, pb.RestoreRequest(job_id="s"))).operation.status == pb.OPERATION_STATUS_COMPLETE
    finally:
        await ch.close()
        await srv.stop()
        eng.stop()
