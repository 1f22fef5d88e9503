"""When the gate picks (the local stack's chain): a refused connection is retried on the next endpoint the gate
listed, the refusing endpoint leaves the gate's picks at once, and request bodies up to the route's buffer limit are
retried with them (docs/gate.md, "When an engine dies"). Real Envoy (EDS cluster from the gate, override_host
policy), real HTTP upstream; the dead endpoint is a loopback port nothing listens on (connection refused)."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import port_for
import pytest

from epp_plugin.gate.endpoint_discovery import ACK_WAIT_S, EndpointDirectory
from epp_plugin.gate.pool_state import EndpointState as S
from epp_plugin.gate.pool_state import PoolState
from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice import protocol
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2 as pb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2_grpc as pb_grpc
from llmd_timeslice.orchestrator.gate_hub import GateHub
from llmd_timeslice.router.envoy_config import EnvoyRouterConfig, render_bootstrap
from tests.support.router import start_router
from tests.support.upstream import UpstreamServer
from tests.support.waits import until

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
MB3 = 3_000_000


async def test_a_failed_endpoint_leaves_the_picks_until_its_state_changes_or_its_hold_passes():
    pool = PoolState("p")
    pool.set_states([(A, S.SERVING, 0), (B, S.SERVING, 0)])
    assert pool.mark_failed(A, 0.2) and not pool.mark_failed(A, 0.2), "only the first failure counts"
    assert pool.serving() == (B,)
    await asyncio.sleep(0.3)
    assert pool.serving() == (A, B), "tried again after its hold"
    pool.mark_failed(A, 0)
    pool.set_states([(A, S.SERVING, 0)])
    assert pool.serving() == (B,), "the same state again says nothing new"
    pool.set_states([(A, S.WAKING, 0)])
    pool.set_states([(A, S.SERVING, 0)])
    assert pool.serving() == (A, B) and not pool.failed, "a new state from the orchestrator governs"
    assert not pool.mark_failed("10.9.9.9:1", 1), "an unknown endpoint is not marked"


def test_the_failed_endpoint_hold_is_a_gate_setting(monkeypatch):
    """`gate.failed_endpoint_hold_s` (default 5 s) from the environment (as `up`'s children inherit it), a duration."""
    from epp_plugin.gate.server import GateConfig
    from llmd_timeslice.config.sources import load_config

    assert GateConfig(ext_proc_port=0, control_port=0).failed_endpoint_hold_s == 5.0
    monkeypatch.setenv("LLMD_TIMESLICE_GATE__FAILED_ENDPOINT_HOLD_S", "1500ms")
    cfg = GateConfig.from_settings(load_config(None).gate, token=None)
    assert cfg.failed_endpoint_hold_s == 1.5


def test_the_gate_picking_config_routes_by_the_gates_list_and_never_to_an_endpoint_it_did_not_name():
    boot = render_bootstrap(EnvoyRouterConfig(1, 2, 3, None, authz_port=5))
    [cluster] = [c for c in boot["static_resources"]["clusters"] if c["name"] == "endpoints"]
    assert cluster["type"] == "EDS"
    lb = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert lb["name"] == "envoy.load_balancing_policies.override_host"
    assert lb["typed_config"]["override_host_sources"] == [{"header": "x-gateway-destination-endpoint"}]
    fallback = lb["typed_config"]["fallback_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
    assert fallback["fallback_policy"] == "NO_FALLBACK", "no listed host: 503, not some other engine"
    route = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]
    [api] = [r for r in route["virtual_hosts"][0]["routes"] if r["match"].get("prefix") == "/v1/"]
    assert api["route"]["retry_policy"]["retry_on"] == "connect-failure,reset-before-request"
    assert api["request_body_buffer_limit"] == 16 * 1024 * 1024
    http_service = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0][
        "typed_config"
    ]["http_service"]
    # Envoy makes the back-off's max_interval the check's per-try timeout (convertCoreToRouteRetryPolicy): it must not
    # cut a hold, so it is the check's own timeout.
    assert http_service["retry_policy"]["retry_back_off"]["max_interval"] == http_service["server_uri"]["timeout"]


