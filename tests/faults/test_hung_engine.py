"""A hung engine leaves service like a dead one (issue 38 §5).

Before: freezing one vLLM (SIGSTOP) for 10 s went unnoticed; requests in flight to it got vLLM's own bare 503 after
SIGCONT and new ones kept being steered to it. Now the sidecar reports an engine that does not answer the
orchestrator's audit read within ``hung_after_s`` as unreachable (hung): the audit takes it out of service and counts
it (``llmd_timeslice_orchestrator_engine_faults_total{reason="unreachable"}``), and the repair brings it back by itself
once it answers again. The engine here is a real process (a fake vLLM in its own process, frozen with SIGSTOP longer
than the bound); the bound is scaled down to 1 s.
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.orchestrator.service import ENGINE_FAULTS
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from tests.support.fake_engine_process import FakeVllmProcess
from tests.support.fake_engines import FakeVllm
from tests.support.waits import until

pytestmark = pytest.mark.timeout(120)
HUNG_AFTER_S = 1.0


async def test_an_engine_frozen_longer_than_the_bound_leaves_service_is_audited_and_comes_back_by_itself():
    frozen = await asyncio.to_thread(FakeVllmProcess(completion_delay_s=0.0).start)
    live = FakeVllm().start()
    urls = [frozen.url, live.url]
    sidecars = [
        SidecarServer(
            {f"s{i}": VllmBackend(u, idle_timeout_s=1, memory_reader=lambda: None)}, port=0, token="t", hung_after_s=HUNG_AFTER_S
        )
        for i, u in enumerate(urls)
    ]
    orch = gate = None
    unreachable = ENGINE_FAULTS.labels(group_id="g", reason="unreachable")
    before = unreachable._value.get()
    try:
        for s in sidecars:
            await s.start()
        addrs = [u.removeprefix("http://") for u in urls]
        samplers = [
            {"pool": "default", "address": a, "sidecar": f"127.0.0.1:{s.port}", "job_id": f"s{i}"}
            for i, (a, s) in enumerate(zip(addrs, sidecars, strict=True))
        ]
        inv = Inventory.model_validate({"groups": [{"group_id": "g", "samplers": samplers}]})
        orch = OrchestratorServer(inv, port=0, token="t", engine_audit_interval_s=0.3)
        await orch.start()
        gate = GateServer(GateConfig(ext_proc_port=0, control_port=0, orchestrator=f"127.0.0.1:{orch.port}", token="t"))
        await gate.start()
        pool, g = gate.pools["default"], orch.orchestrator.groups["g"]
        await until(lambda: set(pool.serving()) == set(addrs), timeout_s=20, what="both serving")
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        try:
            async with httpx.AsyncClient(timeout=60) as c:  # a request in flight to the frozen engine
                in_flight = asyncio.ensure_future(c.post(f"{frozen.url}/v1/completions", json={"prompt": "x"}))
                await until(lambda: pool.serving() == (addrs[1],), timeout_s=15, what="the hung engine out of service")
                assert addrs[0] in g.sampler_errors, g.sampler_errors
                assert f"did not answer within {HUNG_AFTER_S:g} s (hung" in g.sampler_errors[addrs[0]]
                assert not in_flight.done()
                os.kill(frozen.proc.pid, signal.SIGCONT)
                assert (await asyncio.wait_for(in_flight, 30)).status_code == 200
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        await until(lambda: set(pool.serving()) == set(addrs) and not g.sampler_errors, timeout_s=30, what="back by itself")
        # audited: the repair's record counts the fault (once the repair ended)
        await until(lambda: unreachable._value.get() == before + 1, what="counted as an engine fault")
    finally:
        if gate is not None:
            await gate.stop()
        if orch is not None:
            await orch.stop()
        for s in sidecars:
            await s.stop()
        frozen.kill()
        live.stop()
