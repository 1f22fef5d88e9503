"""Faults of the parts a phase switch talks to, with the sidecars as real processes where a test kills (SIGKILL) or
freezes (SIGSTOP) one (``sidecar_processes``), else in this process (a Python start less each): a sidecar dying
mid-sleep, an engine dying while asleep or while waking, and a slow control plane. For each:
what the trainer and the clients see (an error with the reason, or completion; never a hang), that no
request is delivered to a sleeping engine, and that the group comes back without a human once the part is
back (the orchestrator's repair loop)."""

from __future__ import annotations

import asyncio

import port_for
import pytest

from epp_plugin.gate.pool_state import EndpointState
from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient, LeaseError
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from tests.support.cli import CliProcess
from tests.support.fake_engines import FakeVllm
from tests.support.waits import until as _until

pytestmark = pytest.mark.timeout(120)
TOKEN = "t"


class Sidecar(CliProcess):
    """``llmd-timeslice sidecar`` as a child process."""

    def __init__(self, job: str, engine_url: str, token_file: str, logdir) -> None:
        port = port_for.select_random()
        args = ["sidecar", "--job-id", job, "--engine-url", engine_url, "--port", str(port), "--idle-timeout-s", "1"]
        super().__init__([*args, "--token-file", token_file], port, logdir / f"sidecar-{job}.log")


@pytest.fixture
def sidecar_processes() -> bool:
    """Whether the stack's sidecars run as processes (``@pytest.mark.parametrize("sidecar_processes", [True])``: a
    test that kills or freezes one); else they serve in this process (``SidecarServer``, as the CLI builds it)."""
    return False


@pytest.fixture
def orchestrator_settings() -> dict:
    """Keyword arguments of the stack's ``OrchestratorServer`` (a test overrides them with ``parametrize``)."""
    return {}


@pytest.fixture
async def stack(tmp_path, sidecar_processes, orchestrator_settings):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    ports = [port_for.select_random(), port_for.select_random()]
    engines = [FakeVllm(port=p).start() for p in ports]
    sidecars: list = [
        Sidecar(f"s{i}", e.url, str(token_file), tmp_path)
        if sidecar_processes
        else SidecarServer({f"s{i}": VllmBackend(e.url, idle_timeout_s=1)}, port=0, token=TOKEN)
        for i, e in enumerate(engines)
    ]
    st: dict = {"engines": engines, "ports": ports, "sidecars": sidecars}
    try:  # whatever was started is stopped, also when the set-up fails half-way
        await asyncio.gather(*(s.start() for s in sidecars))
        addrs = [e.url.removeprefix("http://") for e in engines]
        inv = Inventory.model_validate(
            {
                "groups": [
                    {
                        "group_id": "g",
                        "drain_timeout_s": 5,
                        "sleep_deadline_s": 10,
                        "wake_deadline_s": 10,
                        "samplers": [
                            {"pool": "default", "address": a, "sidecar": f"127.0.0.1:{s.port}", "job_id": f"s{i}"}
                            for i, (a, s) in enumerate(zip(addrs, sidecars, strict=True))
                        ],
                    }
                ]
            }
        )
        orch = st["orch"] = OrchestratorServer(inv, port=0, token=TOKEN, **orchestrator_settings)
        await orch.start()
        orch.orchestrator.start_repair(first_s=0.5, max_s=2.0)  # quick retries for the test (no audit)
        gate = st["gate"] = GateServer(
            GateConfig(ext_proc_port=0, control_port=0, orchestrator=f"127.0.0.1:{orch.port}", token=TOKEN, max_hold_s=30)
        )
        await gate.start()
        await asyncio.wait_for(gate.subscription.connected.wait(), 10)
        st["client"] = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="g", token=TOKEN)
        st.update(addrs=addrs, pool=gate.pools["default"])
        yield st
    finally:  # st["orch"]: a test may replace the orchestrator (restart), and the new one must be stopped too
        if "client" in st:
            await st["client"].close()
        if "gate" in st:
            await st["gate"].stop()
        if "orch" in st:
            await st["orch"].stop()
        for s in st["sidecars"]:
            if isinstance(s, SidecarServer):
                await s.stop()
            else:
                s.stop()
        for e in st["engines"]:
            e.stop()