async def _stack(artifacts, dead: str, live: UpstreamServer, **envoy_kw):
    st = await start_router(artifacts, [dead, live.address], edge="ext_authz-pick", envoy_kw=envoy_kw)
    pool = st.pool()
    pool.set_states([(dead, S.ASLEEP, 0), (live.address, S.SERVING, 0)])
    await asyncio.wait_for(st.gate.directory.wait_known((dead, live.address)), 10)
    return st, pool


async def _held_then_released_to_the_dead_endpoint_first(st, pool, dead: str, live: UpstreamServer, body: bytes):
    """A request held while its body uploads, released when both endpoints serve, the dead one listed first (the
    live one has a stream in flight, so the dead one has fewer requests: least in flight)."""
    async with httpx.AsyncClient(timeout=30) as c, c.stream("GET", st.url + "/v1/stream?chunks=8&gap_ms=250"):
        # DRAINING, not ASLEEP: an endpoint published ASLEEP was verified idle, so the gate would end the stream's count.
        pool.set_states([(live.address, S.DRAINING, 0)])
        held = asyncio.create_task(c.post(st.url + "/v1/completions", content=body))
        await asyncio.sleep(0.5)
        assert pool.held == 1 and pool.in_flight([dead, live.address]) == {dead: 0, live.address: 1}
        pool.set_states([(dead, S.SERVING, 0), (live.address, S.SERVING, 0)])
        return await asyncio.wait_for(held, 20)


@pytest.mark.envoy
async def test_a_held_multi_mb_request_refused_by_its_endpoint_is_served_by_the_next_one(artifacts):
    live = UpstreamServer().start()
    dead = f"127.0.0.1:{port_for.select_random()}"
    st, pool = await _stack(artifacts, dead, live)
    try:
        r = await _held_then_released_to_the_dead_endpoint_first(st, pool, dead, live, b"x" * MB3)
        assert r.status_code == 200, r.text
        assert r.json()["served_by"] == live.address and r.json()["body_bytes"] == MB3, "the whole body, retried"
        # Its UF entry reaches the gate within a flush interval (20 ms), maybe after the response.
        await until(lambda: dead in pool.failed, 5, "the refusing endpoint out of the picks at its first refusal")
        assert pool.serving() == (live.address,)
        async with httpx.AsyncClient(timeout=10) as c:
            for _ in range(4):
                assert (await c.post(st.url + "/v1/completions", content=b"{}")).json()["served_by"] == live.address
    finally:
        await st.stop()
        live.stop()


@pytest.mark.envoy
async def test_a_body_above_the_route_buffer_limit_is_not_retried(artifacts):
    """The documented limit: past ``request_body_buffer_limit`` Envoy gives the retry up (503 from Envoy); the gate
    still takes the refusing endpoint out at once, so the client's own retry is served."""
    live = UpstreamServer().start()
    dead = f"127.0.0.1:{port_for.select_random()}"
    st, pool = await _stack(artifacts, dead, live, request_body_buffer_bytes=256 * 1024)
    try:
        r = await _held_then_released_to_the_dead_endpoint_first(st, pool, dead, live, b"x" * 1_000_000)
        assert r.status_code == 503 and "upstream connect error" in r.text, (r.status_code, r.text)
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(st.url + "/v1/completions", content=b"x" * 1_000_000)
        assert r.status_code == 200 and r.json()["served_by"] == live.address
    finally:
        await st.stop()
        live.stop()


