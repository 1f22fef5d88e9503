"""The gate behind the real Envoy binary, with the picker as EPP and real HTTP upstreams.

Every test runs against both edges of the gate (``edge``: the fast path, HTTP ext_authz + access-log stream,
and ext_proc); tests where the endpoint choice matters also run the fast path with the gate picking the
endpoint itself (``chain``: ``ext_authz-pick``, the local stack's chain without an EPP).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from typing import NamedTuple

import aiohttp
import httpx
import pytest

from epp_plugin.gate.pool_state import EndpointState
from llmd_timeslice import protocol
from tests.support.router import ALL_CHAINS, EDGES, start_router
from tests.support.upstream import UpstreamServer
from tests.support.waits import until as _until

pytestmark = pytest.mark.envoy


class _Answer(NamedTuple):
    status_code: int
    text: str
    headers: dict


@pytest.fixture(params=EDGES)
def edge(request) -> str:
    return request.param


@pytest.fixture(params=ALL_CHAINS)
def chain(request) -> str:
    return request.param


@pytest.fixture
async def two_upstreams():
    ups = [UpstreamServer().start(), UpstreamServer().start()]
    yield ups
    for u in ups:
        u.stop()


@pytest.fixture
async def router(artifacts, two_upstreams, edge):
    stack = await start_router(artifacts, [u.address for u in two_upstreams], max_hold_s=30, edge=edge)
    yield stack
    await stack.stop()


@pytest.fixture
async def router_chain(artifacts, two_upstreams, chain):
    """Like ``router``, over every chain (the fast path with and without an EPP, ext_proc)."""
    stack = await start_router(artifacts, [u.address for u in two_upstreams], max_hold_s=30, edge=chain)
    yield stack
    await stack.stop()


async def test_request_to_sleeping_pool_is_held_and_released_on_wake_with_body_intact(router_chain, two_upstreams):
    router = router_chain
    up = two_upstreams[0]
    router.pool().set_states([(up.address, EndpointState.ASLEEP, 0)])
    body = bytes(range(256)) * 4096  # 1 MiB
    async with httpx.AsyncClient(timeout=30) as c:
        req = asyncio.create_task(c.post(router.url + "/v1/completions", content=body))
        await _until(lambda: router.pool().held == 1 or req.done(), what="the request held at the gate")
        await asyncio.sleep(0.3)
        assert not req.done(), "request to a pool with no SERVING endpoint must be held, not answered"
        assert router.pool().held == 1
        router.pool().set_states([(up.address, EndpointState.SERVING, 0)])
        r = await asyncio.wait_for(req, 10)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["served_by"] == up.address
    assert got["body_sha256"] == hashlib.sha256(body).hexdigest(), "held request body arrived altered"
    assert int(r.headers[protocol.HOLD_MS_HEADER]) >= 300, "the hold header counts the time held (at least 0.3 s)"
    assert r.headers[protocol.WEIGHT_VERSION_HEADER] == "0"


async def test_subset_hint_reaches_the_picker_and_it_never_picks_outside_it(router_chain, two_upstreams):
    """With an EPP: the subset hint reaches it and it picks inside; with the gate picking: only SERVING endpoints."""
    router = router_chain
    asleep, serving = two_upstreams
    router.pool().set_states([(asleep.address, EndpointState.ASLEEP, 0), (serving.address, EndpointState.SERVING, 0)])
    async with httpx.AsyncClient(timeout=10) as c:
        rs = await asyncio.gather(*(c.get(router.url + "/v1/completions") for _ in range(30)))
    served = {r.json()["served_by"] for r in rs}
    assert served == {serving.address}, f"picker routed outside the subset hint: {served}"
    assert asleep.hits == 0
    # Both SERVING: the picker spreads over both (round-robin), proving the hint is what limited it.
    router.pool().set_states([(asleep.address, EndpointState.SERVING, 0)])
    async with httpx.AsyncClient(timeout=10) as c:
        rs = [await c.get(router.url + "/v1/completions") for _ in range(6)]
    assert {r.json()["served_by"] for r in rs} == {asleep.address, serving.address}


async def test_streaming_response_stays_in_flight_until_it_ends_so_drain_waits(router_chain, two_upstreams):
    router = router_chain
    up = two_upstreams[0]
    pool = router.pool()
    pool.set_states([(up.address, EndpointState.SERVING, 0)])
    events = []
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("GET", router.url + "/v1/stream?chunks=8&gap_ms=80") as r:
            it = r.aiter_lines()
            async for line in it:
                if line.startswith("data"):
                    events.append(line)
                    break
            pool.set_states([(up.address, EndpointState.DRAINING, 0)])
            drained, in_flight = await pool.wait_drained([up.address], 0.2)
            assert not drained and in_flight[up.address] == 1, "a streaming response must count until it ends"
            waiter = asyncio.create_task(pool.wait_drained([up.address], 10))
            async for line in it:
                if line.startswith("data"):
                    events.append(line)
        drained, _ = await asyncio.wait_for(waiter, 5)
    assert drained
    assert events[-1] == "data: [DONE]" and len(events) == 9, "the stream must finish intact while draining"


async def test_hold_expiry_gives_503_with_retry_after_and_reason(artifacts, two_upstreams, edge):
    stack = await start_router(artifacts, [two_upstreams[0].address], max_hold_s=0.25, edge=edge)
    try:
        stack.pool().set_states([(two_upstreams[0].address, EndpointState.ASLEEP, 0)])
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.get(stack.url + "/v1/completions")
        assert r.status_code == 503
        assert r.headers[protocol.REASON_HEADER] == "hold_expired"
        assert r.headers["retry-after"]
        assert json.loads(r.text)["error"]["type"] == "hold_expired"
        assert stack.pool().held == 0
    finally:
        await stack.stop()


async def test_queue_full_gives_429(artifacts, two_upstreams, edge):
    stack = await start_router(artifacts, [two_upstreams[0].address], max_held=2, max_hold_s=10, edge=edge)
    try:
        stack.pool().set_states([(two_upstreams[0].address, EndpointState.ASLEEP, 0)])
        async with httpx.AsyncClient(timeout=20) as c:
            held = [asyncio.create_task(c.get(stack.url + "/v1/completions")) for _ in range(2)]
            await _until(lambda: stack.pool().held == 2, what="two requests held")
            r = await c.get(stack.url + "/v1/completions")
            assert r.status_code == 429 and r.headers[protocol.REASON_HEADER] == "hold_queue_full"
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "hold_queue_full"
            stack.pool().set_states([(two_upstreams[0].address, EndpointState.SERVING, 0)])
            assert [x.status_code for x in await asyncio.gather(*held)] == [200, 200]
    finally:
        await stack.stop()


async def test_client_disconnect_while_held_leaves_the_queue(router, two_upstreams):
    router.pool().set_states([(two_upstreams[0].address, EndpointState.ASLEEP, 0)])
    async with httpx.AsyncClient(timeout=30) as c:
        req = asyncio.create_task(c.get(router.url + "/v1/completions"))
        await _until(lambda: router.pool().held == 1 or req.done(), what="the request held at the gate")
        assert not req.done()
        req.cancel()  # the client gives up: its connection closes (at the latest when the client closes below)
        with pytest.raises(asyncio.CancelledError):
            await req
    await _until(lambda: router.pool().held == 0, 2.5, "a client gone while held must leave the hold queue")


async def test_two_pools_at_once_each_route_gets_its_own_pool_and_subset_hint(artifacts, two_upstreams, chain):
    up_a, up_b = two_upstreams
    stack = await start_router(
        artifacts, [up_a.address], pool="pool-a", extra_pools={"pool-b": ("/b/", [up_b.address])}, edge=chain
    )
    try:
        stack.pool("pool-a").set_states([(up_a.address, EndpointState.SERVING, 0)])
        stack.pool("pool-b").set_states([(up_b.address, EndpointState.ASLEEP, 0)])
        async with httpx.AsyncClient(timeout=20) as c:
            held_b = asyncio.create_task(c.get(stack.url + "/b/v1/completions"))
            rs = await asyncio.gather(*(c.get(stack.url + "/v1/completions") for _ in range(10)))
            assert {r.json()["served_by"] for r in rs} == {up_a.address}
            await _until(lambda: stack.pool("pool-b").held == 1 or held_b.done(), what="the pool-b request held")
            assert not held_b.done() and stack.pool("pool-b").held == 1 and stack.pool("pool-a").held == 0
            stack.pool("pool-b").set_states([(up_b.address, EndpointState.SERVING, 0)])
            r = await asyncio.wait_for(held_b, 10)
        assert r.status_code == 200 and r.json()["served_by"] == up_b.address
    finally:
        await stack.stop()


async def test_unknown_pool_is_refused_with_503_and_a_reason(artifacts, two_upstreams, edge):
    stack = await start_router(artifacts, [two_upstreams[0].address], extra_pools={"ghost": ("/ghost/", [])}, edge=edge)
    try:
        del stack.gate.pools["ghost"]  # Envoy routes /ghost/ to a pool this gate does not serve
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.get(stack.url + "/ghost/v1/completions")
        assert r.status_code == 503 and r.headers[protocol.REASON_HEADER] == "unknown_pool"
        assert "ghost" in r.json()["error"]["message"]
    finally:
        await stack.stop()


async def test_min_weight_version_header_holds_until_that_version_serves(router_chain, two_upstreams):
    router = router_chain
    old, new = two_upstreams
    router.pool().set_states([(old.address, EndpointState.SERVING, 1)])
    async with httpx.AsyncClient(timeout=20) as c:
        r = await c.get(router.url + "/v1/completions")
        assert r.json()["served_by"] == old.address
        assert r.headers[protocol.WEIGHT_VERSION_HEADER] == "1", "the response names the weight version that served it"
        held = asyncio.create_task(c.get(router.url + "/v1/completions", headers={protocol.MIN_WEIGHT_VERSION_HEADER: "2"}))
        await _until(lambda: router.pool().held == 1 or held.done(), what="the version-2 request held")
        await asyncio.sleep(0.2)
        assert not held.done(), "a request asking for weight version 2 must wait while only version 1 serves"
        router.pool().set_states([(new.address, EndpointState.SERVING, 2)])
        r = await asyncio.wait_for(held, 10)
        assert r.json()["served_by"] == new.address, "only endpoints at the required version are in the subset hint"
        assert r.headers[protocol.WEIGHT_VERSION_HEADER] == "2"
        bad = await c.get(router.url + "/v1/completions", headers={protocol.MIN_WEIGHT_VERSION_HEADER: "two"})
        assert bad.status_code == 400 and bad.headers[protocol.REASON_HEADER] == "bad_min_weight_version"


async def test_two_thousand_held_requests_are_all_released(artifacts, two_upstreams, edge):
    up = two_upstreams[0]
    # The picker runs in its own process, as a real EPP does: in this test's process it shared one event loop with
    # the gate and 2,000 clients, and in full-suite runs on 2 loaded cores it stopped reading its HTTP/2 connection
    # during the burst of new EPP streams; Envoy's queue of control frames to it overflowed
    # (`cluster.epp.http2.outbound_control_flood`) and the requests on that connection failed (374-784 x 500 from the
    # EPP filter). The release is paced at 2,000/s and the EPP message timeout raised, for a loaded machine. What is
    # checked here is the gate: every request released and ended (benchmarks.router_overhead times the release).
    stack = await start_router(
        artifacts,
        [up.address],
        max_hold_s=120,
        epp_message_timeout_s=60,
        edge=edge,
        release_rate_per_s=2000,
        picker_process=True,
    )
    try:
        stack.pool().set_states([(up.address, EndpointState.ASLEEP, 0)])

        async def get(session: aiohttp.ClientSession) -> _Answer:
            async with session.get(stack.url + "/v1/completions") as r:
                return _Answer(r.status, await r.text(), dict(r.headers))

        # aiohttp: httpx's connection pool scans every connection per request (quadratic at 2,000)
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as c:
            tasks = [asyncio.create_task(get(c)) for _ in range(2000)]
            for _ in range(600):
                if stack.pool().held == 2000:
                    break
                await asyncio.sleep(0.1)
            assert stack.pool().held == 2000, f"only {stack.pool().held} of 2000 requests reached the hold queue"
            stack.pool().set_states([(up.address, EndpointState.SERVING, 0)])
            rs = await asyncio.gather(*tasks, return_exceptions=True)
        codes = [getattr(r, "status_code", repr(r)) for r in rs]
        if codes.count(200) != 2000:
            stats = await asyncio.to_thread(stack.envoy.stats, "ext_proc|ext_authz|rq_5xx|overflow|timeout|reset|flood|protocol")
            bad = [r for r in rs if getattr(r, "status_code", 0) != 200][:3]
            seen = [(getattr(r, "status_code", r), getattr(r, "text", "")[:200], dict(getattr(r, "headers", {}))) for r in bad]
            raise AssertionError(
                f"not all released requests completed: {sorted(set(map(str, codes)))}, "
                f"{codes.count(200)} ok; first failures {seen}\nenvoy stats:\n{stats}"
            )
        # Stream ends (access-log entries) reach the gate after the responses: on a loaded 2-core machine, with this
        # process also running the 2,000 clients, the last of them came more than 10 s later (seen in a full run).
        with contextlib.suppress(AssertionError):
            await _until(lambda: stack.pool().live == 0, 60, "every stream end at the gate")
        assert stack.pool().held == 0 and stack.pool().live == 0, "every request must end at the gate (nothing leaks)"
        if edge == "ext_authz":
            book = stack.gate.book
            assert len(book) == 0 and book.lost_total == 0 and book.completed_total == 2000, (
                f"every admission must end by its own access-log entry: open {len(book)}, lost {book.lost_total}, "
                f"completed {book.completed_total}"
            )
    finally:
        await stack.stop()


def _live_rss(proc) -> int:
    """The resident bytes of ``proc`` (this process) once garbage is collected and the C heap's free pages went back
    to the system (glibc ``malloc_trim``): freed memory kept by the allocator is not a leak, memory still allocated
    is."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return proc.memory_info().rss


