"""The gate's stop with a real Envoy connected (both edges): Envoy's long-lived streams to the gate (endpoint
discovery, access logs, health) do not hold the stop for its grace, while a request already on an engine, whose
ext_proc stream waits for the engine's response headers, is given the grace and completes (docs/gate.md)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from epp_plugin.gate.pool_state import EndpointState
from tests.support.router import ALL_CHAINS, RouterStack, start_router
from tests.support.upstream import UpstreamServer
from tests.support.waits import until

pytestmark = pytest.mark.envoy

LONG_GRACE_S = 60.0  # far longer than the bound each test waits for the stop: a stop that waits it out fails


@pytest.fixture(params=ALL_CHAINS)
async def router(request, artifacts):
    up = UpstreamServer().start()
    stack = await start_router(artifacts, [up.address], edge=request.param)
    stack.pool().set_states([(up.address, EndpointState.SERVING, 0)])
    yield stack, up
    await asyncio.to_thread(stack.envoy.stop)
    await stack.picker.stop(0.5)
    up.stop()


async def _stop_gate(stack: RouterStack) -> None:
    await asyncio.wait_for(stack.gate.stop(LONG_GRACE_S), LONG_GRACE_S / 3)


async def test_a_request_on_its_engine_when_the_gate_stops_completes_and_envoys_own_streams_do_not_hold_the_stop(router):
    """The stop waits for the request's response headers (its ext_proc stream), then returns well before the grace:
    the endpoint-discovery and access-log streams Envoy keeps open (ext_authz-pick, every chain's access log) do not
    count."""
    stack, up = router
    async with httpx.AsyncClient(timeout=30) as c:
        call = asyncio.create_task(c.get(stack.url + "/v1/late_headers?delay_ms=1000"))
        await until(lambda: up.hits == 1, 10, "the request reached its engine")
        stopping = asyncio.create_task(_stop_gate(stack))
        r = await call
        assert r.status_code == 200 and r.json()["served_by"] == up.address, r.text
        await stopping