async def _requests(pool, n: int) -> list:
    """``n`` admissions through the gate's pool (what Envoy's ext_proc streams do); each finished at once."""
    out = []
    for _ in range(n):
        adm = await asyncio.wait_for(pool.admit(), 30)
        out.append(adm.candidates)
        pool.finish(adm)
    return out


@pytest.mark.parametrize("sidecar_processes", [True], ids=["sidecar_processes"])
async def test_sidecar_killed_mid_sleep_fails_the_acquire_then_the_group_repairs_itself(stack):
    engines, sidecars, client, pool, addrs = stack["engines"], stack["sidecars"], stack["client"], stack["pool"], stack["addrs"]
    stack["orch"].actions.start_rpc_timeout_s = 1.0  # how long a call to the dead sidecar waits (6 s by default)
    engines[0].sleep_delay_s = 1.0  # its sidecar is killed while this sleep runs (the other's returns at once)
    acquire = asyncio.create_task(client.acquire(timeout_sec=60))
    await _until(lambda: any(p == "/sleep" for _, p, _ in engines[0].calls), what="the sleep call")
    sidecars[0].kill()
    with pytest.raises(LeaseError, match=r"ABORTED: switch to job 'trainer' failed: sleep of .* via sidecar"):
        await asyncio.wait_for(acquire, 60)
    # A new acquire must fail too while that sidecar is dead: a grant needs every sampler verified asleep
    # (found by this test: after the rolled-back switch, a retry was granted at once while the other sampler
    # was awake and serving).
    with pytest.raises(LeaseError, match="ABORTED"):
        await client.acquire(timeout_sec=60)
    # The switch was rolled back: the sampler whose sidecar lives serves again; the other is out of service.
    await _until(lambda: pool.serving() == (addrs[1],), what="rollback to the live sampler")
    assert pool.endpoints[addrs[0]].state is not EndpointState.SERVING
    assert set(await _requests(pool, 5)) == {(addrs[1],)}
    # Sidecar back: the repair loop wakes the sampler without anyone acquiring.
    await sidecars[0].start()
    await _until(lambda: set(pool.serving()) == set(addrs), what="repair")
    assert engines[0].level == 0
    assert sum(e.completions_while_asleep for e in engines) == 0
    engines[0].sleep_delay_s = 0
    await client.acquire(timeout_sec=30)
    await client.release()


@pytest.mark.parametrize("when", ["asleep", "waking"])
async def test_engine_killed_stays_out_of_service_and_comes_back_when_restarted(stack, when):
    engines, client, pool, addrs, ports = stack["engines"], stack["client"], stack["pool"], stack["addrs"], stack["ports"]
    await client.acquire(timeout_sec=30)
    assert pool.serving() == ()
    held = asyncio.create_task(pool.admit())
    if when == "asleep":
        engines[0].kill()
        await client.release()
    else:
        engines[0].wake_delay_s = 1.0
        await client.release()
        await _until(lambda: any(p == "/wake_up" for _, p, _ in engines[0].calls[-3:]), what="the wake call")
        engines[0].kill()
    adm = await asyncio.wait_for(held, 30)
    assert adm.candidates == (addrs[1],), "the held request went to the live engine only"
    pool.finish(adm)
    await _until(lambda: stack["orch"].orchestrator.groups["g"].state.value == "IDLE")
    assert pool.endpoints[addrs[0]].state is EndpointState.ASLEEP, "the dead engine is out of service"
    g = stack["orch"].orchestrator.groups["g"]
    assert "waking the samplers failed" in g.last_error or addrs[0] in g.sampler_errors
    # The engine comes back (a fresh process on the same port, awake): the repair loop verifies and serves it.
    engines[0] = FakeVllm(port=ports[0]).start()
    await _until(lambda: set(pool.serving()) == set(addrs), what="repair after the engine restart")
    assert sum(e.completions_while_asleep for e in engines) == 0


