"""Field failures of vLLM sleep/wake that a CPU build cannot produce on demand, against the fake engine over real HTTP
(and, where the outcome is the group's, through the real orchestrator, sidecars and gate over gRPC):

1. a prefix-cache reset answered 200 ``{"success": false}``;
2. an engine that is awake but answers nonsense after a wake;
3. several engine cores behind one server (data parallelism) in mixed sleep states;
4. a request parked inside a sleeping engine.

Real vLLM shows what it can of each in tests/test_vllm_field_failures.py.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from epp_plugin.gate.pool_state import EndpointState
from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2_grpc as xpb_grpc
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.snapshot.backends.base import BackendError, SuspendMode
from llmd_timeslice.snapshot.backends.vllm import ProbeMismatch, VllmBackend, parse_engine_metrics
from llmd_timeslice.snapshot.server import SidecarServer
from tests.support.fake_engines import FakeVllm
from tests.support.waits import until as _until


@pytest.fixture
def fake_vllm():
    engines: list[FakeVllm] = []

    def make(**kw) -> FakeVllm:
        engines.append(FakeVllm(**kw).start())
        return engines[-1]

    yield make
    for e in engines:
        e.stop()


@pytest.fixture
async def backend(fake_vllm):
    backends = []

    def make(engine: FakeVllm, **kw) -> VllmBackend:
        backends.append(VllmBackend(engine.url, **{"idle_timeout_s": 1, "memory_reader": lambda: None, **kw}))
        return backends[-1]

    yield make
    for b in backends:
        await b.close()


@pytest.fixture
async def group(request):
    """Two fake engines with their sidecars, orchestrator, gate subscribed: ``(engines, addresses, orch, gate, client)``.
    ``@pytest.mark.parametrize("group", [{"sleep_level": 2}], indirect=True)`` sets group fields."""
    extra = getattr(request, "param", {}) or {}
    engines = [FakeVllm().start(), FakeVllm().start()]
    sidecars = [
        SidecarServer({f"s{i}": VllmBackend(e.url, idle_timeout_s=1, memory_reader=lambda: None)}, port=0, token="t")
        for i, e in enumerate(engines)
    ]
    for s in sidecars:
        await s.start()
    addrs = [e.url.removeprefix("http://") for e in engines]
    inv = Inventory.model_validate(
        {
            "groups": [
                {
                    "group_id": "g",
                    **extra,
                    "samplers": [
                        {"pool": "default", "address": a, "sidecar": f"127.0.0.1:{s.port}", "job_id": f"s{i}"}
                        for i, (a, s) in enumerate(zip(addrs, sidecars, strict=True))
                    ],
                }
            ]
        }
    )
    orch = OrchestratorServer(inv, port=0, token="t")
    await orch.start()
    gate = GateServer(GateConfig(ext_proc_port=0, control_port=0, orchestrator=f"127.0.0.1:{orch.port}", token="t"))
    await gate.start()
    await asyncio.wait_for(gate.subscription.connected.wait(), 10)
    client = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="g", token="t")
    yield engines, addrs, orch, gate, client
    await client.close()
    await gate.stop()
    await orch.stop()
    for s in sidecars:
        await s.stop()
    for e in engines:
        e.stop()


# ---------------------------------------------------------------- 1. a reset that reports it did nothing


async def test_prefix_cache_reset_refused_with_200_is_done_again_with_running_requests_preempted(fake_vllm, backend):
    eng = fake_vllm()
    eng.refuse_prefix_reset = "plain"  # vLLM 0.32: 200 {"success": false} while requests hold cache blocks
    b = backend(eng)
    await b.suspend(SuspendMode.DISCARD, [])
    eng.calls.clear()
    await b.resume([])
    resets = [q for m, p, q in eng.calls if p == "/reset_prefix_cache"]
    assert resets == [{}, {"reset_running_requests": "true"}], resets
    assert eng.level == 0


async def test_prefix_cache_reset_refused_even_with_preemption_fails_the_wake(fake_vllm, backend):
    eng = fake_vllm()
    eng.refuse_prefix_reset = "always"
    b = backend(eng)
    await b.suspend(SuspendMode.DISCARD, [])
    with pytest.raises(BackendError, match=r"refused to reset its prefix cache.*stays out of service"):
        await b.resume([])


@pytest.mark.parametrize("group", [{"sleep_level": 2}], indirect=True)
async def test_sampler_whose_prefix_cache_reset_is_refused_is_never_published_serving(group):
    engines, addrs, orch, gate, client = group
    pool = gate.pools["default"]
    await client.acquire(timeout_sec=30)
    engines[0].refuse_prefix_reset = "always"
    await client.release()
    await _until(lambda: pool.serving() == (addrs[1],), what="the other sampler serving")
    await asyncio.sleep(0.3)
    assert pool.endpoints[addrs[0]].state is EndpointState.ASLEEP, "a stale prefix cache must not serve"
    g = orch.orchestrator.groups["g"]
    assert "refused to reset its prefix cache" in g.sampler_errors[addrs[0]], g.sampler_errors


# ---------------------------------------------------------------- 2. awake but wrong


async def test_engine_that_answers_nonsense_after_a_wake_fails_the_probe_and_is_put_back_to_sleep(fake_vllm, backend):
    eng = fake_vllm()
    b = backend(eng)
    await b.suspend(SuspendMode.OFFLOAD, [])  # the reference of version 0: recorded while it served, before sleeping
    assert set(b.probe_references) == {0}
    eng.garble_next_wake = True
    with pytest.raises(ProbeMismatch, match=r"answers the probe prompts differently from weight version 0's reference"):
        await b.resume([])
    assert eng.level == 2, "put back to sleep (weights discarded) rather than left awake and wrong"
    await b.resume([])  # the next restore reloads the weights; the probe matches the reference again
    assert eng.level == 0 and "/collective_rpc" in eng.paths()


def quick_repair(orch: OrchestratorServer) -> None:
    """The repair's back-off from 0.5 s (2 s by default), doubling to 2 s; the engine audit as it was."""
    core = orch.orchestrator
    core.start_repair(first_s=0.5, max_s=2.0, audit_interval_s=core.audit_interval_s)


