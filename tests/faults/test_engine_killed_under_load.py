"""``kill -9`` of one of two engines under steady load, through the local stack's chain: real Envoy (the gate picks,
docs/gate.md "When an engine dies"), the gate, the orchestrator and the sidecars as in production, the engines as
fake vLLM processes (SIGKILL: the kernel refuses new connections and resets the open ones).

What must hold: only requests already sent to the dying engine are lost (a refused connection is retried on the
other endpoint the gate listed); the gate stops steering to the dead endpoint on its first refused connection and
the orchestrator, told by the gate, audits that engine at once and takes it out of service (the periodic engine
audit is off here, so nothing else would)."""

from __future__ import annotations

import asyncio
import time

import httpx
import port_for
import pytest

from epp_plugin.gate.pool_state import EndpointState
from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.router.envoy_launcher import EnvoyProcess
from tests.support.cli import CliProcess
from tests.support.fake_engine_process import FakeVllmProcess
from tests.support.router import envoy_config
from tests.support.waits import until

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(120)]
TOKEN = "t"
CLIENTS = 8
LOAD_S = 2.0
KILL_AT_S = 0.6


class Sidecar(CliProcess):
    def __init__(self, job: str, engine_url: str, token_file: str, logdir) -> None:
        port = port_for.select_random()
        args = ["sidecar", "--job-id", job, "--engine-url", engine_url, "--port", str(port), "--token-file", token_file]
        super().__init__(args, port, logdir / f"sidecar-{job}.log")


async def test_engine_killed_under_load_loses_only_what_it_held_and_leaves_service_at_its_first_refused_connection(
    artifacts,
):
    token_file = artifacts / "token"
    token_file.write_text(TOKEN)
    engines = [FakeVllmProcess(completion_delay_s=0.05).start() for _ in range(2)]
    sidecars = [Sidecar(f"s{i}", e.url, str(token_file), artifacts) for i, e in enumerate(engines)]
    orch = gate = envoy = None
    try:
        await asyncio.gather(*(s.start() for s in sidecars))
        dead, alive = (e.address for e in engines)
        inv = Inventory.model_validate(
            {
                "groups": [
                    {
                        "group_id": "g",
                        "samplers": [
                            {"pool": "default", "address": e.address, "sidecar": f"127.0.0.1:{s.port}", "job_id": f"s{i}"}
                            for i, (e, s) in enumerate(zip(engines, sidecars, strict=True))
                        ],
                    }
                ]
            }
        )
        orch = OrchestratorServer(inv, port=0, token=TOKEN, engine_audit_interval_s=0)  # no periodic audit
        await orch.start()
        orch.orchestrator.start_repair(first_s=30, max_s=30)  # no re-wake of the dead engine during the test
        gate = GateServer(
            GateConfig(ext_proc_port=0, authz_port=0, control_port=0, orchestrator=f"127.0.0.1:{orch.port}", token=TOKEN)
        )
        await gate.start()
        pool = gate.pools["default"]
        cfg = envoy_config("ext_authz-pick", gate_port=gate.ext_proc_port, authz_port=gate.authz_port, epp_port=None)
        envoy = EnvoyProcess(cfg, artifacts)
        await asyncio.to_thread(envoy.start)
        await until(lambda: set(pool.serving()) == {dead, alive}, 20, "both endpoints SERVING at the gate")
        await until(lambda: gate.directory.known((dead, alive)), 10, "Envoy has both endpoints (EDS)")

        results: list[tuple[float, int | str]] = []  # (start, status or error)
        killed: dict[str, float] = {}
        t0 = time.monotonic()

        async def client(c: httpx.AsyncClient) -> None:
            while time.monotonic() - t0 < LOAD_S:
                start = time.monotonic()
                try:
                    r = await c.post(envoy.url + "/v1/completions", json={"prompt": "p", "max_tokens": 1})
                    results.append((start, r.status_code))
                except httpx.HTTPError as exc:
                    results.append((start, repr(exc)))

        async def kill() -> None:
            await asyncio.sleep(KILL_AT_S)
            # Every request that may be on it (upper bound): counted from its admission until its access-log entry.
            before = pool.endpoints[dead].in_flight
            killed["at"] = time.monotonic()
            await asyncio.to_thread(engines[0].kill)
            killed["reaped"] = time.monotonic()
            killed["in_flight"] = max(before, pool.endpoints[dead].in_flight)  # and those admitted during the kill

        async with httpx.AsyncClient(timeout=20, limits=httpx.Limits(max_connections=CLIENTS)) as c:
            await asyncio.gather(*(client(c) for _ in range(CLIENTS)), kill())

        failed = [(round(s - killed["at"], 3), st) for s, st in results if st != 200]
        after = [st for s, st in results if s >= killed["reaped"]]
        print(f"requests {len(results)}, failed {len(failed)} {failed}, bound {killed['in_flight']}, after {len(after)}")
        assert len(after) > 20, f"too little load after the kill to show anything: {len(after)} requests"
        assert all(st == 200 for st in after), f"requests started after the kill must be served by the other engine: {failed}"
        assert len(failed) <= killed["in_flight"], (
            f"{len(failed)} requests failed, more than the {killed['in_flight']} that could be on the killed engine: {failed}"
        )
        assert dead in pool.failed or pool.endpoints[dead].state is not EndpointState.SERVING
        # The gate told the orchestrator: the group audits the engine now, finds it unreachable and takes it out.
        group = orch.orchestrator.groups["g"]
        await until(lambda: dead in group.sampler_errors, 15, "the orchestrator took the dead engine out of service")
        await until(lambda: pool.endpoints[dead].state is not EndpointState.SERVING, 15, "the gate no longer sees it SERVING")
        assert pool.serving() == (alive,)
    finally:
        if envoy is not None:
            await asyncio.to_thread(envoy.stop)
        if gate is not None:
            await gate.stop(0.5)
        if orch is not None:
            await orch.stop()
        for s in sidecars:
            s.stop()
        for e in engines:
            e.kill()
