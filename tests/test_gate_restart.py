"""The gate process dies and comes back while requests are held or in flight (real Envoy, gate as a real process),
on both edges.

What the client sees (Envoy 1.40, the rendered config: failure_mode_allow false, status_on_error 503):
held requests end at once with 503, requests sent while the gate is down get 503 at once (never
an unsteered request to a sleeping engine, never a hang); the restarted gate resyncs its endpoint
states from the orchestrator's state stream and serves again.

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

from epp_plugin.envoy_launcher import EnvoyProcess
from epp_plugin.gate.server import READINESS_SERVICE
from epp_plugin.picker.server import PickerConfig, PickerServer
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as gpb
from llmd_timeslice.demo.stack import ComponentProcess
from llmd_timeslice.discovery.static import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
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


@pytest.mark.parametrize("edge", EDGES)
async def test_gate_crash_while_held_gives_503_at_once_and_restart_resyncs(artifacts, edge):
    up = UpstreamServer().start()
    orch = OrchestratorServer(
        Inventory.model_validate({"groups": [{"group_id": "g"}]}), port=0, token="tok", reconcile_on_start=False
    )
    await orch.start()
    await orch.hub.publish("default", [(up.address, gpb.ENDPOINT_STATE_SERVING, 0)])
    token_file = artifacts / "token"
    token_file.write_text("tok")
    ext_proc_port, authz_port, control_port = (port_for.select_random() for _ in range(3))
    args = [
        "gate",
        "--ext-proc-port",
        str(ext_proc_port),
        "--authz-port",
        str(authz_port),
        "--control-port",
        str(control_port),
        "--orchestrator",
        f"127.0.0.1:{orch.port}",
        "--gate-id",
        "gate-0",
        "--token-file",
        str(token_file),
        "--log-level",
        "info",
    ]
    gate = await asyncio.to_thread(ComponentProcess("gate", args, control_port, artifacts).start)
    picker = PickerServer(PickerConfig(port=0, pools={"default": [up.address]}))
    await picker.start()
    envoy = EnvoyProcess(envoy_config(edge, gate_port=ext_proc_port, authz_port=authz_port, epp_port=picker.port), artifacts)
    await asyncio.to_thread(envoy.start)
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            # One request in flight (a slow stream), then the endpoint sleeps and one request is held.
            async with c.stream("GET", envoy.url + "/v1/stream?chunks=6&gap_ms=300") as streaming:
                await orch.hub.publish("default", [(up.address, gpb.ENDPOINT_STATE_ASLEEP, 0)])
                hits = up.hits
                held = asyncio.create_task(c.get(envoy.url + "/v1/completions"))
                await asyncio.sleep(1.5)
                assert not held.done()
                t = time.monotonic()
                os.kill(gate.pid, signal.SIGKILL)
                r = await asyncio.wait_for(held, 10)
                assert r.status_code == 503, f"held request after a gate crash: {r.status_code} {r.text!r}"
                assert time.monotonic() - t < 2, "the client must learn at once, not after a timeout"
                r = await c.get(envoy.url + "/v1/completions")
                assert r.status_code == 503, "with the gate down, requests fail fast (failure_mode_allow false)"
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
            gate = await asyncio.to_thread(ComponentProcess("gate", args, control_port, artifacts).start)
            # Ready once resynced (its readiness service; until then it refuses with 503, as Kubernetes would not
            # route to it): on a loaded machine the first request could otherwise arrive before the state stream.
            await _until_ready(control_port)
            held = asyncio.create_task(c.get(envoy.url + "/v1/completions"))  # the restarted gate resyncs: ASLEEP -> held
            await asyncio.sleep(1.5)
            early = held.result() if held.done() else None
            assert early is None, (
                f"after resync the endpoint is still ASLEEP: the request must be held, got {early.status_code} "
                f"{early.headers.get('x-llmd-timeslice-reason')} {early.text!r}"
            )
            await orch.hub.publish("default", [(up.address, gpb.ENDPOINT_STATE_SERVING, 0)])
            r = await asyncio.wait_for(held, 10)
            assert r.status_code == 200 and r.json()["served_by"] == up.address
    finally:
        await asyncio.to_thread(envoy.stop)
        gate.stop()
        await picker.stop()
        await orch.stop()
        up.stop()
