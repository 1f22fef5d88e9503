"""Operations as long as the model needs (issue 38 §2): sleep, wake and reload deadlines apart from each engine call's
HTTP timeout, one reload in flight per engine, and a reason naming the step that ran out of time.

Against the fake vLLM over real HTTP (a reload that takes longer than the per-call timeout: vllm#35547 reported 163
weight shards taking over 10 minutes), its sidecar, and where the outcome is the group's, the real orchestrator and
gate over gRPC. Timeouts are small so the tests run in seconds; what is asserted is the outcome, never a duration.
"""

from __future__ import annotations

import asyncio

import pytest
from rich.console import Console

from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import orchestrator_info_pb2 as info_pb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import orchestrator_info_pb2_grpc as info_grpc
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
from llmd_timeslice.domain.group_settings import RELOAD_BASE_S, RELOAD_FLOOR_BYTES_PER_S, GroupSettings, reload_deadline_for
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from llmd_timeslice.status import print_status
from tests.support.fake_engines import FakeVllm
from tests.support.waits import until

PER_CALL_S = 0.4
"""Each engine call's HTTP timeout in these tests (120 s in production)."""
RELOAD_S = 2.5 * PER_CALL_S
"""How long the fake engine's reload takes: 2.5 times the per-call timeout."""


@pytest.fixture
async def stack(request):
    """Two fake engines (reloads taking ``RELOAD_S``) with sidecars whose engine calls time out after ``PER_CALL_S``,
    an orchestrator whose group takes ``request.param`` settings, a gate: ``(engines, addrs, orch, gate, client)``."""
    settings = {"sleep_level": 2, **(getattr(request, "param", {}) or {})}
    engines = [FakeVllm().start(), FakeVllm().start()]
    for e in engines:
        e.reload_delay_s = RELOAD_S
    sidecars = [
        SidecarServer(
            {f"s{i}": VllmBackend(e.url, idle_timeout_s=1, memory_reader=lambda: None, request_timeout_s=PER_CALL_S)},
            port=0,
            token="t",
        )
        for i, e in enumerate(engines)
    ]
    for s in sidecars:
        await s.start()
    addrs = [e.url.removeprefix("http://") for e in engines]
    samplers = [
        {"pool": "default", "address": a, "sidecar": f"127.0.0.1:{s.port}", "job_id": f"s{i}"}
        for i, (a, s) in enumerate(zip(addrs, sidecars, strict=True))
    ]
    inv = Inventory.model_validate({"groups": [{"group_id": "g", **settings, "samplers": samplers}]})
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


def test_the_default_reload_deadline_grows_with_the_weight_versions_bytes():
    assert reload_deadline_for(None, None) == RELOAD_BASE_S
    assert reload_deadline_for(None, 800 * 2**30) == RELOAD_BASE_S + 800 * 2**30 / RELOAD_FLOOR_BYTES_PER_S
    assert reload_deadline_for(42.0, 800 * 2**30) == 42.0  # the group's setting wins
    assert GroupSettings().reload_deadline_s is None


@pytest.mark.parametrize("stack", [{"reload_deadline_s": 10 * RELOAD_S}], indirect=True)
async def test_a_reload_two_and_a_half_times_the_per_call_timeout_succeeds_with_one_reload_in_flight(stack):
    engines, addrs, orch, gate, client = stack
    pool = gate.pools["default"]
    await client.acquire(timeout_sec=30)  # the samplers sleep at level 2: their weights are discarded
    await client.release()  # the wake reloads them: RELOAD_S, past the per-call timeout
    g = orch.orchestrator.groups["g"]
    await until(lambda: set(pool.serving()) == set(addrs), timeout_s=20, what=f"both serving again ({g.sampler_errors})")
    assert not g.sampler_errors
    assert [e.reloads for e in engines] == [1, 1]
    assert [e.max_reloads_in_flight for e in engines] == [1, 1]


@pytest.mark.parametrize("stack", [{"reload_deadline_s": PER_CALL_S / 2}], indirect=True)
async def test_a_reload_past_its_deadline_names_the_step_and_the_repair_waits_for_it_instead_of_sending_another(stack):
    engines, addrs, orch, gate, client = stack
    pool = gate.pools["default"]
    g = orch.orchestrator.groups["g"]
    await client.acquire(timeout_sec=30)
    await client.release()
    await until(lambda: set(g.sampler_errors) == set(addrs), timeout_s=10, what="both wakes failed")
    for addr in addrs:
        why = g.sampler_errors[addr]
        assert f"reload deadline ({PER_CALL_S / 2:g} s) at step POST /collective_rpc reload_weights" in why, why
        assert "the next restore waits for it" in why, why
    # The repair (2 s back-off) finds the reload finished (or waits for it) and does not send a second one.
    await until(lambda: set(pool.serving()) == set(addrs), timeout_s=30, what=f"both repaired ({g.sampler_errors})")
    assert [e.reloads for e in engines] == [1, 1]
    assert [e.max_reloads_in_flight for e in engines] == [1, 1]


@pytest.mark.parametrize("stack", [{"sleep_deadline_s": 7, "wake_deadline_s": 11}], indirect=True)
async def test_status_shows_each_groups_deadlines(stack, tmp_path):
    _, _, orch, _, _ = stack
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{orch.port}") as ch:
        info = info_grpc.OrchestratorInfoServiceStub(ch)
        (d,) = (
            await info.ListGroupDeadlines(info_pb.ListGroupDeadlinesRequest(), metadata=(("authorization", "Bearer t"),))
        ).groups
    assert (d.group_id, d.sleep_s, d.wake_s, d.reload_s) == ("g", 7, 11, 0)
    assert d.reload_rule == "300 s + the version's bytes at 200 MiB/s"
    token = tmp_path / "token"
    token.write_text("t")
    console = Console(record=True, width=300)
    rc = await asyncio.to_thread(print_status, f"127.0.0.1:{orch.port}", [], token, console)
    text = console.export_text()
    assert rc == 0 and "operation deadlines (s)" in text, text
    row = next(line for line in text.splitlines() if "by bytes" in line)
    assert "7" in row and "11" in row and "300 s + the version's bytes at 200 MiB/s" in row, row


async def test_a_sleep_past_its_deadline_names_the_sleep_deadline_and_the_step():
    engine = FakeVllm(sleep_delay_s=1.0).start()
    sidecar = SidecarServer({"s0": VllmBackend(engine.url, idle_timeout_s=1, memory_reader=lambda: None)}, port=0)
    try:
        cmd = xpb.OperationCommand(command_id=1, snapshot=pb.SnapshotRequest(job_id="s0"))
        cmd.deadlines.sleep_s = 0.3
        op = sidecar.servicer._start_command(cmd)
        await asyncio.wait_for(op.done.wait(), 10)
        assert op.status == pb.OPERATION_STATUS_FAILED
        assert "snapshot of job 's0' ran out of its sleep deadline (0.3 s) at step POST /sleep" in op.error, op.error
    finally:
        await sidecar.servicer.resolver.close()
        engine.stop()
