"""The operation stream between the orchestrator and a sidecar (``RunOperations``, snapshot_ext.proto), in one process
over real gRPC with a real sidecar on the fake vLLM: each command is answered by one event (the finished operation,
or the refusal the unary call would have returned: fencing, unknown job, bad token); a sidecar that restarts gets a
new stream; a dead one fails the command after the open timeout; a sidecar without the method (an older release)
is driven through the unary calls."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as spb
from llmd_timeslice.domain.group_settings import SamplerEndpoint
from llmd_timeslice.domain.switches import SamplerStepFailed, StepFault
from llmd_timeslice.orchestrator.actions import GrpcSwitchActions
from llmd_timeslice.orchestrator.gate_hub import GateHub
from llmd_timeslice.orchestrator.sidecar_stream import OperationStream, StreamBroken
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from tests.support.fake_engines import FakeVllm
from tests.support.waits import until

pytestmark = pytest.mark.timeout(60)
TOKEN = "t"


@pytest.fixture
async def sidecar():
    engine = FakeVllm().start()
    srv = SidecarServer({"s": VllmBackend(engine.url, idle_timeout_s=1)}, port=0, token=TOKEN)
    await srv.start()
    acts = GrpcSwitchActions(GateHub(), token=TOKEN)
    sampler = SamplerEndpoint("default", engine.url.removeprefix("http://"), f"127.0.0.1:{srv.port}", "s")
    yield engine, srv, acts, sampler
    await acts.close()
    await srv.stop()
    engine.stop()


async def test_a_sleep_and_a_wake_are_one_command_and_one_event_each_on_one_stream():
    engine = FakeVllm().start()
    srv = SidecarServer({"s": VllmBackend(engine.url, idle_timeout_s=1)}, port=0, token=TOKEN)
    calls: list[str] = []
    for name in ("Snapshot", "Restore", "WaitOperationResult", "WaitOperation"):
        unary = getattr(srv.servicer, name)

        async def counted(request, context, _m=unary, _n=name):
            calls.append(_n)
            return await _m(request, context)

        setattr(srv.servicer, name, counted)
    stream = srv.servicer.RunOperations

    async def counted_stream(request_iterator, context):
        calls.append("RunOperations")
        async for event in stream(request_iterator, context):
            yield event

    srv.servicer.RunOperations = counted_stream  # type: ignore[method-assign]
    await srv.start()
    acts = GrpcSwitchActions(GateHub(), token=TOKEN)
    sampler = SamplerEndpoint("default", engine.url.removeprefix("http://"), f"127.0.0.1:{srv.port}", "s")
    try:
        cfg = acts._config(1)
        op = await acts._operation(sampler, "g", "sleep", cfg)
        assert op.status == spb.OPERATION_STATUS_COMPLETE and engine.level == 1
        op = await acts._operation(sampler, "g", "wake", cfg)
        assert op.status == spb.OPERATION_STATUS_COMPLETE and engine.level == 0
        await acts._operation(sampler, "g", "sleep", cfg)
        assert calls == ["RunOperations"], "one stream for every operation, no unary call"
        assert [o.kind for o in srv.servicer.operations.values()] == ["snapshot", "restore", "snapshot"]
    finally:
        await acts.close()
        await srv.stop()
        engine.stop()


async def test_a_failed_operation_comes_back_with_its_error_and_fault_kind(sidecar):
    engine, _, acts, sampler = sidecar
    engine.lie_on_sleep = True  # answers the sleep but stays awake: the verification fails
    with pytest.raises(SamplerStepFailed) as err:
        await acts._operation(sampler, "g", "sleep", acts._config(1))
    assert err.value.fault is StepFault.ENGINE
    assert str(err.value).startswith(f"sleep of {sampler.address} failed: ")


async def test_refusals_on_the_stream_say_what_the_unary_call_would_have(sidecar):
    _, srv, acts, sampler = sidecar
    stream = OperationStream(acts._stubs(sampler.sidecar)[1], acts._md, 5.0)
    try:
        unknown = await _refused(stream, xpb.OperationCommand(snapshot=spb.SnapshotRequest(job_id="nope")))
        assert unknown.code == grpc.StatusCode.NOT_FOUND and "nope" in unknown.details
        empty = await _refused(stream, xpb.OperationCommand())
        assert empty.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "must set snapshot, restore or restore_with_weights" in empty.details
        no_weights = await _refused(
            stream,
            xpb.OperationCommand(restore_with_weights=xpb.RestoreWithWeightsRequest(restore=spb.RestoreRequest(job_id="s"))),
        )
        assert no_weights.code == grpc.StatusCode.INVALID_ARGUMENT and "weights is required" in no_weights.details
        assert srv.servicer.operations == {}, "nothing was started"
    finally:
        stream.close()


async def _refused(stream: OperationStream, cmd: xpb.OperationCommand):
    from llmd_timeslice.orchestrator.sidecar_stream import OperationRefused

    with pytest.raises(OperationRefused) as err:
        await stream.run(cmd, 10)
    return err.value


async def test_a_fenced_refusal_on_the_stream_reaches_the_orchestrators_hook(sidecar):
    _, srv, acts, sampler = sidecar
    acts.term = 5
    await acts._operation(sampler, "g", "sleep", acts._config(1))
    old = GrpcSwitchActions(GateHub(), token=TOKEN)
    old.term = 3
    fenced: list[tuple] = []
    old.on_fenced = lambda *a: fenced.append(a)
    try:
        fenced_msg = "FAILED_PRECONDITION: fenced: restore of job 's' from orchestrator leader term 3"
        with pytest.raises(SamplerStepFailed, match=fenced_msg):
            await old._operation(sampler, "g", "wake", old._config(1))
    finally:
        await old.close()
    assert fenced == [(sampler.sidecar, 3, 5)]
    assert srv.servicer.states["s"] == "SAVED", "the refused wake did nothing"


async def test_a_wrong_token_fails_the_open_at_once_naming_it(sidecar):
    _, _, _, sampler = sidecar
    bad = GrpcSwitchActions(GateHub(), token="wrong")
    try:
        # The sidecar's status itself, not the open timeout's error: the open ended with the call, not after waiting.
        with pytest.raises(SamplerStepFailed, match=r"UNAUTHENTICATED: missing or wrong bearer token for .*RunOperations"):
            await bad._operation(sampler, "g", "sleep", bad._config(1))
    finally:
        await bad.close()


async def test_a_restarted_sidecar_gets_a_new_stream_and_a_dead_one_fails_after_the_open_timeout(sidecar):
    engine, srv, acts, sampler = sidecar
    cfg = acts._config(1)
    await acts._operation(sampler, "g", "sleep", cfg)
    port = srv.port
    await srv.stop()
    # The old stream's end reached its reader before the next command: what follows is the open of a new stream to a
    # dead sidecar. (A command written before the reader saw the end fails with that end, UNAVAILABLE "Cancelling all
    # calls", and is not sent again: the sidecar may have started it. Seen once on a loaded machine.)
    stream = acts._streams[sampler.sidecar]
    await until(lambda: stream._open is None or stream._open.broken is not None, what="the old stream seen ended")
    acts.start_rpc_timeout_s = 1.0
    t = time.monotonic()
    with pytest.raises(SamplerStepFailed, match="DEADLINE_EXCEEDED: no operation stream from the sidecar within 1 s") as err:
        await acts._operation(sampler, "g", "wake", cfg)
    assert err.value.fault is StepFault.SIDECAR
    assert 0.9 <= time.monotonic() - t < 10
    again = SidecarServer({"s": VllmBackend(engine.url, idle_timeout_s=1)}, port=port, token=TOKEN)
    await again.start()
    try:
        acts.start_rpc_timeout_s = 6.0
        op = await acts._operation(sampler, "g", "wake", cfg)
        assert op.status == spb.OPERATION_STATUS_COMPLETE and engine.level == 0
    finally:
        await again.stop()


async def test_a_sidecar_stopping_with_an_operation_in_flight_fails_it_as_a_sidecar_fault(sidecar):
    engine, srv, acts, sampler = sidecar
    # In flight when the server stops (at once, below); the left-behind operation ends with it (finish_operations).
    engine.sleep_delay_s = 1.0
    sleep = asyncio.create_task(acts._operation(sampler, "g", "sleep", acts._config(1)))
    while not srv.servicer.operations:
        await asyncio.sleep(0.02)
    await srv._server.stop(0)  # the server goes away; the operation's task is left behind (a killed process)
    with pytest.raises(SamplerStepFailed, match=f"sleep of {sampler.address} via sidecar {sampler.sidecar}: ") as err:
        await asyncio.wait_for(sleep, 10)
    assert err.value.fault is StepFault.SIDECAR
    await srv.servicer.finish_operations(5)


async def test_a_sidecar_of_an_older_release_is_driven_through_the_unary_calls():
    """Its server has no RunOperations (UNIMPLEMENTED): the start call plus WaitOperationResult, as before."""
    engine = FakeVllm().start()
    srv = SidecarServer({"s": VllmBackend(engine.url, idle_timeout_s=1)}, port=0, token=TOKEN)
    srv.servicer.RunOperations = _unimplemented  # type: ignore[method-assign,assignment]
    await srv.start()
    acts = GrpcSwitchActions(GateHub(), token=TOKEN)
    sampler = SamplerEndpoint("default", engine.url.removeprefix("http://"), f"127.0.0.1:{srv.port}", "s")
    try:
        op = await acts._operation(sampler, "g", "sleep", acts._config(1))
        assert op.status == spb.OPERATION_STATUS_COMPLETE and engine.level == 1
        assert acts._streams[sampler.sidecar].unsupported, "not asked again"
        await acts._operation(sampler, "g", "wake", acts._config(1))
        assert engine.level == 0
    finally:
        await acts.close()
        await srv.stop()
        engine.stop()


async def _unimplemented(request_iterator, context):
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
    yield  # an async generator, as the servicer's own


def test_stream_broken_names_its_code():
    assert str(StreamBroken(grpc.StatusCode.UNAVAILABLE, "gone")) == "UNAVAILABLE: gone"


async def test_a_sidecar_black_holed_after_its_stream_opened_fails_the_command_within_the_probe_bound():
    """A node cut off: the stream's connection stays open but nothing comes back. The command fails after the
    reachability probe (its first after ``probe_after_s``, unanswered within the open timeout), not after the
    operation's own timeout; a sidecar answering slowly but reachable is probed and waited for."""
    from tests.support.tcp_proxy import TcpProxy

    engine = FakeVllm().start()
    srv = SidecarServer({"s": VllmBackend(engine.url, idle_timeout_s=1)}, port=0, token=TOKEN)
    await srv.start()
    proxy = await TcpProxy("127.0.0.1", srv.port).start()
    acts = GrpcSwitchActions(GateHub(), token=TOKEN, start_rpc_timeout_s=1.0, probe_after_s=0.3)
    sampler = SamplerEndpoint("default", engine.url.removeprefix("http://"), proxy.address, "s")
    try:
        cfg = acts._config(1)
        engine.sleep_delay_s = 0.6  # twice probe_after_s: probed, answered, waited for
        op = await acts._operation(sampler, "g", "sleep", cfg)
        assert op.status == spb.OPERATION_STATUS_COMPLETE and engine.level == 1
        proxy.blackhole()
        t0 = time.monotonic()
        with pytest.raises(SamplerStepFailed, match="did not answer a call within 1 s while the operation ran") as err:
            await acts._operation(sampler, "g", "wake", cfg)
        assert err.value.fault is StepFault.SIDECAR
        assert time.monotonic() - t0 < 5, "failed by the probe (0.3 s + 1 s), not the operation timeout (300 s)"
    finally:
        await acts.close()
        await proxy.stop()
        await srv.stop()
        engine.stop()


