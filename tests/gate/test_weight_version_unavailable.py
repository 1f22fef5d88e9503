"""A request for a weight version nobody can publish is refused at once (issue 38 §5).

``x-llmd-timeslice-min-weight-version: 999`` on a pool whose newest version is lower used to be held to the longest
hold (120 s by default) and then refused. The orchestrator tells the gates, per pool, whether a newer version can
come (``weights_final`` on the state stream: no job holds or waits for the pool's group and none is pending); while
none can, the gate refuses such a request at once, naming the newest version there is.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from epp_plugin.gate.pool_state import EndpointState, PoolState, WeightVersionUnavailable
from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice import protocol
from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
from llmd_timeslice.orchestrator.server import OrchestratorServer
from tests.support.one_sampler import one_sampler
from tests.support.waits import until

A = "10.0.0.1:8000"


async def test_a_version_above_the_newest_is_refused_at_once_only_while_none_can_come():
    pool = PoolState("p", max_hold_s=60)
    pool.set_states([(A, EndpointState.SERVING, 3)])
    assert pool.try_admit(min_version=999) is None, "a newer version may come: held (as before)"
    pool.set_weights_final(True)
    with pytest.raises(WeightVersionUnavailable) as err:
        pool.try_admit(min_version=999)
    assert "no weight version >= 999 (header x-llmd-timeslice-min-weight-version)" in err.value.message
    assert "the newest there is is 3" in err.value.message and err.value.http_status == 503
    assert pool.try_admit(min_version=3) is not None, "a version the pool has is admitted as before"
    assert pool.band_stats[0].refused_total == {"weight_version_unavailable": 1}


async def test_a_request_held_for_a_version_is_refused_when_none_can_come_any_more():
    pool = PoolState("p", max_hold_s=60)
    pool.set_states([(A, EndpointState.SERVING, 3)])
    held = asyncio.ensure_future(pool.admit(min_version=999))
    other = asyncio.ensure_future(pool.admit(min_version=0))
    await until(lambda: pool.held == 1 and other.done(), what="the request for 999 held, the other admitted")
    pool.set_weights_final(True)  # the trainer yielded without publishing it
    with pytest.raises(WeightVersionUnavailable, match="the newest there is is 3"):
        await asyncio.wait_for(held, 5)
    assert pool.held == 0
    pool.finish(other.result())


@pytest.fixture
async def stack():
    engine, addr, sidecar, inv = await one_sampler("t")
    orch = OrchestratorServer(inv, port=0, token="t")
    await orch.start()
    gate = GateServer(GateConfig(ext_proc_port=0, authz_port=0, control_port=0, orchestrator=f"127.0.0.1:{orch.port}", token="t"))
    await gate.start()
    await asyncio.wait_for(gate.subscription.connected.wait(), 10)
    client = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="g", token="t")
    yield addr, orch, gate, client
    await client.close()
    await gate.stop()
    await orch.stop()
    await sidecar.stop()
    engine.stop()


async def _check(gate: GateServer, version: str) -> httpx.Response:
    headers = {protocol.POOL_HEADER: "default", protocol.MIN_WEIGHT_VERSION_HEADER: version}
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.get(f"http://127.0.0.1:{gate.authz_port}/v1/completions", headers=headers)


async def test_min_weight_version_999_with_no_trainer_is_refused_at_once_by_the_gate_naming_the_newest(stack):
    addr, _, gate, client = stack
    pool = gate.pools["default"]
    await until(lambda: pool.serving() == (addr,) and pool.weights_final, what="serving, nobody can publish")
    r = await _check(gate, "999")  # held to the longest hold (120 s) before
    assert r.status_code == 429 and r.headers[protocol.STATUS_HEADER] == "503"  # a 503 carried as 429 (ext_authz)
    assert r.headers[protocol.REASON_HEADER] == "weight_version_unavailable"
    assert "no weight version >= 999" in r.json()["error"]["message"]
    assert "the newest there is is 0" in r.json()["error"]["message"]
    # A trainer waits for or holds the group: it may publish that version, so the request is held as before.
    await client.acquire(timeout_sec=30)
    await until(lambda: not pool.weights_final, what="the gate told a version can come")
    held = asyncio.ensure_future(_check(gate, "999"))
    await until(lambda: pool.held == 1, what="the request held")
    await client.release()  # yielded without publishing: nothing newer can come
    r = await asyncio.wait_for(held, 20)
    assert r.headers[protocol.REASON_HEADER] == "weight_version_unavailable", r.headers