async def test_clients_gone_while_held_leave_no_tasks_streams_or_memory_behind(router, two_upstreams):
    """grpc.aio leaks native memory when a handler swallows CancelledError after a cancel; the gate must not."""
    import psutil

    router.pool().set_states([(two_upstreams[0].address, EndpointState.ASLEEP, 0)])
    proc = psutil.Process()
    rss, tasks = [], []
    # Each client is a bare connection that sends its request, waits without an answer until all 300 of its round are
    # held at the gate, and closes. Not an HTTP client library: this test reads the resident size of its own process,
    # which aiohttp's clients moved by 5.1 % over the rounds (gate or not), and httpx's 1,500 requests were ~7 s of
    # this process's CPU.
    url = httpx.URL(router.url)
    host, port = url.host, url.port
    request = f"GET /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()

    async def held_then_gone(all_held: asyncio.Event) -> bytes | None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(request)
            await writer.drain()
            read = asyncio.ensure_future(reader.read(64))  # b"" (closed) or an answer: not held
            held = asyncio.ensure_future(all_held.wait())
            await asyncio.wait({read, held}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            for t in (read, held):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            return None if read.cancelled() else read.result()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    for _ in range(5):
        all_held = asyncio.Event()
        clients = asyncio.gather(*(held_then_gone(all_held) for _ in range(300)))
        await _until(lambda c=clients: router.pool().held == 300 or c.done(), 30, "300 requests held at the gate")
        all_held.set()
        rs = await clients
        assert rs == [None] * 300, f"answered or closed instead of held: {[r for r in rs if r is not None][:3]}"
        for _ in range(100):
            if router.pool().held == 0:
                break
            await asyncio.sleep(0.05)
        assert router.pool().held == 0 and router.pool().live == 0
        await asyncio.sleep(0.2)
        # The streams' tasks may still be ending (seen under load: 2 of them, 0.2 s after the last hold ended): a leak
        # stays, so wait up to 5 s for the count of the second round before reading it.
        for _ in range(50):
            if len(tasks) < 2 or len(asyncio.all_tasks()) <= tasks[1]:
                break
            await asyncio.sleep(0.1)
        rss.append(_live_rss(proc))
        tasks.append(len(asyncio.all_tasks()))
    assert tasks[-1] <= tasks[1], f"asyncio tasks grow with each round of cancelled holds: {tasks}"
    growth = (rss[-1] - rss[1]) / rss[1]
    assert growth < 0.05, f"memory grew {growth:.1%} over 3 rounds of 300 cancelled holds: {rss}"


async def test_gate_metrics_show_pool_state_and_refusals(artifacts, two_upstreams, edge):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    up = two_upstreams[0]
    pool = f"metrics-pool-{edge}"  # the refusal counter is process-wide: one pool name per edge
    stack = await start_router(artifacts, [up.address], pool=pool, max_hold_s=0.3, edge=edge)
    try:
        stack.pool(pool).set_states([(up.address, EndpointState.ASLEEP, 7)])
        async with httpx.AsyncClient(timeout=10) as c:
            assert (await c.get(stack.url + "/v1/completions")).status_code == 503
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(generate_latest().decode())
            for s in f.samples
        }

        def value(name, **labels):
            return samples.get((name, tuple(sorted(labels.items()))))

        assert value("llmd_timeslice_gate_endpoint_state", pool=pool, endpoint=up.address, state="ASLEEP") == 1
        assert value("llmd_timeslice_gate_endpoint_state", pool=pool, endpoint=up.address, state="SERVING") == 0
        assert value("llmd_timeslice_gate_refused_total", pool=pool, reason="hold_expired") == 1
        assert value("llmd_timeslice_gate_held", pool=pool) == 0
        assert value("llmd_timeslice_gate_state_epoch", pool=pool) >= 1
        assert value("llmd_timeslice_gate_in_flight", pool=pool, endpoint=up.address) == 0
    finally:
        await stack.stop()


