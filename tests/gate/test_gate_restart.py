"""The gate process dies and comes back while requests are held or in flight (real Envoy, gate as a real process),
on both edges.

What the client sees (Envoy 1.40, the rendered config: failure_mode_allow false, status_on_error 503, never an
unsteered request to a sleeping engine, never a hang): on the ext_authz edge Envoy sends a broken or refused check
again (10 times, growing back-off), so held requests (and new ones) are held again by the restarted gate; past
that, and at once on the ext_proc edge, a 503 with ``x-llmd-timeslice-reason: gate_unavailable`` and ``retry-after: 1`` (Envoy's
local-reply mapping), which ``TimeSliceRollouts`` repeats. The restarted gate resyncs its endpoint states from the
orchestrator's state stream and serves again.

A request in flight when the gate dies: on the ext_authz edge it was admitted and no longer needs the gate, so it
completes; the restarted gate does not count it (its access-log entry names the old process's admission and is
ignored), so a drain right after a gate restart relies on the engine's own idle check, as docs/gate.md says. On the
ext_proc edge Envoy resets it (its ext_proc stream is gone and failure_mode_allow is false).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import port_for
import pytest

from epp_plugin.gate.pool_state import EndpointState
from epp_plugin.gate.server import READINESS_SERVICE, GateConfig, GateServer
from epp_plugin.picker.server import PickerConfig, PickerServer
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as gpb
from llmd_timeslice.client.integrations.rollouts import GateRetryPolicy, TimeSliceRollouts
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.local.commands import GateCommand
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.router.envoy_config import GATE_UNAVAILABLE
from llmd_timeslice.router.envoy_launcher import EnvoyProcess
from tests.support.cli import CliProcess
from tests.support.router import EDGES, envoy_config
from tests.support.upstream import UpstreamServer

pytestmark = pytest.mark.envoy


async def _until_ready(control_port: int, timeout_s: float = 30.0) -> None:
    """Wait until the gate's readiness service answers SERVING (it has synced with the orchestrator)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(f"127.0.0.1:{control_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            r = await stub.Check(health_pb2.HealthCheckRequest(service=READINESS_SERVICE), timeout=5, wait_for_ready=True)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return
            assert time.monotonic() < deadline, "the restarted gate never became ready (synced)"
            await asyncio.sleep(0.05)


def _gate(artifacts, orch_port: int, ports: tuple[int, int, int]) -> CliProcess:
    """``llmd-timeslice gate`` in a child process (its log appended across restarts), ready once its control port
    listens."""
    ext_proc_port, authz_port, control_port = ports
    token_file = artifacts / "token"
    token_file.write_text("tok")
    cmd = GateCommand(
        ext_proc_port=ext_proc_port,
        authz_port=authz_port,
        control_port=control_port,
        orchestrator=f"127.0.0.1:{orch_port}",
        gate_id="gate-0",
        token_file=token_file,
        log_level="info",
    )
    return CliProcess(cmd.args(), control_port, artifacts / "gate.log")


async def _held(control_port: int) -> int:
    """Requests the gate process on ``control_port`` holds now (its control service's pool status)."""
    import grpc

    from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2_grpc as gpb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{control_port}") as ch:
        status = await gpb_grpc.GateControlServiceStub(ch).GetPoolStatus(
            gpb.GetPoolStatusRequest(pool="default"), metadata=(("authorization", "Bearer tok"),), timeout=5
        )
    return status.held


async def _until_held(control_port: int, n: int, what: str, waiting: list[asyncio.Task], timeout_s: float = 30.0) -> None:
    """Wait until the gate process holds ``n`` requests, or one of ``waiting`` is answered (the caller asserts)."""
    deadline = time.monotonic() + timeout_s
    while (held := await _held(control_port)) != n and not any(t.done() for t in waiting):
        assert time.monotonic() < deadline, f"{what}: the gate holds {held}, not {n}"
        await asyncio.sleep(0.05)


