"""What the local router (``llmd_timeslice.router.envoy_config.render_bootstrap``, real Envoy, real gate and picker) lets
through to an engine: the OpenAI API only.

The engine here is :class:`FakeVllm`, which records every request it receives, so "never reached" is a
fact read from its log, not inferred from a status code. The real-vLLM counterpart (the engines stay
awake, through ``llmd-timeslice up``) is ``tests/local/test_stack_up.py``.
"""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import port_for
import pytest

from epp_plugin.gate.pool_state import EndpointState
from llmd_timeslice.router.envoy_config import ADMIN_PATHS_UNDER_API, API_PREFIX, EnvoyRouterConfig, render_bootstrap
from llmd_timeslice.router.envoy_launcher import POLL_S, EnvoyProcess, envoy_binary
from tests.support.fake_engines import FakeVllm
from tests.support.router import start_router

# vLLM 0.32.0 with VLLM_SERVER_DEV_MODE=1 (vllm/entrypoints/serve/dev, vllm/entrypoints/rl): a sample of each kind.
ADMIN_POSTS = [
    "/sleep?level=2",
    "/wake_up",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/pause",
    "/update_weights",
    "/update_weight_version",
    *ADMIN_PATHS_UNDER_API,
]
ADMIN_GETS = ["/is_sleeping", "/server_info", "/weight_info", "/metrics"]
COMPLETION = {"model": "fake", "prompt": "hi", "max_tokens": 2}


@pytest.fixture
async def engines():
    a, b = FakeVllm().start(), FakeVllm().start()
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture
async def two_pool_router(artifacts, engines):
    addr = [e.url.removeprefix("http://") for e in engines]
    stack = await start_router(artifacts, [addr[0]], pool="pool-a", extra_pools={"pool-b": ("/pool-b/", [addr[1]])})
    stack.pool("pool-a").set_states([(addr[0], EndpointState.SERVING, 0)])
    stack.pool("pool-b").set_states([(addr[1], EndpointState.SERVING, 0)])
    yield stack
    await stack.stop()


async def test_engine_admin_paths_get_404_from_the_router_and_never_reach_the_engine(two_pool_router, engines):
    a, b = engines
    async with httpx.AsyncClient(timeout=10) as c:
        for base in ("", "/pool-b"):
            for path in ADMIN_POSTS:
                r = await c.post(two_pool_router.url + base + path, json={"method": "reload_weights"})
                assert r.status_code == 404, f"POST {base}{path}: {r.status_code} {r.text}"
                assert r.json()["error"]["type"] == "not_routed"
            for path in ADMIN_GETS:
                r = await c.get(two_pool_router.url + base + path)
                assert r.status_code == 404, f"GET {base}{path}: {r.status_code}"
        # Tricks that would reach /sleep on a router matching raw paths.
        for path in ("/v1/../sleep", "/v1/./../wake_up", "//sleep", "/pool-b/v1/../../sleep"):
            r = await c.post(two_pool_router.url + path)
            assert r.status_code == 404, f"POST {path}: {r.status_code}"
        r = await c.post(two_pool_router.url + "/v1%2F..%2Fsleep")
        assert r.status_code in (400, 404), f"an escaped slash must not reach the engine: {r.status_code}"
        r = await c.post(two_pool_router.url + API_PREFIX + "completions", json=COMPLETION)
        assert r.status_code == 200 and r.json()["choices"], r.text
    assert a.level == b.level == 0, "both engines stay awake"
    hits = [(m, p) for e in engines for m, p, _ in e.calls]
    assert hits == [("POST", "/v1/completions")], f"only the completion may reach an engine, saw {hits}"
    assert two_pool_router.pool("pool-a").held == two_pool_router.pool("pool-b").held == 0


async def test_each_pool_route_strips_its_prefix_before_the_engine(two_pool_router, engines):
    """Issue 15 item 8 at the router: /pool-b/v1/completions reaches pool-b's engine as /v1/completions."""
    a, b = engines
    async with httpx.AsyncClient(timeout=10) as c:
        ra = await c.post(two_pool_router.url + "/v1/completions", json=COMPLETION)
        rb = await c.post(two_pool_router.url + "/pool-b/v1/completions", json=COMPLETION)
        rm = await c.get(two_pool_router.url + "/pool-b/v1/models")
    assert ra.status_code == rb.status_code == rm.status_code == 200, (ra.text, rb.text, rm.text)
    assert [(m, p) for m, p, _ in a.calls] == [("POST", "/v1/completions")]
    assert [(m, p) for m, p, _ in b.calls] == [("POST", "/v1/completions"), ("GET", "/v1/models")]


async def test_a_sleeping_pool_holds_its_requests_but_never_a_404(two_pool_router, engines):
    """The 404 route bypasses the gate: an admin path is refused at once even while the pool holds."""
    a, _ = engines
    two_pool_router.pool("pool-a").set_states([(a.url.removeprefix("http://"), EndpointState.ASLEEP, 0)])
    async with httpx.AsyncClient(timeout=5) as c:
        r = await c.post(two_pool_router.url + "/sleep")
    assert r.status_code == 404 and two_pool_router.pool("pool-a").held == 0


def _envoy(boot: dict, where) -> list[str]:
    where.write_text(json.dumps(boot))
    return [
        str(envoy_binary()),
        "-c",
        str(where),
        "--concurrency",
        "1",
        "--log-level",
        "warn",
        "--use-dynamic-base-id",
        "--disable-hot-restart",
    ]