async def test_slow_control_plane_delays_the_switch_but_loses_nothing(stack):
    engines, client, pool, addrs = stack["engines"], stack["client"], stack["pool"], stack["addrs"]
    for e in engines:
        e.sleep_delay_s = e.wake_delay_s = 0.5
    t = asyncio.get_running_loop().time()
    await client.acquire(timeout_sec=60)
    assert asyncio.get_running_loop().time() - t >= 0.5
    waiting = [asyncio.create_task(pool.admit()) for _ in range(20)]
    await asyncio.sleep(0.2)
    assert not any(w.done() for w in waiting)
    await client.release()
    adms = await asyncio.wait_for(asyncio.gather(*waiting), 30)
    assert all(set(a.candidates) <= set(addrs) and a.candidates for a in adms)
    for a in adms:
        pool.finish(a)
    assert pool.held == 0 and pool.live == 0
    assert sum(e.completions_while_asleep for e in engines) == 0


async def test_orchestrator_restart_mid_switch_rolls_back_and_the_group_serves_again(stack):
    engines, client, pool, addrs = stack["engines"], stack["client"], stack["pool"], stack["addrs"]
    for e in engines:
        e.sleep_delay_s = 1.0
    old = stack["orch"]
    acquire = asyncio.create_task(client.acquire(timeout_sec=60))
    await _until(lambda: any(p == "/sleep" for e in engines for _, p, _ in e.calls), what="the sleep calls")
    await old.stop()  # the orchestrator goes away with the switch half done
    with pytest.raises(LeaseError):
        await asyncio.wait_for(acquire, 30)
    assert pool.serving() == (), "while it is gone the engines are DRAINING/asleep: nothing is steered to them"
    held = asyncio.create_task(pool.admit())
    new = OrchestratorServer(old.inventory, port=old.port, token=TOKEN)
    stack["orch"] = new
    await new.start()  # reconcile: wakes (verified) and publishes every free group's samplers
    adm = await asyncio.wait_for(held, 30)
    assert set(adm.candidates) <= set(addrs) and adm.candidates
    pool.finish(adm)
    await _until(lambda: set(pool.serving()) == set(addrs), what="both samplers serving")
    assert all(e.level == 0 for e in engines)
    for e in engines:
        e.sleep_delay_s = 0
    await client.acquire(timeout_sec=30)  # and the group works as before
    await client.release()
    assert sum(e.completions_while_asleep for e in engines) == 0


@pytest.mark.parametrize("sidecar_processes", [True], ids=["sidecar_processes"])
async def test_a_restarted_sidecar_is_reached_at_once_after_the_engine_audit_probed_it_while_dead(stack):
    """The engine audit keeps calling a dead sidecar, which grows gRPC's reconnect back-off (to 120 s by default):
    found by tests/local/test_stack_up.py, the first switch after the sidecar came back failed fast with UNAVAILABLE.
    The orchestrator's sidecar channels cap the back-off and the switch RPCs wait for the channel to be ready."""
    core, sidecars, client, pool, addrs = (
        stack["orch"].orchestrator,
        stack["sidecars"],
        stack["client"],
        stack["pool"],
        stack["addrs"],
    )
    core.start_repair(first_s=0.5, max_s=2.0, audit_interval_s=0.2)
    sidecars[0].kill()
    # ~15 audit probes of the dead sidecar: no verdict on its engine, nothing changes; the channel's reconnect back-off
    # (0.5 s, x1.6 per failed attempt) has grown to ~2 s, about as long as the sidecar's restart below takes.
    await asyncio.sleep(3)
    assert set(pool.serving()) == set(addrs) and not core.groups["g"].sampler_errors
    await sidecars[0].start()
    await client.acquire(timeout_sec=30)
    assert all(e.level == 1 for e in stack["engines"])
    await client.release()
    await _until(lambda: set(pool.serving()) == set(addrs), what="serving again")


# The probe of a command without an answer after 1 s (2 s by default), which the frozen sidecar must answer within
# 1.5 s (6 s by default): the live sidecar answers its sleep (0.5 s) before it is probed, or the probe at once.
FROZEN_SIDECAR_SETTINGS = {"sidecar_probe_after_s": 1.0, "sidecar_call_timeout_s": 1.5}