async def test_an_endpoint_failure_report_without_an_address_is_refused_with_a_clear_error():
    hub = GateHub()
    called: list[tuple[str, str]] = []
    hub.on_endpoint_failure = lambda addr, why: called.append((addr, why)) or True
    server = grpc.aio.server()
    pb_grpc.add_GateStateServiceServicer_to_server(hub, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.GateStateServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ReportEndpointFailure(pb.EndpointFailure(gate_id="g", pool="p"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "address" in err.value.details()
            ack = await stub.ReportEndpointFailure(pb.EndpointFailure(gate_id="g", pool="p", address=A, reason="UF"))
            assert ack.audited and called == [(A, "gate g saw a failed connection (UF)")]
    finally:
        await server.stop(0)


async def test_the_gate_lists_fallbacks_only_to_an_envoy_that_takes_its_endpoints_by_eds():
    """An Envoy rendered before EDS (ORIGINAL_DST cluster, no ``x-llmd-timeslice-eds`` on its checks) gets one address,
    as ORIGINAL_DST reads one; with the header, the ordered list (here after waiting ``ack_wait_s``, 0.2 s instead of
    ``ACK_WAIT_S``, for an EDS stream that never comes)."""
    gate = GateServer(GateConfig(ext_proc_port=0, authz_port=0, control_port=0))
    await gate.start()
    assert gate.directory is not None and gate.directory.ack_wait_s == ACK_WAIT_S
    gate.directory.ack_wait_s = 0.2
    gate.pools["default"].set_states([(A, S.SERVING, 0), (B, S.SERVING, 0)])
    pick = {protocol.POOL_HEADER: "default", protocol.PICK_HEADER: protocol.PICK_LEAST_IN_FLIGHT}
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            url = f"http://127.0.0.1:{gate.authz_port}/v1/completions"
            r = await c.get(url, headers=pick)
            assert r.status_code == 200 and r.headers[protocol.DESTINATION_HEADER] in (A, B)
            r = await c.get(url, headers={**pick, protocol.EDS_HEADER: "1"})
            assert r.status_code == 200 and sorted(r.headers[protocol.DESTINATION_HEADER].split(",")) == [A, B]
    finally:
        await gate.stop()


async def test_the_directorys_ack_wait_is_its_default_wait_for_an_eds_stream():
    """``wait_known`` without a timeout waits the directory's ``ack_wait_s`` (``ACK_WAIT_S`` unless set), then says
    the endpoints are unknown (no EDS stream acked them)."""
    directory = EndpointDirectory({})
    assert directory.ack_wait_s == ACK_WAIT_S
    directory.ack_wait_s = 0.1
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await asyncio.wait_for(directory.wait_known((A,)), ACK_WAIT_S) is False
    assert loop.time() - t0 >= 0.09, "returned before its ack_wait_s"


@pytest.mark.envoy
async def test_with_an_epp_a_refusing_endpoint_leaves_the_subset_hint_at_its_first_refused_connection(artifacts):
    """Behind an EPP (ORIGINAL_DST) the request that met the dead endpoint fails (the EPP named one address), but
    the gate leaves that endpoint out of every later subset hint: the EPP can no longer pick it."""
    live = UpstreamServer().start()
    dead = f"127.0.0.1:{port_for.select_random()}"
    st = await start_router(artifacts, [dead, live.address], edge="ext_authz")
    pool = st.pool()
    pool.set_states([(dead, S.SERVING, 0), (live.address, S.SERVING, 0)])
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            statuses = []
            for _ in range(10):  # the picker spreads requests: one reaches the dead endpoint
                statuses.append((await c.post(st.url + "/v1/completions", content=b"{}")).status_code)
                if statuses[-1] != 200:
                    break
            assert 503 in statuses, statuses
            await until(lambda: dead in pool.failed, 5, "the refusing endpoint out of the subset hints")
            for _ in range(6):
                r = await c.post(st.url + "/v1/completions", content=b"{}")
                assert r.status_code == 200 and r.json()["served_by"] == live.address
    finally:
        await st.stop()
        live.stop()