def _start_envoy(boot: dict, where) -> subprocess.Popen:
    """Start Envoy on ``boot`` and return once its admin ``/ready`` answers (its listener is bound then)."""
    proc = subprocess.Popen(_envoy(boot, where), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    admin = boot["admin"]["address"]["socket_address"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://{admin['address']}:{admin['port_value']}/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"Envoy on {where} did not become ready")


def test_a_second_envoy_on_the_routers_port_fails_to_bind_instead_of_sharing_its_traffic(artifacts):
    """Envoy 1.40 binds listeners with SO_REUSEPORT by default: a second Envoy on the same port would start and take
    a share of the requests. The rendered router listener turns it off (the second line of defence behind `up`'s
    port check). Control: with Envoy's default on both, the second Envoy binds and becomes ready (so this test can
    fail)."""

    def boot(port: int, reuse: bool | None = None) -> dict:
        b = render_bootstrap(
            EnvoyRouterConfig(
                listen_port=port, admin_port=port_for.select_random(), gate_port=None, epp_port=port_for.select_random()
            )
        )
        if reuse is not None:
            b["static_resources"]["listeners"][0]["enable_reuse_port"] = reuse
        return b

    port = port_for.select_random()
    assert boot(port)["static_resources"]["listeners"][0]["enable_reuse_port"] is False
    first = _start_envoy(boot(port), artifacts / "first.json")
    try:
        # Whatever the second asks for, it cannot join a socket bound without SO_REUSEPORT.
        for reuse in (None, True):
            second = subprocess.run(
                _envoy(boot(port, reuse), artifacts / "second.json"), capture_output=True, text=True, timeout=30
            )
            assert second.returncode != 0, f"a second Envoy (reuse_port {reuse}) started on the router's port"
            assert "Address already in use" in second.stderr, second.stderr[-2000:]
    finally:
        first.terminate()
        first.wait(10)
    port = port_for.select_random()
    first = _start_envoy(boot(port, True), artifacts / "first-default.json")
    try:
        second = _start_envoy(boot(port, True), artifacts / "second-default.json")  # ready: it bound the same port
        try:
            assert second.poll() is None, "the second Envoy with SO_REUSEPORT on both must run"
        finally:
            second.terminate()
            second.wait(10)
    finally:
        first.terminate()
        first.wait(10)


def test_an_envoy_process_checks_its_start_and_its_stop_every_poll_s(artifacts, monkeypatch):
    """``start()`` returns once the admin ``/ready`` answers, ``stop()`` once the process exited; each waits in steps
    of ``POLL_S`` (mirakuru's own 0.1 s added a tenth of a second to every start and stop)."""
    import mirakuru.base

    sleeps: list[float] = []
    sleep = time.sleep

    def recording(s: float) -> None:
        sleeps.append(s)
        sleep(s)

    monkeypatch.setattr(mirakuru.base.time, "sleep", recording)
    cfg = EnvoyRouterConfig(
        listen_port=port_for.select_random(),
        admin_port=port_for.select_random(),
        gate_port=None,
        epp_port=port_for.select_random(),
    )
    envoy = EnvoyProcess(cfg, artifacts)
    envoy.start()
    proc = envoy._exec.process  # type: ignore[union-attr]
    assert proc is not None
    assert httpx.get(f"http://127.0.0.1:{cfg.admin_port}/ready", timeout=5).status_code == 200
    envoy.stop()
    assert proc.poll() is not None and envoy.pid is None, "stop() returns once Envoy exited"
    assert sleeps and set(sleeps) == {POLL_S}, sleeps


def test_envoy_validate_reports_envoys_reason_in_one_line(tmp_path):
    """Envoy prints its log prefix, the reason, then the whole bootstrap: the error keeps the reason only."""
    from llmd_timeslice.router.envoy_config import write_bootstrap
    from llmd_timeslice.router.envoy_launcher import validate

    cfg = EnvoyRouterConfig(8080, 9901, 9002, 9004, max_hold_s=float("nan"), gate_edge="ext_proc")
    bad = write_bootstrap(cfg, tmp_path / "bad.json")
    with pytest.raises(ValueError) as e:
        validate(bad)
    msg = str(e.value)
    assert "\n" not in msg and "{" not in msg and "duration must start with an integer" in msg, msg
    assert msg.startswith(f"envoy rejected {bad}: error initializing configuration"), msg


def test_gate_picking_envoy_waits_its_eds_initial_fetch_timeout_for_the_first_assignment_and_refuses_0():
    from llmd_timeslice.router.envoy_clusters import EDS_INITIAL_FETCH_TIMEOUT_S
    from llmd_timeslice.router.envoy_config import render_bootstrap

    def fetch_timeout(cfg: EnvoyRouterConfig) -> str:
        (cluster,) = [c for c in render_bootstrap(cfg)["static_resources"]["clusters"] if c["name"] == "endpoints"]
        return cluster["eds_cluster_config"]["eds_config"]["initial_fetch_timeout"]

    picks = {"listen_port": 8080, "admin_port": 9901, "gate_port": 9002, "epp_port": None, "authz_port": 9003}
    assert fetch_timeout(EnvoyRouterConfig(**picks)) == f"{EDS_INITIAL_FETCH_TIMEOUT_S:.3f}s" == "2.000s"
    assert fetch_timeout(EnvoyRouterConfig(**picks, eds_initial_fetch_timeout_s=0.1)) == "0.100s"
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=rf"eds_initial_fetch_timeout_s must be > 0 seconds, got {bad}"):
            EnvoyRouterConfig(**picks, eds_initial_fetch_timeout_s=bad)
