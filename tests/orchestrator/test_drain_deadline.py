"""The drain deadline, through real Envoy, the real gate, orchestrator and sidecar over gRPC, and a slow endpoint
picker (a delaying TCP proxy between Envoy and the picker): a request admitted before the drain but still on its way
when the deadline passes is answered 503 ``drain_deadline`` (retryable) and never reaches the engine after it sleeps;
the switch result names it. The ext_proc edge: the fast path answers a check once and cannot cut (docs/gate.md)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from llmd_timeslice import protocol
from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from tests.support.fake_engines import FakeVllm
from tests.support.router import start_router
from tests.support.waits import until

pytestmark = pytest.mark.envoy

PICKER_DELAY_S = 2.0  # twice the drain deadline: the picker answers well after it passed
DRAIN_TIMEOUT_S = 1.0


@pytest.fixture
async def slow_picker_stack(artifacts):
    engine = FakeVllm().start()
    sidecar = SidecarServer({"s0": VllmBackend(engine.url, idle_timeout_s=1, probe=False)}, port=0, token="t")
    await sidecar.start()
    addr = engine.url.removeprefix("http://")
    inv = Inventory.model_validate(
        {
            "groups": [
                {
                    "group_id": "g",
                    "drain_timeout_s": DRAIN_TIMEOUT_S,
                    "samplers": [{"pool": "default", "address": addr, "sidecar": f"127.0.0.1:{sidecar.port}", "job_id": "s0"}],
                }
            ]
        }
    )
    orch = OrchestratorServer(inv, port=0, token="t")
    await orch.start()
    router = await start_router(
        artifacts,
        [addr],
        picker_delay_s=PICKER_DELAY_S,
        epp_message_timeout_s=10,
        edge="ext_proc",
        orchestrator=f"127.0.0.1:{orch.port}",
        token="t",
        max_hold_s=30,
    )
    await asyncio.wait_for(router.gate.subscription.connected.wait(), 10)
    client = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="g", token="t")
    yield engine, addr, orch, router, client
    await client.close()
    await router.stop()
    await orch.stop()
    await sidecar.stop()
    engine.stop()


async def test_request_still_travelling_at_the_drain_deadline_gets_a_retryable_503_and_never_reaches_the_asleep_engine(
    slow_picker_stack,
):
    engine, addr, orch, router, client = slow_picker_stack
    pool, picker_path = router.pool(), router.picker_proxy
    assert picker_path is not None
    late_before = picker_path.delivered_late
    async with httpx.AsyncClient(timeout=30) as c:
        req = asyncio.create_task(
            c.post(
                router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"x-request-id": "travelling-1"}
            )
        )
        for _ in range(100):  # admitted (counted against the engine), now waiting on the slow picker
            if pool.in_flight([addr])[addr] == 1:
                break
            await asyncio.sleep(0.02)
        assert pool.in_flight([addr])[addr] == 1, "the request was not admitted"
        await client.acquire(timeout_sec=30)  # drain (deadline 1 s), then the engine sleeps
        assert engine.level == 1
        r = await asyncio.wait_for(req, 10)
    assert r.status_code == 503, r.text
    assert r.headers[protocol.REASON_HEADER] == "drain_deadline" and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "drain_deadline"
    # The picker's late answer has reached Envoy (nothing held back any more), and Envoy had 0.5 s to act on it.
    await until(lambda: picker_path.delivered_late > late_before and picker_path.held_back == 0, what="the late answer")
    await asyncio.sleep(0.5)
    assert engine.paths().count("/v1/completions") == 0, "the cut request reached the engine"
    assert engine.completions_while_asleep == 0
    assert pool.in_flight([addr])[addr] == 0 and pool.live == 0
    record = orch.orchestrator.groups["g"].history[-1]
    assert record.kind == "to_job" and record.drain_cut == ["travelling-1"], record
    await client.release()


async def test_response_already_flowing_at_the_drain_deadline_completes_on_the_engine(slow_picker_stack):
    """The other half of the rule: a request whose response has started is not cut; the sleep (mode=wait) lets it end."""
    engine, _addr, orch, router, client = slow_picker_stack
    pool = router.pool()
    assert router.picker_proxy is not None
    router.picker_proxy.delay_s = 0  # a picker answering at once: the response starts before the drain
    engine.completion_delay_s = 2.0  # the stream's headers are out at once, its last event 2 s later (past the deadline)
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream(
            "POST", router.url + "/v1/completions", json={"stream": True}, headers={"x-request-id": "flowing-1"}
        ) as r:
            assert r.status_code == 200  # response headers passed the gate: the served endpoint is known
            acquire = asyncio.create_task(client.acquire(timeout_sec=30))
            body = b"".join([chunk async for chunk in r.aiter_bytes()])
        await acquire
    assert b"[DONE]" in body, body
    record = orch.orchestrator.groups["g"].history[-1]
    assert record.drain_cut == [], record
    for _ in range(100):  # the gate's stream ends right after the response's last byte
        if pool.live == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.completions_while_asleep == 0 and pool.live == 0
    await client.release()