async def test_a_sampler_answering_nonsense_after_wake_stays_out_of_service_then_is_repaired(group):
    engines, addrs, orch, gate, client = group
    quick_repair(orch)
    pool = gate.pools["default"]
    await client.acquire(timeout_sec=30)
    engines[0].garble_next_wake = True  # every health check passes: awake, 200s, choices; only the tokens are wrong
    await client.release()
    await _until(lambda: pool.serving() == (addrs[1],), what="the other sampler serving")
    g = orch.orchestrator.groups["g"]
    await _until(lambda: addrs[0] in g.sampler_errors, what="the error recorded")
    assert "answers the probe prompts differently" in g.sampler_errors[addrs[0]], g.sampler_errors
    assert pool.endpoints[addrs[0]].state is EndpointState.ASLEEP
    # The repair loop (its first back-off: 0.5 s) restores it: weights reloaded, probe matches, SERVING again.
    await _until(lambda: set(pool.serving()) == set(addrs), timeout_s=15, what="the repaired sampler serving")
    assert not engines[0].garbled


# ---------------------------------------------------------------- 3. several engine cores behind one server


def _metrics_text(states: list[str]) -> str:
    lines = ["# TYPE vllm:engine_sleep_state gauge"]
    for e, state in enumerate(states):
        for s in ("awake", "weights_offloaded", "discard_all"):
            lines.append(f'vllm:engine_sleep_state{{engine="{e}",model_name="m",sleep_state="{s}"}} {1.0 if s == state else 0.0}')
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("states", [["awake", "weights_offloaded"], ["weights_offloaded", "awake"]])
def test_metrics_of_two_engines_in_mixed_states_are_not_one_state(states):
    m = parse_engine_metrics(_metrics_text(states))
    assert m.sleep_state is None, "mixed engines have no common state"
    awake = str(states.index("awake"))
    assert m.engines_not_in("weights_offloaded") == {awake: "awake"}


@pytest.mark.parametrize("lagging", ["0", "1"])
async def test_sleep_verification_requires_every_engine_core_asleep_and_names_the_one_that_is_not(fake_vllm, backend, lagging):
    eng = fake_vllm()
    eng.engines = 2
    eng.engine_states = {lagging: "awake"}  # one data-parallel engine did not follow the sleep
    b = backend(eng)
    with pytest.raises(BackendError, match=rf"engine {lagging} is 'awake'") as err:
        await b.suspend(SuspendMode.OFFLOAD, [])
    assert f"engine {1 - int(lagging)} " not in str(err.value), "only the lagging engine is named"


@pytest.mark.parametrize("lagging", ["0", "1"])
async def test_wake_verification_requires_every_engine_core_awake_and_names_the_one_that_is_not(fake_vllm, backend, lagging):
    eng = fake_vllm()
    eng.engines = 2
    b = backend(eng)
    await b.suspend(SuspendMode.OFFLOAD, [])
    eng.engine_states = {lagging: "weights_offloaded"}
    with pytest.raises(BackendError, match=rf"engine {lagging} is 'weights_offloaded'"):
        await b.resume([])