def _refused_5xx(envoy: EnvoyProcess) -> int:
    """The 5xx answers Envoy's listener sent so far (admin stats)."""
    for line in envoy.stats(r"^http\.inference\.downstream_rq_5xx$").splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "http.inference.downstream_rq_5xx":
            return int(value)
    return 0


def _is_gate_unavailable(r: httpx.Response) -> bool:
    return (
        r.status_code == 503
        and r.headers.get("x-llmd-timeslice-reason") == GATE_UNAVAILABLE
        and r.headers.get("retry-after") == "1"
    )


@pytest.mark.parametrize("edge", EDGES)
async def test_gate_killed_while_holding_loses_no_held_request_and_restart_resyncs(artifacts, edge):
    """SIGKILL of the gate while it holds a request, then a restart.

    ext_authz: Envoy sends the broken check again (``authz_retry_policy``) until the restarted gate answers, so the
    held request, and one sent while the gate is down, are held again and served once the endpoint serves.
    ext_proc: the held request's stream breaks and Envoy answers 503 at once; the local-reply mapping makes it the
    retryable refusal ``gate_unavailable`` (reason + ``retry-after: 1``), which ``TimeSliceRollouts`` repeats until
    the restarted gate serves it."""
    up = UpstreamServer().start()
    orch = OrchestratorServer(
        Inventory.model_validate({"groups": [{"group_id": "g"}]}), port=0, token="tok", reconcile_on_start=False
    )
    await orch.start()
    await orch.hub.publish("default", [(up.address, gpb.ENDPOINT_STATE_SERVING, 0)])
    ports = (port_for.select_random(), port_for.select_random(), port_for.select_random())
    ext_proc_port, authz_port, control_port = ports
    gate = _gate(artifacts, orch.port, ports)
    await gate.start()
    picker = PickerServer(PickerConfig(port=0, pools={"default": [up.address]}))
    await picker.start()
    envoy = EnvoyProcess(envoy_config(edge, gate_port=ext_proc_port, authz_port=authz_port, epp_port=picker.port), artifacts)
    await asyncio.to_thread(envoy.start)
    rollouts = TimeSliceRollouts(envoy.url, retry=GateRetryPolicy(budget_s=60))
    try:
        async with httpx.AsyncClient(timeout=30) as c, rollouts.async_http_client() as rc:
            # One request in flight (a slow stream), then the endpoint sleeps and one request is held.
            async with c.stream("GET", envoy.url + "/v1/stream?chunks=10&gap_ms=120") as streaming:
                await orch.hub.publish("default", [(up.address, gpb.ENDPOINT_STATE_ASLEEP, 0)])
                hits = up.hits
                held = asyncio.create_task(c.get(envoy.url + "/v1/completions"))
                held_rollout = asyncio.create_task(rc.get(envoy.url + "/v1/completions"))
                await _until_held(control_port, 2, "both requests held before the gate is killed", [held, held_rollout])
                assert not held.done() and not held_rollout.done()
                os.kill(gate.proc.pid, signal.SIGKILL)
                if edge == "ext_authz":
                    during = asyncio.create_task(c.get(envoy.url + "/v1/completions"))
                    await asyncio.sleep(0.5)
                    assert not held.done() and not during.done(), "the check is retried: still held, not failed"
                else:
                    r = await asyncio.wait_for(held, 10)
                    assert _is_gate_unavailable(r), f"held request after a gate crash: {r.status_code} {r.headers}"
                    r = await c.get(envoy.url + "/v1/completions")
                    assert _is_gate_unavailable(r), f"while the gate is down: {r.status_code} {r.headers} {r.text!r}"
                    assert not held_rollout.done(), "TimeSliceRollouts repeats gate_unavailable"
                assert up.hits == hits, "nothing reached the sleeping endpoint"
                body = b""
                try:
                    async for chunk in streaming.aiter_bytes():
                        body += chunk
                    completed = b"data: [DONE]" in body
                except httpx.HTTPError:
                    completed = False
                if edge == "ext_authz":
                    assert completed, "an admitted request needs the gate no more: it must complete"
                else:
                    assert not completed, "ext_proc: Envoy resets a request whose gate stream died"
            gate.stop()
            gate = _gate(artifacts, orch.port, ports)
            await gate.start()
            await _until_ready(control_port)
            fresh = asyncio.create_task(c.get(envoy.url + "/v1/completions"))  # the restarted gate resyncs: ASLEEP -> held
            waiting = [fresh, held_rollout] + ([held, during] if edge == "ext_authz" else [])
            await _until_held(control_port, len(waiting), "every waiting request held again by the restarted gate", waiting)
            early = [t.result() for t in waiting if t.done()]
            assert not early, (
                "after resync the endpoint is still ASLEEP: requests must be held, got "
                f"{[(r.status_code, r.headers.get('x-llmd-timeslice-reason'), r.text) for r in early]}"
            )
            await orch.hub.publish("default", [(up.address, gpb.ENDPOINT_STATE_SERVING, 0)])
            for t in waiting:
                r = await asyncio.wait_for(t, 15)
                assert r.status_code == 200 and r.json()["served_by"] == up.address, (r.status_code, r.text)
            [record] = [rec for rec in rollouts.records if rec.ok]
            if edge == "ext_proc":
                assert GATE_UNAVAILABLE in record.refusals, record
    finally:
        await asyncio.to_thread(envoy.stop)
        gate.stop()
        await picker.stop()
        await orch.stop()
        up.stop()