@pytest.mark.parametrize("orchestrator_settings", [FROZEN_SIDECAR_SETTINGS], ids=["probe1s"])
@pytest.mark.parametrize("sidecar_processes", [True], ids=["sidecar_processes"])
async def test_sidecar_frozen_mid_sleep_past_the_operation_deadline_fails_the_acquire_then_comes_back(stack):
    """A sidecar frozen (SIGSTOP) mid-sleep for longer than the group's sleep deadline (set to 3 s here): the
    orchestrator's reachability probe (sidecar_stream.py: after ``sidecar_probe_after_s`` without an answer, a call
    the frozen sidecar does not answer within ``sidecar_call_timeout_s``; 1 + 1.5 s here) fails the acquire with the
    reason instead of hanging until the sleep deadline plus its RPC margin; no request reaches a sleeping engine, and
    after SIGCONT the group serves on both samplers again by itself (repair) and the next acquire works."""
    import os
    import signal

    engines, sidecars, client, pool, addrs = stack["engines"], stack["sidecars"], stack["client"], stack["pool"], stack["addrs"]
    g = stack["orch"].orchestrator.groups["g"]
    g.spec.sleep_deadline_s = 3.0  # the group's sleep deadline (issue 38 §2)
    for e in engines:
        e.sleep_delay_s = 0.5
    acquire = asyncio.create_task(client.acquire(timeout_sec=60))
    await _until(lambda: any(p == "/sleep" for _, p, _ in engines[0].calls), what="the sleep call")
    os.kill(sidecars[0].proc.pid, signal.SIGSTOP)
    try:
        # The probe's verdict (not the sleep deadline's): ~2.5 s after the freeze.
        with pytest.raises(LeaseError, match=r"ABORTED: .* did not answer a call within 1\.5 s while the operation ran"):
            await asyncio.wait_for(acquire, 60)
    finally:
        os.kill(sidecars[0].proc.pid, signal.SIGCONT)
    await _until(lambda: set(pool.serving()) == set(addrs), 30, "both samplers serving again after SIGCONT")
    assert set(await _requests(pool, 4)) <= {(addrs[0],), (addrs[1],), tuple(addrs)}
    assert sum(e.completions_while_asleep for e in engines) == 0
    g.spec.sleep_deadline_s = 10.0
    await asyncio.wait_for(client.acquire(timeout_sec=30), 30)


async def test_an_acquire_while_one_engine_restarts_is_granted_on_the_live_one_and_the_returned_engine_sleeps(stack):
    """Issue 38 §5: one of two engines is down (killed, restarting) when a trainer acquires. A dead engine holds no
    accelerator memory: the grant goes on with the live one instead of failing the trainer (it failed with
    ``LeaseError: ABORTED: ... sleep of <engine> failed: ... did not answer GET /metrics``); the dead one stays out of
    service and, when it comes back (awake, from its restart) while the trainer holds the group, is put to sleep,
    verified, before it serves again."""
    engines, client, pool, addrs, ports = stack["engines"], stack["client"], stack["pool"], stack["addrs"], stack["ports"]
    orch = stack["orch"]
    orch.orchestrator.start_repair(first_s=0.5, max_s=2.0, audit_interval_s=0.3)
    g = orch.orchestrator.groups["g"]
    engines[1].kill()
    await client.acquire(timeout_sec=30)
    assert g.holder == "trainer" and engines[0].level == 1, "granted: the live engine asleep"
    assert addrs[1] in g.sampler_errors and "its engine was down at the sleep" in g.sampler_errors[addrs[1]]
    assert pool.serving() == ()
    engines[1] = FakeVllm(port=ports[1]).start()  # back from its restart: awake, holding accelerator memory
    await _until(lambda: engines[1].level == 1, timeout_s=20, what="the returned engine put to sleep")
    await _until(lambda: addrs[1] not in g.sampler_errors, what="counted asleep")
    assert g.holder == "trainer" and pool.serving() == (), "nothing serves while the trainer holds the group"
    assert pool.endpoints[addrs[1]].state is EndpointState.ASLEEP
    await client.release()
    await _until(lambda: set(pool.serving()) == set(addrs), timeout_s=20, what="both serving after the yield")
    assert sum(e.completions_while_asleep for e in engines) == 0
