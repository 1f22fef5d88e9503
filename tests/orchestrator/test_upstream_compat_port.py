"""The upstream-compatible port (``--upstream-compat-port``): TimeSliceOrchestratorService and gRPC health only, no
bearer token; the peer allow-list; job tokens still bind there; bad settings refused naming the input.
(Upstream's own client against the orchestrator as the manifests start it: tests/orchestrator/test_upstream_compat.py.)"""

from __future__ import annotations

import ipaddress

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmd_timeslice.addresses import parse_network, peer_ip
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import (
    gate_state_pb2,
    gate_state_pb2_grpc,
    lease_pb2,
    lease_pb2_grpc,
    orchestrator_info_pb2,
    orchestrator_info_pb2_grpc,
    weights_pb2,
    weights_pb2_grpc,
)
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as pb
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as pb_grpc
from llmd_timeslice.orchestrator.server import OrchestratorServer
from tests.orchestrator.test_orchestrator import INVENTORY, RecordingActions
from tests.support.cli import run_cli

TOKEN = "main-port-token"
MD = (("authorization", f"Bearer {TOKEN}"),)


async def _code(coro) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture
async def orch():
    srv = OrchestratorServer(INVENTORY, port=0, token=TOKEN, actions=RecordingActions(), upstream_compat_port=0)
    await srv.start()
    yield srv
    await srv.stop()