@pytest.mark.parametrize("edge", EDGES)
async def test_gate_down_longer_than_envoy_waits_is_a_retryable_refusal_that_rollouts_repeat(artifacts, edge):
    """No gate at all (one check retry on the fast path): the client gets 503 ``gate_unavailable`` with
    ``retry-after: 1`` (and, on the fast path, the refusals' JSON body); ``TimeSliceRollouts`` repeats it until a gate
    is up and the request is served."""
    up = UpstreamServer().start()
    ports = (port_for.select_random(), port_for.select_random())
    picker: PickerServer | None
    if edge == "ext_proc":
        picker = PickerServer(PickerConfig(port=0, pools={"default": [up.address]}))
        await picker.start()
        cfg = envoy_config(edge, gate_port=ports[0], authz_port=ports[1], epp_port=picker.port)
    else:
        picker = None
        cfg = envoy_config("ext_authz-pick", gate_port=ports[0], authz_port=ports[1], epp_port=None, gate_check_retries=1)
    envoy = EnvoyProcess(cfg, artifacts)
    await asyncio.to_thread(envoy.start)
    gate = None
    rollouts = TimeSliceRollouts(envoy.url, retry=GateRetryPolicy(budget_s=60))
    try:
        async with httpx.AsyncClient(timeout=30) as c, rollouts.async_http_client() as rc:
            r = await c.post(envoy.url + "/v1/completions", json={"prompt": "x"})
            assert _is_gate_unavailable(r), f"{r.status_code} {r.headers} {r.text!r}"
            if edge == "ext_authz":
                assert r.json()["error"]["type"] == GATE_UNAVAILABLE, r.text
            pending = asyncio.create_task(rc.post(envoy.url + "/v1/completions", json={"prompt": "x"}))
            deadline = time.monotonic() + 30
            while await asyncio.to_thread(_refused_5xx, envoy) < 2:  # the rollout's first try refused too
                assert time.monotonic() < deadline, "the rollout's first try was never answered"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # its answer reached TimeSliceRollouts, which waits retry-after (1 s) to repeat
            assert not pending.done(), "TimeSliceRollouts repeats gate_unavailable"
            gate = GateServer(GateConfig(ext_proc_port=ports[0], authz_port=ports[1], control_port=0))
            await gate.start()
            gate.pools["default"].set_states([(up.address, EndpointState.SERVING, 0)])
            r = await asyncio.wait_for(pending, 15)
            assert r.status_code == 200 and r.json()["served_by"] == up.address, (r.status_code, r.text)
            [record] = rollouts.records
            assert record.ok and GATE_UNAVAILABLE in record.refusals, record
    finally:
        await asyncio.to_thread(envoy.stop)
        if gate is not None:
            await gate.stop(0.5)
        if picker is not None:
            await picker.stop()
        up.stop()
