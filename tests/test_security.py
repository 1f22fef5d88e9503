"""Control-plane security: bearer token on every control API (refused calls counted), the gate's
data-plane ports exposing only ext_proc, the access-log service and health (gRPC) and ext_authz checks (HTTP),
per-job tokens (one job cannot yield, renew or publish for another), fencing tokens for heartbeating holders,
and optional mutual TLS end to end."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice import tls
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as gpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2_grpc as gpb_grpc
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2_grpc as gspb_grpc
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import lease_pb2, lease_pb2_grpc
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as spb
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as spb_grpc
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient, LeaseError
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.orchestrator.switch import SwitchActions
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from llmd_timeslice.weights.update import WeightUpdate
from tests.support.fake_engines import FakeVllm

TOKEN = "control-token"
JOB_TOKENS = {"job-a": "token-a", "job-b": "token-b"}


def _counter(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _inventory(addr: str = "10.0.0.1:8000", sidecar: str = "127.0.0.1:1") -> Inventory:
    return Inventory.model_validate(
        {
            "groups": [
                {"group_id": "t"},
                {"group_id": "g", "samplers": [{"pool": "default", "address": addr, "sidecar": sidecar, "job_id": "s"}]},
            ]
        }
    )


async def _code(coro) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_every_control_api_refuses_a_missing_or_wrong_token_and_counts_it():
    engine = FakeVllm().start()
    sidecar = SidecarServer({"s": VllmBackend(engine.url)}, port=0, token=TOKEN)
    await sidecar.start()
    orch = OrchestratorServer(_inventory(engine.url.removeprefix("http://"), f"127.0.0.1:{sidecar.port}"), port=0, token=TOKEN)
    await orch.start()
    gate = GateServer(GateConfig(ext_proc_port=0, control_port=0, token=TOKEN))
    await gate.start()
    try:
        calls = {
            f"127.0.0.1:{orch.port}": [
                (
                    "/timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService/ListGroups",
                    lambda ch, md: opb_grpc.TimeSliceOrchestratorServiceStub(ch).ListGroups(
                        opb.ListGroupsRequest(), metadata=md, timeout=5
                    ),
                ),
                (
                    "/llmd_timeslice.v1alpha1.LeaseService/GetLease",
                    lambda ch, md: lease_pb2_grpc.LeaseServiceStub(ch).GetLease(
                        lease_pb2.GetLeaseRequest(job_id="j", group_id="t"), metadata=md, timeout=5
                    ),
                ),
            ],
            f"127.0.0.1:{sidecar.port}": [
                (
                    "/snapshot_agent.v1alpha1.SnapshotAgentService/Status",
                    lambda ch, md: spb_grpc.SnapshotAgentServiceStub(ch).Status(spb.StatusRequest(), metadata=md, timeout=5),
                ),
            ],
            f"127.0.0.1:{gate.control_port}": [
                (
                    "/llmd_timeslice.v1alpha1.GateControlService/ListPools",
                    lambda ch, md: gpb_grpc.GateControlServiceStub(ch).ListPools(gpb.ListPoolsRequest(), metadata=md, timeout=5),
                ),
            ],
        }
        for target, methods in calls.items():
            async with grpc.aio.insecure_channel(target) as ch:
                for method, call in methods:
                    before = _counter("llmd_timeslice_unauthenticated_calls_total", method=method)
                    for md in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
                        assert await _code(call(ch, md)) == grpc.StatusCode.UNAUTHENTICATED, (method, md)
                    assert _counter("llmd_timeslice_unauthenticated_calls_total", method=method) == before + 3
                    code = await _code(call(ch, (("authorization", f"Bearer {TOKEN}"),)))
                    assert code in (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION), (method, code)
        # The gate state stream (a gate subscribing) needs the token too.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orch.port}") as ch:
            # Refused on the call's headers alone. No hello is written: a message sent while the server ends the call
            # can fail locally in grpc.aio, which then reports INTERNAL instead of the server's status (seen under load).
            stream = gspb_grpc.GateStateServiceStub(ch).Connect(timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                async for _ in stream:
                    pass
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert orch.hub.gate_ids == []
    finally:
        await gate.stop()
        await orch.stop()
        await sidecar.stop()
        engine.stop()


async def test_gate_data_plane_ports_serve_only_ext_proc_access_log_health_and_ext_authz_checks():
    gate = GateServer(GateConfig(ext_proc_port=0, authz_port=0, control_port=0, token=TOKEN))
    await gate.start()
    md = (("authorization", f"Bearer {TOKEN}"),)
    try:
        import httpx

        async with httpx.AsyncClient(timeout=5) as c:  # the HTTP port answers checks only: no metrics, no control
            for path in ("/metrics", "/llmd_timeslice.v1alpha1.GateControlService/ListPools", "/"):
                r = await c.get(f"http://127.0.0.1:{gate.authz_port}{path}", headers={"authorization": f"Bearer {TOKEN}"})
                assert r.status_code == 400 and r.headers["x-llmd-timeslice-reason"] == "bad_check", (path, r.text)
            assert len(gate.book) == 0
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gate.ext_proc_port}") as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
            for call in (
                gpb_grpc.GateControlServiceStub(ch).ListPools(gpb.ListPoolsRequest(), metadata=md, timeout=5),
                gpb_grpc.GateControlServiceStub(ch).GetPoolStatus(
                    gpb.GetPoolStatusRequest(pool="default"), metadata=md, timeout=5
                ),
                ch.unary_unary("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")(b"", timeout=5),
                ch.unary_unary("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")(b"", timeout=5),
            ):
                assert await _code(call) == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await gate.stop()


@pytest.fixture
async def job_stack():
    orch = OrchestratorServer(_inventory(), port=0, token=TOKEN, job_tokens=JOB_TOKENS, actions=_Noop())
    await orch.start()
    clients = {
        j: AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id=j, group_id="t", token=t)
        for j, t in JOB_TOKENS.items()
    }
    yield orch, clients
    for c in clients.values():
        await c.close()
    await orch.stop()


class _Noop(SwitchActions):
    async def suspend_samplers(self, spec, record) -> None:
        pass

    async def resume_samplers(self, spec, record) -> None:
        pass


async def test_a_job_cannot_yield_renew_or_publish_for_another_job(job_stack):
    orch, clients = job_stack
    a, b = clients["job-a"], clients["job-b"]
    await a.acquire(timeout_sec=10)
    token = a._beats[("job-a", "t")].token
    before = _counter("llmd_timeslice_permission_denied_calls_total", reason="other_job")
    # job-b's token, acting for job-a: yield, heartbeat, lease, acquire, publish: all refused.
    with pytest.raises(LeaseError, match=r"PERMISSION_DENIED.*token of job 'job-b' cannot act for job 'job-a'"):
        await b.release(job_id="job-a")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orch.port}") as ch:
        md = (("authorization", "Bearer token-b"),)
        leases = lease_pb2_grpc.LeaseServiceStub(ch)
        for call in (
            leases.Heartbeat(
                lease_pb2.HeartbeatRequest(job_id="job-a", group_id="t", fencing_token=token), metadata=md, timeout=5
            ),
            leases.GetLease(lease_pb2.GetLeaseRequest(job_id="job-a", group_id="t"), metadata=md, timeout=5),
        ):
            assert await _code(call) == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(LeaseError, match="PERMISSION_DENIED"):
        await b.publish_weights(WeightUpdate(1, "files", "/w"), job_id="job-a", group_id="g")
    assert _counter("llmd_timeslice_permission_denied_calls_total", reason="other_job") == before + 4
    assert orch.orchestrator.groups["t"].holder == "job-a", "job-a still holds the group"
    await a.release()


async def test_control_token_acts_for_jobs_unless_job_tokens_are_required(job_stack):
    orch, _ = job_stack
    admin = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="job-a", group_id="t", token=TOKEN)
    try:
        await admin.acquire(timeout_sec=10)
        await admin.release()
        orch.jobs.require = True
        with pytest.raises(LeaseError, match=r"PERMISSION_DENIED.*must call with its own job token"):
            await admin.acquire(timeout_sec=10)
        other = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="unlisted", group_id="t", token=TOKEN)
        await other.acquire(timeout_sec=10)  # jobs without a token of their own still use the control token
        await other.release()
        await other.close()
    finally:
        await admin.close()


async def test_a_caller_that_only_knows_the_job_id_cannot_yield_a_heartbeating_holder():
    orch = OrchestratorServer(_inventory(), port=0, token=TOKEN, actions=_Noop())
    await orch.start()
    holder = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="job-a", group_id="t", token=TOKEN)
    try:
        await holder.acquire(timeout_sec=10)
        await asyncio.sleep(0.1)
        await _until_armed(orch)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orch.port}") as ch:
            stub = opb_grpc.TimeSliceOrchestratorServiceStub(ch)
            md = (("authorization", f"Bearer {TOKEN}"),)
            code = await _code(stub.Yield(opb.YieldRequest(job_id="job-a", group_id="t"), metadata=md, timeout=5))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            code = await _code(
                stub.Yield(
                    opb.YieldRequest(job_id="job-a", group_id="t"),
                    metadata=(*md, ("x-llmd-timeslice-fencing-token", "999")),
                    timeout=5,
                )
            )
            assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert orch.orchestrator.groups["t"].holder == "job-a"
        await holder.release()  # the holder passes its token
        assert orch.orchestrator.groups["t"].holder is None
    finally:
        await holder.close()
        await orch.stop()


async def _until_armed(orch) -> None:
    for _ in range(200):
        lease = orch.orchestrator.groups["t"].lease
        if lease is not None and lease.expires_at is not None:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the lease was never armed by a heartbeat")


@pytest.fixture(scope="module")
def pki():
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("trainer-0.jobs.local")
    other_ca = trustme.CA()
    stranger = other_ca.issue_cert("stranger")

    def files(cert, authority) -> tls.TlsFiles:
        return tls.TlsFiles(
            cert.cert_chain_pems[0].bytes() + b"".join(p.bytes() for p in cert.cert_chain_pems[1:]),
            cert.private_key_pem.bytes(),
            authority.cert_pem.bytes(),
        )

    return {"server": files(server, ca), "client": files(client, ca), "stranger": files(stranger, other_ca)}


async def test_mutual_tls_end_to_end_and_peers_without_a_good_certificate_are_refused(pki, monkeypatch):
    engine = FakeVllm().start()
    sidecar = SidecarServer({"s": VllmBackend(engine.url, idle_timeout_s=1)}, port=0, token=TOKEN, tls_files=pki["server"])
    await sidecar.start()
    addr = engine.url.removeprefix("http://")
    # The orchestrator serves with the server certificate and calls sidecars with it (it is a client there too).
    orch = OrchestratorServer(_inventory(addr, f"127.0.0.1:{sidecar.port}"), port=0, token=TOKEN, tls_files=pki["server"])
    await orch.start()
    gate = GateServer(
        GateConfig(ext_proc_port=0, control_port=0, orchestrator=f"127.0.0.1:{orch.port}", token=TOKEN), tls_files=pki["client"]
    )
    await gate.start()
    target = f"127.0.0.1:{orch.port}"
    try:
        await asyncio.wait_for(gate.subscription.connected.wait(), 10)  # the state stream runs over mTLS
        good = AsyncTimeSliceOrchestratorClient(target, job_id="trainer", group_id="g", token=TOKEN, tls_files=pki["client"])
        await good.acquire(timeout_sec=30)  # drain via the gate, sleep via the sidecar: all over mTLS
        assert engine.level == 1
        await good.release()
        await good.close()
        for name, make in [
            ("plaintext", lambda: grpc.aio.insecure_channel(target)),
            ("certificate from another CA", lambda: tls.aio_channel(target, pki["stranger"])),
            (
                "no client certificate",
                lambda: grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=pki["client"].ca)),
            ),
        ]:
            async with make() as ch:
                code = await _code(
                    opb_grpc.TimeSliceOrchestratorServiceStub(ch).ListGroups(
                        opb.ListGroupsRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=3
                    )
                )
            assert code == grpc.StatusCode.UNAVAILABLE, name
        # The environment configures every component and client the same way.
        monkeypatch.setenv(tls.CERT_ENV, "/nonexistent/cert.pem")
        with pytest.raises(ValueError, match="needs LLMD_TIMESLICE_TLS_CERT_FILE"):
            tls.from_env()
    finally:
        await gate.stop()
        await orch.stop()
        await sidecar.stop()
        engine.stop()


def test_every_channel_caps_the_reconnect_backoff_unless_the_caller_sets_it():
    from llmd_timeslice import tls

    merged = dict(tls._with_backoff({"options": [("grpc.max_reconnect_backoff_ms", 1000), ("x", 1)]})["options"])
    assert merged == {
        "grpc.initial_reconnect_backoff_ms": 500,
        "grpc.min_reconnect_backoff_ms": 500,
        "grpc.max_reconnect_backoff_ms": 1000,
        "x": 1,
    }
    assert dict(tls._with_backoff({})["options"])["grpc.max_reconnect_backoff_ms"] == 5000
    tls.channel("127.0.0.1:1", options=[("x", 1)]).close()  # accepted by grpc as given