async def test_a_sidecar_reachable_again_after_a_cut_is_reached_at_once_not_over_the_dead_connection():
    """The cable back after a cut: the connection that was black-holed may stay dead long after (TCP's retransmissions
    back off to tens of seconds; nothing resets it). The probe that found the sidecar unreachable dropped that
    connection, so the next command connects anew and is answered at once, instead of failing the probe again on the
    old connection."""
    from tests.support.tcp_proxy import TcpProxy

    engine = FakeVllm().start()
    srv = SidecarServer({"s": VllmBackend(engine.url, idle_timeout_s=1)}, port=0, token=TOKEN)
    await srv.start()
    proxy = await TcpProxy("127.0.0.1", srv.port).start()
    acts = GrpcSwitchActions(GateHub(), token=TOKEN, start_rpc_timeout_s=1.0)
    sampler = SamplerEndpoint("default", engine.url.removeprefix("http://"), proxy.address, "s")
    try:
        cfg = acts._config(1)
        acts._operation_stream(sampler).probe_after_s = 0.3
        await acts._operation(sampler, "g", "sleep", cfg)
        proxy.blackhole()
        with pytest.raises(SamplerStepFailed, match="did not answer a call within 1 s while the operation ran"):
            await acts._operation(sampler, "g", "wake", cfg)
        proxy.heal(keep_dead=True)  # the old connection stays silent; a new one passes
        acts.start_rpc_timeout_s = 5.0
        op = await acts._operation(sampler, "g", "wake", cfg)
        assert op.status == spb.OPERATION_STATUS_COMPLETE and engine.level == 0
    finally:
        await acts.close()
        await proxy.stop()
        await srv.stop()
        engine.stop()


