"""The gate's ext_proc stream lives exactly as long as the response, for every response shape, through the real
Envoy binary: the drain barrier counts a request until its last byte (and not a moment longer).

Envoy 1.40 closes an ext_proc stream as soon as it expects no more messages on it (the stream-close optimisation,
a runtime guard in 1.37-1.39 and permanent since): with ``response_trailer_mode: SKIP`` right after the response
headers. The gate's filter sends trailers (``SEND``): Envoy does not synthesise trailers the upstream did not send,
so the stream ends when Envoy destroys the filter, i.e. when the HTTP stream ends, completed or reset
(docs/gate.md, "Envoy versions"). Each shape: an SSE stream, a chunked JSON body that arrives seconds after its
headers, a 204, and a client that resets mid-body.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from epp_plugin.gate.pool_state import EndpointState
from llmd_timeslice.router.envoy_config import gate_filter
from tests.support.router import EDGES, start_router
from tests.support.upstream import UpstreamServer

pytestmark = pytest.mark.envoy


@pytest.fixture(scope="module")
def upstream():
    up = UpstreamServer().start()
    yield up
    up.stop()


@pytest.fixture(params=EDGES)
async def router(request, artifacts, upstream):
    """The router on each edge: ext_proc counts until its side stream ends, the fast path until Envoy's access-log
    entry of the request's end arrives (docs/gate.md)."""
    stack = await start_router(artifacts, [upstream.address], max_hold_s=30, edge=request.param)
    stack.pool().set_states([(upstream.address, EndpointState.SERVING, 0)])
    yield stack
    await stack.stop()


async def _counted(pool, addr: str, want: int, timeout_s: float = 2.0) -> float:
    """Seconds until the gate counts ``want`` requests against ``addr``; raises after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pool.in_flight([addr])[addr] == want:
            return time.monotonic() - t0
        await asyncio.sleep(0.01)
    raise AssertionError(f"in flight against {addr} is {pool.in_flight([addr])[addr]}, expected {want}")


def test_gate_filter_keeps_the_settings_the_stream_lifetime_depends_on():
    cfg = gate_filter("gate", "default", 60)["typed_config"]
    mode = cfg["processing_mode"]
    assert mode["response_trailer_mode"] == "SEND", "SKIP lets Envoy close the stream right after response headers"
    assert mode["response_header_mode"] == "SEND" and mode["response_body_mode"] == "NONE"
    # Left at Envoy's defaults (false), which older Envoys in gateways also accept; true would break the gate:
    for field in ("observability_mode", "disable_immediate_response", "allow_mode_override"):
        assert not cfg.get(field, False), f"{field}: the gate needs it false (docs/gate.md, Envoy versions)"


async def test_with_response_trailers_skipped_envoy_ends_the_stream_at_the_response_headers(artifacts, upstream, monkeypatch):
    """Why the gate sends trailers: the same late body with SKIP leaves the count while the body is on its way."""
    import llmd_timeslice.router.envoy_config as ec

    shipped = ec.gate_filter

    def skipping(*a, **kw):
        f = shipped(*a, **kw)
        f["typed_config"]["processing_mode"]["response_trailer_mode"] = "SKIP"
        return f

    monkeypatch.setattr(ec, "gate_filter", skipping)
    stack = await start_router(artifacts, [upstream.address], max_hold_s=30, edge="ext_proc")
    try:
        pool = stack.pool()
        pool.set_states([(upstream.address, EndpointState.SERVING, 0)])
        async with httpx.AsyncClient(timeout=30) as c, c.stream("GET", stack.url + "/v1/late_json?delay_ms=1200") as r:
            assert r.status_code == 200
            gone = await _counted(pool, upstream.address, 0, 0.8)  # well before the body
            assert gone < 0.8
            await r.aread()
    finally:
        await stack.stop()


async def test_sse_stream_counts_until_its_last_event(router, upstream):
    pool = router.pool()
    async with httpx.AsyncClient(timeout=30) as c, c.stream("GET", router.url + "/v1/stream?chunks=6&gap_ms=100") as r:
        events = 0
        async for line in r.aiter_lines():
            if line.startswith("data"):
                events += 1
                if events == 2:
                    await _counted(pool, upstream.address, 1, 0.5)
    assert events == 7
    assert await _counted(pool, upstream.address, 0) < 1.0


async def test_json_body_arriving_seconds_after_its_headers_counts_until_it_arrives(router, upstream):
    pool = router.pool()
    async with httpx.AsyncClient(timeout=30) as c, c.stream("GET", router.url + "/v1/late_json?delay_ms=1500") as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        # Headers are through, the body is not (1 s to go): still in flight. With trailers skipped the count left
        # within milliseconds of the headers (test_with_response_trailers_skipped_...), well inside this wait.
        await asyncio.sleep(0.5)
        assert pool.in_flight([upstream.address])[upstream.address] == 1, "left the count before its body arrived"
        body = await r.aread()
    assert b"late_ms" in body
    assert await _counted(pool, upstream.address, 0) < 1.0


async def test_204_without_a_body_ends_its_count_with_the_response(router, upstream):
    pool = router.pool()
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.get(router.url + "/v1/no_content")
    assert r.status_code == 204 and r.content == b""
    assert await _counted(pool, upstream.address, 0) < 1.0
    assert pool.live == 0


async def test_client_reset_mid_body_ends_the_count_at_once(router, upstream):
    pool = router.pool()
    async with httpx.AsyncClient(timeout=30) as c, c.stream("GET", router.url + "/v1/stream?chunks=100&gap_ms=100") as r:
        async for line in r.aiter_lines():  # 10 s of events; stop reading after the first
            if line.startswith("data"):
                break
        assert pool.in_flight([upstream.address])[upstream.address] == 1
    # leaving the block closed the connection mid-body (the client reset)
    assert await _counted(pool, upstream.address, 0, 3.0) < 3.0, "the reset must end the count, not the upstream's end"
    assert pool.live == 0
