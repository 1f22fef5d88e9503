"""WorkloadChannel over real gRPC (sidecar server + trainer-side client) and per-job backend resolution."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio

from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2_grpc as xpb_grpc
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from llmd_timeslice.client.workload import WorkloadClient
from llmd_timeslice.snapshot.backends.base import SnapshotBackend, SuspendMode, SuspendResult
from llmd_timeslice.snapshot.backends.sglang import SglangBackend
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.channel import WorkloadChannelBackend, WorkloadRegistry
from llmd_timeslice.snapshot.resolve import BackendResolver, ResolveError
from llmd_timeslice.snapshot.server import SidecarServer

pytestmark = [pytest.mark.timeout(60), pytest.mark.torch]  # torch: in the worker that imports it (tests/conftest.py)


class _Recording(SnapshotBackend):
    name = "recording"

    async def suspend(self, mode, tags):
        return SuspendResult()

    async def resume(self, tags):
        pass

    async def is_suspended(self):
        return False


@pytest.fixture
async def sidecar():
    srv = SidecarServer({}, port=0, token="tok", command_timeout_s=2.0)
    await srv.start()
    ch = aio.insecure_channel(f"127.0.0.1:{srv.port}")
    srv.stub = pb_grpc.SnapshotAgentServiceStub(ch)
    srv.ops = xpb_grpc.SnapshotOperationsServiceStub(ch)
    srv.md = (("authorization", "Bearer tok"),)
    yield srv
    await ch.close()
    await srv.stop()


async def _registered(srv, job_id, stream=None, timeout=5.0):
    async def check():
        while (ch := srv.servicer.workloads.get(job_id)) is None or ch is stream:
            await asyncio.sleep(0.01)
        return ch

    return await asyncio.wait_for(check(), timeout)


async def _op(srv, kind, job_id, **kw):
    req = (pb.SnapshotRequest if kind == "snapshot" else pb.RestoreRequest)(job_id=job_id, **kw)
    rpc = srv.stub.Snapshot if kind == "snapshot" else srv.stub.Restore
    op_id = (await rpc(req, metadata=srv.md)).operation_id
    return await srv.ops.WaitOperation(xpb.WaitOperationRequest(operation_id=op_id, timeout_s=30), metadata=srv.md)


def _trainer():
    import torch  # here, not at the top: ~2 s of CPU in every pytest-xdist worker's collection

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


async def test_trainer_registers_and_snapshot_restore_offload_its_state(sidecar):
    from llmd_timeslice.client.torch_offload import TorchStateOffloader, state_checksum

    model, opt = _trainer()
    before = state_checksum(model, opt)
    client = WorkloadClient.for_offloader(
        f"127.0.0.1:{sidecar.port}", "trainer-0", TorchStateOffloader(model, opt), group="g", token="tok"
    )
    stop = asyncio.Event()
    task = asyncio.create_task(client.run(stop))
    try:
        ch = await _registered(sidecar, "trainer-0")
        assert ch.group == "g" and ch.supported_modes == (SuspendMode.OFFLOAD,)
        r = await _op(sidecar, "snapshot", "trainer-0")  # no config: the registered channel is chosen
        assert r.status == pb.OPERATION_STATUS_COMPLETE, r.error
        assert sidecar.servicer.last_resolution["trainer-0"] == "workload_channel"
        assert model.weight.numel() == 0 and sidecar.servicer.states["trainer-0"] == "SAVED"
        r = await _op(sidecar, "restore", "trainer-0")
        assert r.status == pb.OPERATION_STATUS_COMPLETE, r.error
        assert state_checksum(model, opt) == before and client.commands_run == 2
        assert not ch.pending, "every command answered once"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_first_message_must_be_register(sidecar):
    call = sidecar.stub.WorkloadChannel(metadata=sidecar.md)
    await call.write(pb.WorkloadMessage(result=pb.CommandResult(command_id="x", ok=True)))
    with pytest.raises(aio.AioRpcError) as e:
        await call.read()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "RegisterWorkload" in e.value.details()


async def test_without_token_the_channel_is_refused(sidecar):
    call = sidecar.stub.WorkloadChannel()
    with pytest.raises(aio.AioRpcError) as e:
        # Refused on the call's headers alone. No message is written: one sent while the server ends the call fails
        # with that end (seen under load), or locally in grpc.aio, which then reports INTERNAL.
        await call.read()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_reregistration_replaces_the_earlier_stream_and_commands_go_to_the_new_one(sidecar):
    reg = pb.WorkloadMessage(
        register=pb.RegisterWorkload(
            job_id="j",
            capabilities=pb.WorkloadCapabilities(
                supported_modes=[pb.SUSPEND_MODE_OFFLOAD, pb.SUSPEND_MODE_DISCARD], default_mode=pb.SUSPEND_MODE_DISCARD
            ),
        )
    )
    old = sidecar.stub.WorkloadChannel(metadata=sidecar.md)
    await old.write(reg)
    first = await _registered(sidecar, "j")
    new = sidecar.stub.WorkloadChannel(metadata=sidecar.md)
    await new.write(reg)
    second = await _registered(sidecar, "j", stream=first)
    assert await asyncio.wait_for(old.read(), 5) is aio.EOF, "the replaced stream is ended"
    assert first.closed and "replaced" in first.closed
    op_id = (await sidecar.stub.Snapshot(pb.SnapshotRequest(job_id="j"), metadata=sidecar.md)).operation_id
    cmd = await asyncio.wait_for(new.read(), 5)
    assert cmd.WhichOneof("command") == "snapshot"
    assert cmd.snapshot.mode == pb.SUSPEND_MODE_DISCARD, "mode on the wire resolved from the registered default"
    await new.write(pb.WorkloadMessage(result=pb.CommandResult(command_id=cmd.command_id, ok=True)))
    r = await sidecar.ops.WaitOperation(xpb.WaitOperationRequest(operation_id=op_id, timeout_s=10), metadata=sidecar.md)
    assert r.status == pb.OPERATION_STATUS_COMPLETE
    # an explicit app_channel mode wins over the default; a failed result fails the operation with its error
    op_id = (
        await sidecar.stub.Snapshot(
            pb.SnapshotRequest(
                job_id="j",
                backend_config=pb.BackendConfig(
                    app_channel=pb.AppChannelConfig(mode=pb.SUSPEND_MODE_OFFLOAD, tags=["optimizer"])
                ),
            ),
            metadata=sidecar.md,
        )
    ).operation_id
    cmd = await asyncio.wait_for(new.read(), 5)
    assert cmd.snapshot.mode == pb.SUSPEND_MODE_OFFLOAD and list(cmd.snapshot.tags) == ["optimizer"]
    await new.write(pb.WorkloadMessage(result=pb.CommandResult(command_id=cmd.command_id, ok=False, error="OOM")))
    r = await sidecar.ops.WaitOperation(xpb.WaitOperationRequest(operation_id=op_id, timeout_s=10), metadata=sidecar.md)
    assert r.status == pb.OPERATION_STATUS_FAILED and "OOM" in r.error
    assert second is sidecar.servicer.workloads.get("j")
    new.cancel()


async def test_disconnect_mid_command_fails_the_operation_and_unanswered_command_times_out(sidecar):
    call = sidecar.stub.WorkloadChannel(metadata=sidecar.md)
    await call.write(pb.WorkloadMessage(register=pb.RegisterWorkload(job_id="j")))
    await _registered(sidecar, "j")
    op_id = (await sidecar.stub.Snapshot(pb.SnapshotRequest(job_id="j"), metadata=sidecar.md)).operation_id
    cmd = await asyncio.wait_for(call.read(), 5)
    assert cmd.snapshot.mode == pb.SUSPEND_MODE_OFFLOAD
    call.cancel()  # the trainer dies mid-command
    r = await sidecar.ops.WaitOperation(xpb.WaitOperationRequest(operation_id=op_id, timeout_s=10), metadata=sidecar.md)
    assert r.status == pb.OPERATION_STATUS_FAILED and "disconnected" in r.error, r.error
    assert sidecar.servicer.states["j"] == "FAULTED"
    assert sidecar.servicer.workloads.get("j") is None
    # registered again, but never answers: the command times out (command_timeout_s=2) -> FAILED
    call = sidecar.stub.WorkloadChannel(metadata=sidecar.md)
    await call.write(pb.WorkloadMessage(register=pb.RegisterWorkload(job_id="j")))
    await _registered(sidecar, "j")
    op_id = (await sidecar.stub.Restore(pb.RestoreRequest(job_id="j"), metadata=sidecar.md)).operation_id
    cmd = await asyncio.wait_for(call.read(), 5)
    assert cmd.WhichOneof("command") == "restore"
    r = await sidecar.ops.WaitOperation(xpb.WaitOperationRequest(operation_id=op_id, timeout_s=10), metadata=sidecar.md)
    assert r.status == pb.OPERATION_STATUS_FAILED and "did not answer restore command" in r.error
    call.cancel()


async def test_app_channel_without_registration_is_failed_precondition(sidecar):
    with pytest.raises(aio.AioRpcError) as e:
        await sidecar.stub.Snapshot(
            pb.SnapshotRequest(job_id="nobody", backend_config=pb.BackendConfig(app_channel=pb.AppChannelConfig())),
            metadata=sidecar.md,
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_workload_client_in_a_thread_with_a_failing_callback(loop_thread):
    srv = SidecarServer({}, port=0, command_timeout_s=5.0)
    loop_thread.run(srv.start())

    def boom(mode, tags):
        raise RuntimeError("host memory full")

    handle = WorkloadClient(f"127.0.0.1:{srv.port}", "t", offload=boom, restore=lambda tags: None, token="").start_in_thread()
    try:

        async def snap():
            await _registered(srv, "t")
            ch = srv.servicer.workloads.get("t")
            backend = WorkloadChannelBackend(srv.servicer.workloads, "t", 5.0)
            with pytest.raises(Exception, match="RuntimeError: host memory full"):
                await backend.suspend(SuspendMode.OFFLOAD, [])
            await backend.resume([])
            return ch

        assert not loop_thread.run(snap()).pending
    finally:
        handle.stop()
        loop_thread.run(srv.stop())


async def test_resolution_order_request_then_channel_then_annotation_then_default():
    default = _Recording()
    reg = WorkloadRegistry()
    r = BackendResolver(
        {"j": default},
        reg,
        annotations={
            "snapshot.timeslice.io/backend.k": "sglang",
            "snapshot.timeslice.io/endpoint": "http://127.0.0.1:30000",
            "snapshot.timeslice.io/mode": "discard",
        },
    )
    try:
        assert r.resolve("j", None).backend is default and r.resolve("j", None).source == "default"
        a = r.resolve("k", None)
        assert (a.source, a.mode) == ("annotation", SuspendMode.DISCARD)
        assert isinstance(a.backend, SglangBackend) and a.backend.base_url == "http://127.0.0.1:30000"
        assert r.resolve("k", None).backend is a.backend, "built backends are reused (restore meets its snapshot)"
        reg.register(pb.RegisterWorkload(job_id="k"))
        assert r.resolve("k", None).source == "workload_channel"
        explicit = r.resolve(
            "k",
            pb.BackendConfig(
                app_endpoint=pb.AppEndpointConfig(
                    app=pb.APP_VLLM, endpoints=["127.0.0.1:8001"], mode=pb.SUSPEND_MODE_DISCARD, tags=["weights"]
                )
            ),
        )
        assert explicit.source == "request" and isinstance(explicit.backend, VllmBackend)
        assert explicit.backend.base_url == "http://127.0.0.1:8001" and explicit.tags == ["weights"]
        # the orchestrator's plain request (APP_VLLM, no endpoint) reaches the job's own backend
        plain = r.resolve("j", pb.BackendConfig(app_endpoint=pb.AppEndpointConfig(app=pb.APP_VLLM)))
        assert plain.backend is default and plain.mode is SuspendMode.DISCARD  # annotation's pod-wide mode
        cuda = r.resolve("j", pb.BackendConfig(cuda=pb.CudaBackendConfig(explicit_target=pb.ProcessTarget(pids=[1, 2]))))
        assert cuda.backend.name == "cuda" and cuda.backend.pids == [1, 2]
        for bad, code in [
            (pb.BackendConfig(direct_memory=pb.DirectMemoryBackendConfig()), "UNIMPLEMENTED"),
            (pb.BackendConfig(cuda=pb.CudaBackendConfig()), "INVALID_ARGUMENT"),
        ]:
            with pytest.raises(ResolveError) as e:
                r.resolve("j", bad)
            assert e.value.code.name == code
        with pytest.raises(ResolveError) as e:
            r.resolve("nobody", None)
        assert e.value.code is grpc.StatusCode.NOT_FOUND
    finally:
        await r.close()


async def test_upstreams_timeslice_io_backend_annotation_resolves_as_that_backend_config():
    """Upstream's spelling (llm-d-rl-time-slicing PR #159: ``timeslice.io/backend`` + ``timeslice.io/backend-config``,
    protojson) beside ours (``snapshot.timeslice.io/backend``): each resolves, ours wins where a pod carries both."""
    upstream = {
        "timeslice.io/backend": "app_endpoint",
        "timeslice.io/backend-config": '{"app": "APP_SGLANG", "endpoints": ["http://127.0.0.1:30001"], '
        '"mode": "SUSPEND_MODE_DISCARD"}',
    }
    r = BackendResolver({}, WorkloadRegistry(), annotations=upstream)
    both = BackendResolver({}, WorkloadRegistry(), annotations={**upstream, "snapshot.timeslice.io/backend": "vllm"})
    cuda = BackendResolver(
        {},
        WorkloadRegistry(),
        annotations={"timeslice.io/backend": "cuda", "timeslice.io/backend-config": '{"explicitTarget": {"pids": [7]}}'},
    )
    try:
        got = r.resolve("k", None)
        assert (got.source, got.mode) == ("annotation", SuspendMode.DISCARD)
        assert isinstance(got.backend, SglangBackend) and got.backend.base_url == "http://127.0.0.1:30001"
        ours = both.resolve("k", None)
        assert ours.source == "annotation" and isinstance(ours.backend, VllmBackend), "ours wins"
        pids = cuda.resolve("k", None)
        assert pids.backend.name == "cuda" and pids.backend.pids == [7]
    finally:
        for x in (r, both, cuda):
            await x.close()


@pytest.mark.parametrize(
    ("annotations", "code", "message"),
    [
        (
            {"timeslice.io/backend": "noop"},
            "FAILED_PRECONDITION",
            "pod annotation timeslice.io/backend='noop' is not a backend this sidecar serves (it serves app_endpoint, "
            "app_channel and cuda; 'noop' is not served)",
        ),
        (
            {"timeslice.io/backend": "app_endpoint", "timeslice.io/backend-config": "{not json"},
            "INVALID_ARGUMENT",
            "pod annotation timeslice.io/backend-config is not protojson of BackendConfig.app_endpoint: ",
        ),
        (
            {"timeslice.io/backend": "app_endpoint", "timeslice.io/backend-config": '{"endpoint": "x"}'},
            "INVALID_ARGUMENT",
            "pod annotation timeslice.io/backend-config is not protojson of BackendConfig.app_endpoint: ",
        ),
        ({"timeslice.io/backend": "direct_memory"}, "UNIMPLEMENTED", "backend config 'direct_memory' is not served"),
    ],
    ids=["noop", "config-not-json", "config-unknown-field", "direct-memory"],
)
def test_a_bad_upstream_backend_annotation_fails_the_request_naming_it(annotations, code, message):
    r = BackendResolver({}, WorkloadRegistry(), annotations=annotations)
    with pytest.raises(ResolveError) as e:
        r.resolve("k", None)
    assert e.value.code.name == code and str(e.value).startswith(message), str(e.value)