async def test_held_requests_are_released_in_arrival_order(router, two_upstreams):
    """FIFO at the gate: the held checks (one per request, in arrival order) are answered in that order. The order
    is read where the gate decides it (the pool's ``admit`` calls, as the edge makes them); what the upstream then
    sees also depends on Envoy's threads and on this process's own (the upstream server), which under parallel
    test load reordered neighbours released 100 ms apart (0, 3, 1, 2, ...), so it is printed, not asserted."""
    up = two_upstreams[0]
    pool = router.pool()
    pool.set_states([(up.address, EndpointState.ASLEEP, 0)])
    pool.release_burst, pool.release_rate_per_s = 1, 20.0
    admit, calls, answered = pool.admit, [], []

    async def spy(*args, **kwargs):
        n = len(calls)
        calls.append(n)
        adm = await admit(*args, **kwargs)
        answered.append(n)
        return adm

    pool.admit = spy
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            held = []
            for i in range(8):
                held.append(asyncio.create_task(c.get(f"{router.url}/v1/order/{i}")))
                await _until(lambda n=i + 1: pool.held == n, what=f"request {i} held")
            pool.set_states([(up.address, EndpointState.SERVING, 0)])
            assert [r.status_code for r in await asyncio.gather(*held)] == [200] * 8
    finally:
        del pool.admit
    assert calls == list(range(8)), "each request was held once, in arrival order"
    assert answered == calls, f"held requests must be released FIFO, got {answered}"
    order = [p for p in up.paths if p.startswith("/v1/order/")]
    assert sorted(order) == sorted(f"/v1/order/{i}" for i in range(8))
    print(f"\norder at the upstream: {[int(p.rsplit('/', 1)[1]) for p in order]}")


