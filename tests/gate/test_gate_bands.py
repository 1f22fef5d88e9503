"""Priority bands of held traffic (issue 26): the gate core's queue per band, the HoldPressure it sends, and its
answers behind the real Envoy binary on both edges (docs/gate.md, "Priority bands")."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import pytest
from grpc import aio

from epp_plugin.gate.control import pool_status
from epp_plugin.gate.metrics import PoolCollector
from epp_plugin.gate.pool_state import EndpointState, HoldExpired, PoolState, SheddableWhileAsleep, UnknownObjective
from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice import protocol
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2 as spb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_state_pb2_grpc as spb_grpc
from llmd_timeslice.domain.objectives import Objectives
from tests.support.router import EDGES, start_router
from tests.support.upstream import UpstreamServer
from tests.support.waits import until as _until

S, A = EndpointState.SERVING, EndpointState.ASLEEP
E = "10.0.0.1:8000"
PRIORITIES = Objectives.model_validate(
    {
        "objectives": [
            {"name": "eval", "priority": 10},
            {"name": "judge", "priority": 10, "max_hold_s": 0.3},
            {"name": "canary", "priority": 5},
            {"name": "rollout", "priority": 0},
            {"name": "batch", "priority": -1},
        ],
        "priority_bands": [{"priority": 10, "hold_deadline_s": 0.5}, {"priority": 5, "max_hold_s": 0.4}],
    }
)


def _pool(**kw) -> PoolState:
    return PoolState("default", max_hold_s=30, priorities=PRIORITIES.for_pool("default", "default", 30), **kw)


# ------------------------------------------------------------------------------------------- the core, no I/O
async def test_held_requests_are_released_highest_band_first_fifo_within_a_band():
    pool = _pool(release_rate_per_s=0)
    pool.set_states([(E, A, 0)])
    order: list[str] = []

    async def one(tag: str, objective: str | None):
        await pool.admit(0, pool.objective(objective) if objective else None)
        order.append(tag)

    arrivals = [("r1", "rollout"), ("n1", None), ("c1", "canary"), ("e1", "eval"), ("r2", "rollout"), ("e2", "eval")]
    arrivals += [("n2", None), ("c2", "canary")]
    tasks = []
    for tag, objective in arrivals:
        tasks.append(asyncio.create_task(one(tag, objective)))
        await asyncio.sleep(0.01)
    assert pool.held_by_band() == {10: 2, 5: 2, 0: 4}
    pool.set_states([(E, S, 0)])
    await asyncio.gather(*tasks)
    assert order == ["e1", "e2", "c1", "c2", "r1", "n1", "r2", "n2"], "band 10, then 5, then 0 (header or not) FIFO"
    assert pool.band_stats[10].released_total == 2 and pool.band_stats[0].released_total == 4


async def test_release_in_bursts_still_serves_the_highest_band_first():
    pool = _pool(release_rate_per_s=1000, release_burst=2)
    pool.set_states([(E, A, 0)])
    order: list[str] = []

    async def one(tag, objective):
        await pool.admit(0, pool.objective(objective) if objective else None)
        order.append(tag)

    tasks = [asyncio.create_task(one(f"n{i}", None)) for i in range(3)]
    await asyncio.sleep(0.01)
    tasks += [asyncio.create_task(one(f"e{i}", "eval")) for i in range(3)]
    await asyncio.sleep(0.01)
    pool.set_states([(E, S, 0)])
    await asyncio.gather(*tasks)
    assert order == ["e0", "e1", "e2", "n0", "n1", "n2"]


async def test_sheddable_is_refused_at_once_while_asleep_and_admitted_while_serving():
    pool = _pool()
    pool.set_states([(E, A, 0)])
    batch = pool.objective("batch")
    with pytest.raises(SheddableWhileAsleep) as exc:
        pool.try_admit(0, batch)
    assert exc.value.http_status == 503 and exc.value.retry_after_s and "'batch' is sheddable (priority -1 < 0)" in str(exc.value)
    with pytest.raises(SheddableWhileAsleep):
        await pool.admit(0, batch)
    assert pool.held == 0 and pool.band_stats[-1].refused_total == {"sheddable_while_asleep": 2}
    pool.set_states([(E, S, 0)])
    adm = await pool.admit(0, batch)
    assert adm.candidates == (E,)


async def test_each_band_and_objective_has_its_own_longest_hold():
    pool = _pool()
    pool.set_states([(E, A, 0)])
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(HoldExpired, match=r"within 0.4 s, the longest hold of objective 'canary' \(band 5\)"):
        await pool.admit(0, pool.objective("canary"))  # band 5's max_hold_s
    assert 0.35 < loop.time() - t0 < 2
    with pytest.raises(HoldExpired, match=r"within 0\.3 s, the longest hold of objective 'judge'"):
        await pool.admit(0, pool.objective("judge"))  # its own override of band 10's
    held = asyncio.create_task(pool.admit(0, pool.objective("eval")))  # band 10: the gate's 30 s
    plain = asyncio.create_task(pool.admit())
    await asyncio.sleep(0.6)
    assert not held.done() and not plain.done()
    pool.set_states([(E, S, 0)])
    adm = await held
    assert adm.band == 10 and adm.hold_s >= 0.6
    assert pool.band_stats[10].deadline_misses_total == 1, "eval was released after the 0.5 s deadline (judge expired before)"
    assert (await plain).band == 0


async def test_an_unknown_objective_is_refused_naming_it_and_the_known_ones_and_without_objectives_ignored():
    pool = _pool()
    with pytest.raises(UnknownObjective) as exc:
        pool.objective("evl")
    assert exc.value.http_status == 400
    assert str(exc.value) == (
        "unknown InferenceObjective 'evl' for pool 'default' (header x-gateway-inference-objective); "
        "known: batch, canary, eval, judge, rollout"
    )
    assert PoolState("p").objective("anything") is None, "no objectives configured: the header is ignored"


async def test_status_and_metrics_show_held_per_band():
    pool = _pool()
    pool.set_states([(E, A, 0)])
    tasks = [asyncio.create_task(pool.admit(0, pool.objective("eval"))), asyncio.create_task(pool.admit())]
    await asyncio.sleep(0.05)
    st = pool_status(pool)
    bands = {b.band: b for b in st.bands}
    assert st.held == 2 and bands[10].held == 1 and bands[10].hold_deadline_s == 0.5 and bands[10].oldest_held_s > 0
    assert bands[0].held == 1 and bands[5].held == 0 and bands[5].max_hold_s == 0.4
    assert bands[0].oldest_held_s > 0, "a band without a hold deadline shows its oldest held request too (new-user walk)"
    col = PoolCollector()
    col.pool_maps.append({"default": pool})
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for m in col.collect() for s in m.samples}
    assert got[("llmd_timeslice_gate_band_held_requests", (("band", "10"), ("pool", "default")))] == 1
    assert got[("llmd_timeslice_gate_band_held_requests", (("band", "0"), ("pool", "default")))] == 1
    pool.set_states([(E, S, 0)])
    await asyncio.gather(*tasks)
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for m in col.collect() for s in m.samples}
    assert got[("llmd_timeslice_gate_band_released_total", (("band", "10"), ("pool", "default")))] == 1
    assert got[("llmd_timeslice_gate_band_held_requests", (("band", "10"), ("pool", "default")))] == 0, (
        "a deadline band shows 0 held rather than disappearing"
    )


async def test_llmd_timeslice_status_prints_held_per_band(monkeypatch):
    from rich.console import Console

    from llmd_timeslice.status import print_status

    monkeypatch.delenv("LLMD_TIMESLICE_TOKEN", raising=False)
    gate = GateServer(GateConfig(ext_proc_port=0, control_port=0, priorities=PRIORITIES, max_hold_s=30))
    await gate.start()
    try:
        pool = gate.pools["default"]
        pool.set_states([(E, A, 0)])
        held = [asyncio.create_task(pool.admit(0, pool.objective("eval"))), asyncio.create_task(pool.admit())]
        await asyncio.sleep(0.05)
        console = Console(record=True, width=200)
        await asyncio.to_thread(print_status, "127.0.0.1:1", [f"127.0.0.1:{gate.control_port}"], None, console)
        text = console.export_text()
        rows = [line for line in text.splitlines() if "default" in line and "0.5" in line]
        assert "priority bands" in text and rows, text
        assert rows[0].split("│")[2].strip() == "10" and rows[0].split("│")[3].strip() == "1", rows
        pool.set_states([(E, S, 0)])
        await asyncio.gather(*held)
    finally:
        await gate.stop()


# ------------------------------------------------------------------------------ HoldPressure on the state stream
class RecordingOrchestrator(spb_grpc.GateStateServiceServicer):
    """The orchestrator's side of ``GateStateService.Connect`` over real gRPC: a full snapshot, keepalives, and
    every message of the gate recorded with its arrival time."""

    def __init__(self) -> None:
        self.messages: list[tuple[float, spb.GateMessage]] = []

    async def Connect(self, request_iterator, context):  # noqa: N802
        loop = asyncio.get_running_loop()

        async def read():
            async for msg in request_iterator:
                self.messages.append((loop.time(), msg))

        reader = loop.create_task(read())
        yield spb.GateCommand(state=spb.StateUpdate(epoch=1, full_snapshot=True))
        try:
            while not reader.done():
                await asyncio.sleep(0.2)
                yield spb.GateCommand(keepalive=spb.KeepAlive())
        finally:
            reader.cancel()

    def pressure(self) -> list[tuple[float, spb.HoldPressure]]:
        return [(t, m.hold_pressure) for t, m in self.messages if m.WhichOneof("message") == "hold_pressure"]


async def test_hold_pressure_is_sent_at_the_first_held_request_then_every_quarter_second_then_held_zero():
    orch = RecordingOrchestrator()
    server = aio.server()
    spb_grpc.add_GateStateServiceServicer_to_server(orch, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    gate = GateServer(
        GateConfig(ext_proc_port=0, control_port=0, orchestrator=f"127.0.0.1:{port}", priorities=PRIORITIES, max_hold_s=30)
    )
    await gate.start()
    try:
        await asyncio.wait_for(gate.subscription.connected.wait(), 10)
        pool = gate.pools["default"]
        pool.set_states([(E, A, 0)])
        plain = asyncio.create_task(pool.admit())
        canary = asyncio.create_task(pool.admit(0, pool.objective("canary")))
        await _until(lambda: pool.held == 2, 5, "plain and canary held")
        await asyncio.sleep(0.3)  # more than a period (0.25 s)
        assert orch.pressure() == [], "bands without a hold deadline send nothing"
        loop = asyncio.get_running_loop()
        held_at = loop.time()
        evals = [asyncio.create_task(pool.admit(0, pool.objective("eval"))) for _ in range(2)]
        await _until(lambda: orch.pressure(), 2, "the first HoldPressure")
        first_at, first = orch.pressure()[0]
        assert first_at - held_at < 0.2 or first.oldest_held_s < 0.2, "sent at the first held request, not at the next tick"
        assert (first.pool, first.band, first.objective, first.hold_deadline_s) == ("default", 10, "eval", 0.5)
        assert first.held == 2 and 0 <= first.oldest_held_s < 0.2
        await _until(lambda: len(orch.pressure()) >= 4, 5, "four HoldPressure messages while held")
        pool.set_states([(E, S, 0)])
        await asyncio.gather(plain, *evals)
        await _until(lambda: orch.pressure()[-1][1].held == 0, 2, "the last HoldPressure with held = 0")
        sent = orch.pressure()
        times = [t for t, _ in sent]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        # The period (0.25 s) is the behaviour: a loaded event loop only stretches gaps (timers fire late), so the
        # upper bound is a median of the gaps seen here, not every gap. The lower bound is on the gate's own send
        # times, read off the messages (the oldest held request's age, the same request all along): arrival times
        # also carry each message's own delay in transit (a 0.11 s gap arrived of two sent 0.25 s apart, CI).
        assert len(sent) >= 4 and sorted(gaps)[len(gaps) // 2] <= 0.4, f"every 0.25 s while held: gaps {gaps}"
        ages = [p.oldest_held_s for _, p in sent[:-1]]
        sent_gaps = [b - a for a, b in itertools.pairwise(ages)]
        assert min(sent_gaps) >= 0.24, f"at most every 0.25 s: gaps between sends {sent_gaps}"
        assert [p.oldest_held_s for _, p in sent[:-1]] == sorted(p.oldest_held_s for _, p in sent[:-1])
        assert sent[-1][1].band == 10 and sent[-1][1].hold_deadline_s == 0.5
        n = len(sent)
        await asyncio.sleep(0.4)  # more than a period
        assert len(orch.pressure()) == n, "nothing more once the band holds none"
        assert canary.done()
    finally:
        await gate.stop()
        await server.stop(0)


# ------------------------------------------------------------------------------------------------- real Envoy
@pytest.fixture(params=EDGES)
def edge(request) -> str:
    return request.param


@pytest.fixture
async def upstream():
    up = UpstreamServer().start()
    yield up
    up.stop()


@pytest.fixture
async def banded(artifacts, upstream, edge):
    stack = await start_router(artifacts, [upstream.address], max_hold_s=30, edge=edge, priorities=PRIORITIES)
    yield stack
    await stack.stop()


# The same objectives without band 5's 0.4 s hold limit: the ordering test holds four requests one after another,
# which on a loaded machine can outlast 0.4 s (that limit has its own test below).
ORDER_PRIORITIES = PRIORITIES.model_copy(update={"priority_bands": PRIORITIES.priority_bands[:1]})


@pytest.fixture
async def banded_unlimited(artifacts, upstream, edge):
    stack = await start_router(artifacts, [upstream.address], max_hold_s=30, edge=edge, priorities=ORDER_PRIORITIES)
    yield stack
    await stack.stop()


def _headers(objective: str | None) -> dict:
    return {protocol.OBJECTIVE_HEADER: objective} if objective else {}


async def test_envoy_held_requests_come_back_highest_band_first(banded_unlimited, upstream):
    banded = banded_unlimited
    pool = banded.pool()
    pool.release_rate_per_s, pool.release_burst = 4, 1  # one release every 0.25 s: the answers come back in its order
    pool.set_states([(upstream.address, A, 0)])
    done: list[str] = []
    async with httpx.AsyncClient(timeout=30) as c:

        async def one(tag, objective):
            r = await c.get(banded.url + "/v1/completions", headers=_headers(objective))
            assert r.status_code == 200, r.text
            done.append(tag)

        tasks = []
        for tag, objective in [("plain", None), ("rollout", "rollout"), ("canary", "canary"), ("eval", "eval")]:
            tasks.append(asyncio.create_task(one(tag, objective)))
            await _until(lambda n=len(tasks): pool.held == n, 5, f"{tag} held")
        assert pool.held_by_band() == {10: 1, 5: 1, 0: 2}
        pool.set_states([(upstream.address, S, 0)])
        await asyncio.gather(*tasks)
    assert pool.band_stats[10].released_total == 1 and pool.band_stats[0].released_total == 2
    assert done == ["eval", "canary", "plain", "rollout"], f"highest band first, FIFO within band 0: {done}"


async def test_envoy_sheddable_is_refused_while_asleep_and_served_while_serving(banded, upstream):
    pool = banded.pool()
    pool.set_states([(upstream.address, A, 0)])
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.get(banded.url + "/v1/completions", headers=_headers("batch"))
        assert r.status_code == 503 and r.headers[protocol.REASON_HEADER] == "sheddable_while_asleep"
        assert r.headers["retry-after"] == "5" and r.json()["error"]["type"] == "sheddable_while_asleep"
        assert "'batch' is sheddable" in r.json()["error"]["message"] and pool.held == 0
        pool.set_states([(upstream.address, S, 0)])
        r = await c.get(banded.url + "/v1/completions", headers=_headers("batch"))
        assert r.status_code == 200 and r.json()["served_by"] == upstream.address


async def test_envoy_unknown_objective_is_400_naming_it_and_a_band_hold_expires_at_its_own_limit(banded, upstream):
    pool = banded.pool()
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.get(banded.url + "/v1/completions", headers=_headers("evl"))
        assert r.status_code == 400 and r.headers[protocol.REASON_HEADER] == "unknown_objective"
        body = json.loads(r.text)["error"]
        assert body["type"] == "unknown_objective" and "'evl'" in body["message"] and "known: batch, canary" in body["message"]
        pool.set_states([(upstream.address, A, 0)])
        t0 = asyncio.get_running_loop().time()
        r = await c.get(banded.url + "/v1/completions", headers=_headers("canary"))
        waited = asyncio.get_running_loop().time() - t0
    assert r.status_code == 503 and r.headers[protocol.REASON_HEADER] == "hold_expired", r.text
    assert "0.4 s" in r.json()["error"]["message"] and waited < 5, "band 5's 0.4 s, not the gate's 30 s"


async def test_envoy_requests_without_the_header_are_unchanged_by_bands(banded, upstream):
    pool = banded.pool()
    pool.set_states([(upstream.address, S, 0)])
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.get(banded.url + "/v1/completions")
        assert r.status_code == 200 and protocol.HOLD_MS_HEADER not in r.headers
        pool.set_states([(upstream.address, A, 0)])
        held = asyncio.create_task(c.get(banded.url + "/v1/completions"))
        await _until(lambda: pool.held == 1, 5, "held")
        assert pool.held_by_band() == {0: 1}
        await asyncio.sleep(0.5)  # past every band's own limit: the gate's 30 s applies
        pool.set_states([(upstream.address, S, 0)])
        r = await held
    assert r.status_code == 200 and int(r.headers[protocol.HOLD_MS_HEADER]) >= 500
    assert pool.band_stats[0].refused_total == {}


async def test_envoy_without_objectives_the_header_is_ignored(artifacts, upstream, edge):
    stack = await start_router(artifacts, [upstream.address], max_hold_s=30, edge=edge)
    try:
        stack.pool().set_states([(upstream.address, S, 0)])
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.get(stack.url + "/v1/completions", headers=_headers("anything"))
        assert r.status_code == 200, "a gate without objectives answers as before objectives existed"
    finally:
        await stack.stop()


def test_a_gate_refuses_bands_that_do_not_fit_its_max_hold():
    with pytest.raises(ValueError, match=r"priority_bands\[1\].max_hold_s: 0.4 is above the gate's max_hold_s 0.2"):
        GateConfig(max_hold_s=0.2, priorities=PRIORITIES)
