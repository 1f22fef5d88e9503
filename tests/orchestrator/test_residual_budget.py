"""The group's residual budget per sleep level reaches the sidecar with the sleep command (issue 38 §1): the
orchestrator's sleep of one sampler over real gRPC, on the operation stream and on the unary calls of an older
sidecar, against a sidecar whose engine's memory is read through a fake ``pynvml`` (no GPU here)."""

from __future__ import annotations

import grpc
import pytest

from llmd_timeslice.domain.group_settings import GroupSpec, SamplerEndpoint
from llmd_timeslice.domain.switches import SamplerStepFailed, StepFault
from llmd_timeslice.orchestrator.actions import GrpcSwitchActions
from llmd_timeslice.orchestrator.gate_hub import GateHub
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from tests.support.fake_engines import FakeVllm
from tests.support.fake_nvml import FakeNvml

pytestmark = pytest.mark.timeout(60)
GIB = 1024**3
PID = 7


async def _unimplemented(request_iterator, context):
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
    yield  # pragma: no cover - an async generator, as RunOperations is


@pytest.mark.parametrize("stream", [True, False], ids=["operation_stream", "unary_calls"])
async def test_the_groups_budget_for_the_level_is_sent_with_the_sleep(stream):
    engine = FakeVllm().start()
    nvml = FakeNvml()
    backend = VllmBackend(
        engine.url, idle_timeout_s=1, nvml=nvml, engine_pids=[PID], memory_poll_s=0.0, memory_settle_timeout_s=1
    )
    srv = SidecarServer({"s": backend}, port=0, token="t")
    if not stream:
        srv.servicer.RunOperations = _unimplemented  # type: ignore[method-assign,assignment]
    await srv.start()
    acts = GrpcSwitchActions(GateHub(), token="t")
    sampler = SamplerEndpoint("default", engine.url.removeprefix("http://"), f"127.0.0.1:{srv.port}", "s")
    spec = GroupSpec("g", [sampler], residual_budget_bytes={1: 2 * GIB})
    try:
        nvml.script(PID, 70 * GIB, 3 * GIB)  # freed 96 %, but over the group's 2 GiB for level 1
        with pytest.raises(SamplerStepFailed) as caught:
            await acts.suspend_sampler(spec, sampler, acts._config(1))
        assert caught.value.fault is StepFault.ENGINE
        assert "still holds 3.00 GiB" in str(caught.value) and "the group's residual_budget_bytes" in str(caught.value)
        await acts._operation(sampler, "g", "wake", acts._config(1))
        nvml.script(PID, 70 * GIB, 3 * GIB)
        await acts.suspend_sampler(spec, sampler, acts._config(2))  # no budget for level 2: the sidecar's default
        assert engine.level == 2
    finally:
        await acts.close()
        await srv.stop()
        engine.stop()