async def test_upstream_port_serves_the_timeslice_service_and_health_and_nothing_else_even_with_the_token(orch):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orch.upstream_compat_port}") as ch:
        stub = pb_grpc.TimeSliceOrchestratorServiceStub(ch)
        assert list((await stub.ListGroups(pb.ListGroupsRequest(), timeout=5)).group_ids) == ["g0", "trainers-only"]
        h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        # Each RPC starts when it is awaited (its deadline too): started together, under load the later ones spent
        # their deadline waiting behind the earlier ones.
        not_here = {
            "GateStateService.ReportEndpointFailure": lambda: gate_state_pb2_grpc.GateStateServiceStub(ch).ReportEndpointFailure(
                gate_state_pb2.EndpointFailure(gate_id="g", pool="default", address="127.0.0.1:8001"), metadata=MD, timeout=5
            ),
            "LeaseService.GetLease": lambda: lease_pb2_grpc.LeaseServiceStub(ch).GetLease(
                lease_pb2.GetLeaseRequest(job_id="t", group_id="g0"), metadata=MD, timeout=5
            ),
            "WeightVersionService.GetWeightVersion": lambda: weights_pb2_grpc.WeightVersionServiceStub(ch).GetWeightVersion(
                weights_pb2.GetWeightVersionRequest(group_id="g0"), metadata=MD, timeout=5
            ),
            "OrchestratorInfoService.ListSwitches": lambda: orchestrator_info_pb2_grpc.OrchestratorInfoServiceStub(
                ch
            ).ListSwitches(orchestrator_info_pb2.ListSwitchesRequest(), metadata=MD, timeout=5),
            "reflection": lambda: ch.unary_unary("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")(b"", timeout=5),
        }
        seen = {name: await _code(call()) for name, call in not_here.items()}
        assert seen == dict.fromkeys(not_here, grpc.StatusCode.UNIMPLEMENTED), seen
        # The gates' state stream is not there either.
        call = gate_state_pb2_grpc.GateStateServiceStub(ch).Connect(metadata=MD, timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # at the write when the refusal came first (seen under load)
            await call.write(gate_state_pb2.GateMessage())
            await call.read()
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orch.port}") as ch:  # the main port still wants the token
        stub = pb_grpc.TimeSliceOrchestratorServiceStub(ch)
        assert await _code(stub.ListGroups(pb.ListGroupsRequest(), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
        assert await _code(stub.ListGroups(pb.ListGroupsRequest(), metadata=MD, timeout=5)) == grpc.StatusCode.OK


async def test_one_queue_behind_both_ports_a_tokenless_acquire_waits_behind_the_token_holder(orch):
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{orch.port}") as main,
        grpc.aio.insecure_channel(f"127.0.0.1:{orch.upstream_compat_port}") as upstream,
    ):
        ours, theirs = pb_grpc.TimeSliceOrchestratorServiceStub(main), pb_grpc.TimeSliceOrchestratorServiceStub(upstream)
        await ours.Acquire(pb.AcquireRequest(job_id="ours", group_id="g0"), metadata=MD, timeout=10)
        assert await _code(theirs.Acquire(pb.AcquireRequest(job_id="theirs", group_id="g0"), timeout=0.5)) == (
            grpc.StatusCode.DEADLINE_EXCEEDED
        )
        await ours.Yield(pb.YieldRequest(job_id="ours", group_id="g0"), metadata=MD, timeout=5)
        assert (await theirs.Acquire(pb.AcquireRequest(job_id="theirs", group_id="g0"), timeout=10)).success
        s = await ours.GetGroupStatus(pb.GetGroupStatusRequest(group_id="g0"), metadata=MD, timeout=5)
        assert s.group.locking_job == "theirs"
        assert (await theirs.Yield(pb.YieldRequest(job_id="theirs", group_id="g0"), timeout=5)).success


async def test_a_peer_outside_the_allowed_peers_is_refused_permission_denied_naming_its_address():
    srv = OrchestratorServer(
        INVENTORY,
        port=0,
        token=TOKEN,
        actions=RecordingActions(),
        upstream_compat_port=0,
        upstream_compat_allowed_peers=("10.0.0.0/8", "fd00::/8"),
    )
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.upstream_compat_port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.TimeSliceOrchestratorServiceStub(ch).ListGroups(pb.ListGroupsRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "127.0.0.1" in err.value.details() and "10.0.0.0/8" in err.value.details()
            health = health_pb2_grpc.HealthStub(ch)
            assert await _code(health.Check(health_pb2.HealthCheckRequest(), timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
            watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await watch.read()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await srv.stop()
    srv = OrchestratorServer(
        INVENTORY, port=0, actions=RecordingActions(), upstream_compat_port=0, upstream_compat_allowed_peers=("127.0.0.1",)
    )
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.upstream_compat_port}") as ch:
            groups = await pb_grpc.TimeSliceOrchestratorServiceStub(ch).ListGroups(pb.ListGroupsRequest(), timeout=5)
            assert list(groups.group_ids) == ["g0", "trainers-only"]
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=5)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
    finally:
        await srv.stop()


async def test_a_job_that_must_use_its_own_token_is_refused_on_the_tokenless_port():
    srv = OrchestratorServer(
        INVENTORY,
        port=0,
        token=TOKEN,
        job_tokens={"job-a": "token-a"},
        require_job_tokens=True,
        actions=RecordingActions(),
        upstream_compat_port=0,
    )
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.upstream_compat_port}") as ch:
            stub = pb_grpc.TimeSliceOrchestratorServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Acquire(pb.AcquireRequest(job_id="job-a", group_id="g0"), timeout=5)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "own job token" in err.value.details()
            assert (await stub.Acquire(pb.AcquireRequest(job_id="unlisted", group_id="g0"), timeout=10)).success
    finally:
        await srv.stop()


@pytest.mark.parametrize(
    ("peer", "ip"),
    [
        ("ipv4:10.1.2.3:5000", "10.1.2.3"),
        ("ipv6:[::1]:5000", "::1"),
        ("ipv6:%5B::1%5D:5000", "::1"),
        ("ipv6:[::ffff:10.1.2.3]:5000", "10.1.2.3"),
        ("ipv6:[fe80::1%25eth0]:5000", "fe80::1"),
        ("unix:/tmp/sock", None),
        ("", None),
    ],
)
def test_peer_ip_reads_every_peer_form_grpc_gives(peer, ip):
    assert peer_ip(peer) == (ipaddress.ip_address(ip) if ip else None)


@pytest.mark.parametrize("bad", ["10.0.0.1/8", "10.0.0.0/33", "trainers", ""])
def test_parse_network_names_the_bad_value(bad):
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        parse_network(bad)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--upstream-compat-port", "50051"], "--upstream-compat-port: must differ from --port"),
        (["--upstream-compat-allowed-peer", "10.0.0.0/8"], "--upstream-compat-allowed-peer: needs --upstream-compat-port"),
        (
            ["--upstream-compat-port", "50052", "--upstream-compat-allowed-peer", "10.0.0.1/8"],
            "got '10.0.0.1/8': 10.0.0.1/8 has host bits set",
        ),
        (["--upstream-compat-port", "70000"], "--upstream-compat-port"),
    ],
)
def test_bad_upstream_compat_settings_are_refused_in_one_line_naming_the_input(tmp_path, args, needle):
    inv = tmp_path / "inv.yaml"
    inv.write_text("groups: [{group_id: g}]\n")
    r = run_cli("orchestrator", "--inventory", str(inv), *args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
