"""The orchestrator's metrics the alerting rules read (issue 38 §6; manifests/alerts/llmd-timeslice-rules.yaml), as a
scrape shows them from a running orchestrator: leader, its term, a sampler out of service, failed wakes."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
from llmd_timeslice.orchestrator.server import OrchestratorServer
from tests.support.one_sampler import one_sampler
from tests.support.waits import until


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


@pytest.fixture
async def orchestrator():
    engine, addr, sidecar, inv = await one_sampler("t")
    orch = OrchestratorServer(inv, port=0, token="t", engine_audit_interval_s=0.2)
    await orch.start()
    yield engine, addr, orch
    await orch.stop()
    await sidecar.stop()
    engine.stop()


async def test_a_serving_orchestrator_is_the_leader_and_reports_its_samplers_in_service(orchestrator):
    _, addr, orch = orchestrator
    assert _value("llmd_timeslice_orchestrator_leader") == 1
    assert _value("llmd_timeslice_orchestrator_leader_term") == 0  # no leader election: no term
    await until(lambda: not orch.orchestrator.groups["g"].sampler_errors, what="serving")
    assert _value("llmd_timeslice_orchestrator_sampler_out_of_service", group_id="g", address=addr) == 0


async def test_a_failed_wake_counts_and_the_sampler_shows_out_of_service_until_repaired(orchestrator):
    engine, addr, orch = orchestrator
    before = _value("llmd_timeslice_orchestrator_wake_failures_total", group_id="g", address=addr) or 0.0
    client = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="g", token="t")
    try:
        await client.acquire(timeout_sec=30)
        engine.core_dead = True  # the engine core dies while the trainer holds the accelerators
        await client.release()
    finally:
        await client.close()
    g = orch.orchestrator.groups["g"]
    await until(lambda: addr in g.sampler_errors, what="the failed wake recorded")
    assert _value("llmd_timeslice_orchestrator_sampler_out_of_service", group_id="g", address=addr) == 1
    assert _value("llmd_timeslice_orchestrator_wake_failures_total", group_id="g", address=addr) == before + 1
    engine.restart()
    await until(lambda: not g.sampler_errors, timeout_s=20, what="repaired")
    assert _value("llmd_timeslice_orchestrator_sampler_out_of_service", group_id="g", address=addr) == 0


async def test_a_stopped_orchestrator_is_no_longer_counted_as_a_leader():
    engine, addr, sidecar, inv = await one_sampler("t")
    orch = OrchestratorServer(inv, port=0, token="t")
    try:
        await orch.start()
        assert _value("llmd_timeslice_orchestrator_leader") == 1
        await orch.stop()
        assert _value("llmd_timeslice_orchestrator_leader") == 0
        assert _value("llmd_timeslice_orchestrator_sampler_out_of_service", group_id="g", address=addr) is None
    finally:
        await sidecar.stop()
        engine.stop()