# ---------------------------------------------------------------- 4. a request parked inside a sleeping engine


def _slow_sleep(eng: FakeVllm) -> FakeVllm:
    """The engine takes 0.6 s to serve /sleep and parks what arrives meanwhile (vLLM queues it during the pause)."""
    eng.park_while_asleep, eng.sleep_delay_s = True, 0.6
    return eng


async def _park_one(eng: FakeVllm, c: httpx.AsyncClient) -> asyncio.Task:
    """A completion sent straight to the engine once its sleep is under way (queued by the pause)."""
    await _until(lambda: eng.pausing or eng.level != 0, what="the sleep under way")
    return asyncio.create_task(c.post(eng.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}))


async def test_request_parked_in_a_sleeping_engine_is_aborted_and_reported_by_the_sidecar(fake_vllm):
    from prometheus_client import REGISTRY

    eng = _slow_sleep(fake_vllm())
    srv = SidecarServer({"s": VllmBackend(eng.url, idle_timeout_s=0, memory_reader=lambda: None)}, port=0)
    await srv.start()
    ch = __import__("grpc").aio.insecure_channel(f"127.0.0.1:{srv.port}")
    stub, ops = pb_grpc.SnapshotAgentServiceStub(ch), xpb_grpc.SnapshotOperationsServiceStub(ch)
    before = REGISTRY.get_sample_value("llmd_timeslice_sidecar_parked_requests_total", {"job_id": "s", "action": "aborted"}) or 0
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            op = (await stub.Snapshot(pb.SnapshotRequest(job_id="s"))).operation_id
            parked = await _park_one(eng, c)
            r = await ops.WaitOperation(xpb.WaitOperationRequest(operation_id=op, timeout_s=10))
            answer = await asyncio.wait_for(parked, 5)  # answered while the engine still sleeps: not left hanging
        assert r.status == pb.OPERATION_STATUS_COMPLETE, r.error
        assert (r.parked_requests, r.parked_action) == (1, "aborted")
        assert answer.json()["choices"][0]["finish_reason"] == "abort"
        assert eng.level == 1 and eng.parked == 0
        after = REGISTRY.get_sample_value("llmd_timeslice_sidecar_parked_requests_total", {"job_id": "s", "action": "aborted"})
        assert after == before + 1
    finally:
        await ch.close()
        await srv.stop()


async def test_parked_request_without_an_abort_route_wakes_the_engine_and_fails_the_sleep(fake_vllm, backend):
    eng = _slow_sleep(fake_vllm())
    eng.abort_route, eng.metrics_count_parked = False, True
    b = backend(eng, idle_timeout_s=0)
    async with httpx.AsyncClient(timeout=30) as c:
        sleep = asyncio.create_task(b.suspend(SuspendMode.OFFLOAD, []))
        parked = await _park_one(eng, c)
        with pytest.raises(BackendError, match=r"1 request\(s\) are queued inside the sleeping engine.*woke the engine again"):
            await sleep
        answer = await asyncio.wait_for(parked, 5)
    assert answer.json()["choices"][0]["finish_reason"] == "length", "it finished on the woken engine"
    assert eng.level == 0


async def test_pause_mode_keep_reports_frozen_requests_as_kept(fake_vllm, backend):
    eng = _slow_sleep(fake_vllm())
    eng.metrics_count_parked = True
    b = backend(eng, idle_timeout_s=0, pause_mode="keep")
    async with httpx.AsyncClient(timeout=30) as c:
        sleep = asyncio.create_task(b.suspend(SuspendMode.OFFLOAD, []))
        parked = await _park_one(eng, c)
        res = await sleep
        assert (res.parked_requests, res.parked_action) == (1, "kept")
        assert not parked.done(), "keep: frozen until the wake"
        await b.resume([])
        assert (await asyncio.wait_for(parked, 5)).json()["choices"][0]["finish_reason"] == "length"


async def test_the_switch_result_names_the_requests_parked_in_each_engine(group):
    engines, addrs, orch, _gate, client = group
    async with httpx.AsyncClient(timeout=30) as c:
        _slow_sleep(engines[1])
        acquire = asyncio.create_task(client.acquire(timeout_sec=30))
        parked = await _park_one(engines[1], c)
        await acquire
        assert (await asyncio.wait_for(parked, 5)).json()["choices"][0]["finish_reason"] == "abort"
    record = orch.orchestrator.groups["g"].history[-1]
    assert record.kind == "to_job" and record.parked_requests == {addrs[1]: "1 aborted"}, record
    await client.release()