async def test_a_stopping_sidecar_ends_an_idle_stream_at_once_and_one_with_an_operation_in_flight_after_its_event():
    """A sidecar's stop (its node's `down`) does not hold for the orchestrator's long-lived operation streams: an idle
    one ends with status OK, not cancelled at the server's grace; one whose sleep is in flight first gets that
    operation's event, then ends OK."""
    engine = FakeVllm(sleep_delay_s=0.3).start()
    srv = SidecarServer({"s": VllmBackend(engine.url, idle_timeout_s=1)}, port=0, token=TOKEN)
    await srv.start()
    acts = GrpcSwitchActions(GateHub(), token=TOKEN)
    stub = acts._stubs(f"127.0.0.1:{srv.port}")[1]
    try:
        idle = stub.RunOperations(metadata=acts._md)
        busy = stub.RunOperations(metadata=acts._md)
        await idle.initial_metadata()
        await busy.initial_metadata()
        await busy.write(
            xpb.OperationCommand(command_id=7, snapshot=spb.SnapshotRequest(job_id="s", backend_config=acts._config(1)))
        )
        await until(lambda: srv.servicer.operations, 10, "the sleep started")
        await until(lambda: len(srv.servicer._op_streams) == 2, 10, "both streams open on the sidecar")
        await srv.stop()
        assert await idle.code() == grpc.StatusCode.OK, await idle.details()
        event = await busy.read()
        assert event.command_id == 7 and event.result.operation.status == spb.OPERATION_STATUS_COMPLETE, event
        assert await busy.read() is grpc.aio.EOF and await busy.code() == grpc.StatusCode.OK
        assert engine.level == 1
    finally:
        await acts.close()
        engine.stop()