async def test_envoy_killed_its_held_and_in_flight_requests_stop_counting_and_a_new_envoy_serves(router, two_upstreams):
    """Envoy dies (SIGKILL): its held checks close (they leave the queue at once) and its in-flight requests end
    at the gate (ext_proc: their streams end; ext_authz: its access-log streams end for good, so its admissions
    are dropped after the grace); a restarted Envoy is a new one and is served normally."""
    up = two_upstreams[0]
    pool = router.pool()
    router.gate.book.envoy_gone_grace_s = 0.5
    pool.set_states([(up.address, EndpointState.SERVING, 0)])
    async with httpx.AsyncClient(timeout=30) as c:
        assert (await c.get(router.url + "/v1/completions")).status_code == 200  # the access-log stream is tied to this Envoy
        await _until(lambda: pool.live == 0, what="the first request's end")
        streaming = asyncio.create_task(c.get(router.url + "/v1/stream?chunks=100&gap_ms=100"))
        await _until(lambda: pool.in_flight([up.address])[up.address] == 1, what="the stream in flight")
        # DRAINING holds the next request; ASLEEP would end the stream's count (an endpoint published ASLEEP was
        # verified idle: pool_state._forget_at), and this test is about the Envoy-gone rule.
        pool.set_states([(up.address, EndpointState.DRAINING, 0)])
        held = asyncio.create_task(c.get(router.url + "/v1/completions"))
        await _until(lambda: pool.held == 1, what="a request held")
        await router.restart_envoy()
        assert all(isinstance(r, httpx.HTTPError) for r in await asyncio.gather(streaming, held, return_exceptions=True))
        await _until(lambda: pool.held == 0, what="the held check gone with its Envoy")
        await _until(
            lambda: pool.live == 0 and pool.in_flight([up.address])[up.address] == 0,
            5,
            "the dead Envoy's in-flight request no longer counted",
        )
        if router.edge == "ext_authz":
            assert router.gate.book.lost_total == 1, "dropped because its Envoy is gone (no entry came)"
        pool.set_states([(up.address, EndpointState.SERVING, 0)])
        r = await c.get(router.url + "/v1/completions")
        assert r.status_code == 200 and r.json()["served_by"] == up.address
        await _until(lambda: pool.live == 0, what="the new Envoy's request ended at the gate")
