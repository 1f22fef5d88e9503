"""A sidecar/engine failure during a phase switch, through the real gRPC path (orchestrator, gate state
stream, sidecars): the acquire fails with the reason, the group ends in a stated, recoverable state, and no
engine that failed verification is ever published SERVING."""

from __future__ import annotations

import asyncio

import pytest

from epp_plugin.gate.pool_state import EndpointState
from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient, LeaseError
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from tests.support.fake_engines import FakeVllm
from tests.support.waits import until as _until


@pytest.fixture
async def stack():
    engines = [FakeVllm().start(), FakeVllm().start()]
    sidecars = [
        SidecarServer({f"sampler-{i}": VllmBackend(e.url, idle_timeout_s=1)}, port=0, token="t") for i, e in enumerate(engines)
    ]
    for s in sidecars:
        await s.start()
    addrs = [e.url.removeprefix("http://") for e in engines]
    inv = Inventory.model_validate(
        {
            "groups": [
                {
                    "group_id": "g",
                    "samplers": [
                        {"pool": "default", "address": a, "sidecar": f"127.0.0.1:{s.port}", "job_id": f"sampler-{i}"}
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


async def test_engine_that_lies_about_sleeping_fails_the_acquire_and_the_group_recovers(stack):
    engines, addrs, orch, gate, client = stack
    pool = gate.pools["default"]
    assert set(pool.serving()) == set(addrs)
    engines[1].lie_on_sleep = True  # answers 200 to /sleep but keeps running
    with pytest.raises(LeaseError, match=r"ABORTED.*is_sleeping says awake"):
        await client.acquire(timeout_sec=30)
    g = orch.orchestrator.groups["g"]
    assert g.holder is None and "failed" in g.last_error
    # Rolled back: both engines woken and verified again, SERVING at the gate.
    await _until(lambda: set(pool.serving()) == set(addrs) and g.state.value == "IDLE")
    engines[1].lie_on_sleep = False
    await client.acquire(timeout_sec=30)  # recoverable without a human
    assert pool.serving() == ()
    await client.release()
    await _until(lambda: set(pool.serving()) == set(addrs))


async def test_engine_that_lies_about_waking_stays_out_of_service(stack):
    engines, addrs, orch, gate, client = stack
    pool = gate.pools["default"]
    await client.acquire(timeout_sec=30)
    engines[0].lie_on_wake = True  # 200 on /wake_up, still asleep
    await client.release()
    await _until(lambda: pool.serving() == (addrs[1],))
    await asyncio.sleep(0.3)
    assert pool.endpoints[addrs[0]].state is EndpointState.ASLEEP, "never half-awake in the pool"
    g = orch.orchestrator.groups["g"]
    assert "waking the samplers failed" in g.last_error and "out of service" in g.last_error


async def test_status_shows_groups_endpoints_and_recent_switches(stack, tmp_path):
    from rich.console import Console

    from llmd_timeslice.status import print_status

    _engines, addrs, orch, gate, client = stack
    await client.acquire(timeout_sec=30)
    token = tmp_path / "token"
    token.write_text("t")
    console = Console(record=True, width=200)
    rc = await asyncio.to_thread(print_status, f"127.0.0.1:{orch.port}", [f"127.0.0.1:{gate.control_port}"], token, console)
    text = console.export_text()
    assert rc == 0
    assert "LOCKED" in text and "trainer" in text, text
    assert "recent switches" in text and "to_job" in text and "drain=" in text, text
    assert "ASLEEP" in text and addrs[0] in text, text
    await client.release()
    g = orch.orchestrator.groups["g"]
    await _until(lambda: g.state.value == "IDLE" and g.history and g.history[-1].kind.value == "to_samplers")
    await _until(lambda: all(s.address in gate.pools["default"].serving() for s in g.spec.samplers))
    console = Console(record=True, width=200)
    rc = await asyncio.to_thread(print_status, f"127.0.0.1:{orch.port}", [], token, console)
    text = console.export_text()
    assert rc == 0 and "SERVING (IDLE)" in text, "a group whose samplers serve is not shown as a bare IDLE: " + text
    # The switches table names what started each switch: here the trainer's acquire, then its yield.
    rows = [[c.strip() for c in ln.split("│")] for ln in text.splitlines() if "to_job" in ln or "to_samplers" in ln]
    assert [r[3:5] for r in rows[:2]] == [["to_samplers", "yield"], ["to_job", "acquire"]], text
