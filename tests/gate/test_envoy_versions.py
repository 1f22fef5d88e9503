"""A dead or stalled gate gives clients a retryable status, on each shipped variant's own Envoy version.

Each Envoy-based variant runs its own Envoy (``manifests/families/envoy.py`` ``ENVOY_VERSIONS``: standalone 1.40.0 pinned by
our values, Istio 1.29 on the 1.37 line, Envoy Gateway v1.9 on 1.39.0). HTTP ext_authz on Envoy 1.37.0 answers 403
instead of the configured ``status_on_error`` when its server fails or times out (envoyproxy/envoy #42099 brought
it, #43257 fixed it; changelogs/1.37.1.yaml), and a 403 is no reason for any client to retry. So every variant's
configuration, as the tests under tests/manifests/ build it, is started with the Envoy binary of its version,
its gate cluster pointed at (a) a port nobody listens on and (b) a socket that accepts and never answers (a gate
frozen by SIGSTOP: the kernel still accepts), and a request must get 503 (what each filter's ``status_on_error``
or our ``local_reply_config`` maps) within the gate timeout plus a margin.

The EPP is a real ext_proc server (this project's picker, ``llmd-timeslice picker``): the EPP's filter also
processes the response of the gate filter's local reply (its response modes are SEND/streamed), and a dead EPP would
turn any answer into its own 500, which is not the case under test.

What is rewritten for the run, and only that: listener and admin ports (free loopback ones), the gate clusters'
endpoints, the EPP clusters' endpoints (the picker, plaintext: the chart's EPP serves TLS), and the gate filter's
timeout (0.5 s instead of the hold limit, so a stall costs half a second, not ten minutes: the timeout's own value is
checked in tests/manifests/test_gateway_routes.py and test_istio_fast_path.py). The dead and the stalled gate are
tried at once, each on its own Envoy.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import port_for
import pytest
import yaml

from llmd_timeslice.router.envoy_config import AUTHZ_FILTER_NAME
from tests.manifests.support import (
    GUIDE,
    S,
    built,
    envoy_gateway_effective_config,
    find,
    gen,
    istio_effective_config,
)
from tests.support.envoy_versions import envoy_binary_of
from tests.support.router import PickerProcess

pytestmark = pytest.mark.envoy

GATE_TIMEOUT_S = 0.5
RETRYABLE = {503}
"""What a client may retry: every gate filter sets ``status_on_error: 503``; a 403 (ext_authz's hard-coded answer on
1.37.0) or 500 (ext_proc's default) would end the request for good."""


def variant_bootstraps() -> dict[str, dict]:
    """Variant -> the Envoy bootstrap it runs (the same builders as the validation in tests/manifests/test_envoy_configs.py)."""
    return {
        "standalone": gen.render_chart_envoy_yaml((GUIDE / "router" / "values-standalone.yaml").read_text(), S.pool, S.namespace),
        "istio": istio_effective_config(find(built("gateways/istio"), "EnvoyFilter")),
        "istio-ext-proc": istio_effective_config(find(built("gateways/istio-ext-proc"), "EnvoyFilter")),
        "envoy-gateway": envoy_gateway_effective_config()[0],
    }


def _walk(node) -> Iterator[dict]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def _gate_filter(boot: dict) -> dict:
    """The first HTTP filter of the client listener: the gate (ext_authz on the fast path, ext_proc elsewhere)."""
    for lis in boot["static_resources"]["listeners"]:
        hcm = lis["filter_chains"][0]["filters"][0]["typed_config"]
        filters = hcm.get("http_filters", [])
        if filters and "health_check" not in filters[0]["name"]:
            return filters[0]
    raise AssertionError("no listener with a gate filter")


def _at(cluster: dict, port: int) -> None:
    for k in ("dns_lookup_family", "dns_refresh_rate", "respect_dns_ttl", "dns_jitter", "transport_socket"):
        cluster.pop(k, None)
    cluster["type"] = "STATIC"
    cluster["load_assignment"] = {
        "cluster_name": cluster["name"],
        "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}
        ],
    }


def for_run(boot: dict, gate_port: int, epp_port: int = 1) -> tuple[dict, int, int]:
    """``boot`` on free loopback ports, its gate clusters at ``gate_port``, its EPP clusters at ``epp_port``, the gate
    timeout ``GATE_TIMEOUT_S``. Returns the bootstrap, the client listener's port and the admin port."""
    boot = copy.deepcopy(boot)
    gate = _gate_filter(boot)
    tc = gate["typed_config"]
    if gate["name"] == AUTHZ_FILTER_NAME:
        gate_clusters = {tc["http_service"]["server_uri"]["cluster"]}
        for node in _walk(boot):  # the filter's and every per-route check's
            if "server_uri" in node and node["server_uri"].get("cluster") in gate_clusters:
                node["server_uri"]["timeout"] = f"{GATE_TIMEOUT_S}s"
    else:
        gate_clusters = {tc["grpc_service"]["envoy_grpc"]["cluster_name"]}
        tc["message_timeout"] = f"{GATE_TIMEOUT_S}s"
    # The fast path's completions go to the gate too (its gRPC access-log sink): the same dead or frozen gate.
    for n in list(_walk(boot)):
        for key in ("access_log", "upstream_log"):
            for entry in n.get(key, []) if isinstance(n.get(key), list) else []:
                gate_clusters |= {g["envoy_grpc"]["cluster_name"] for g in _walk(entry) if "envoy_grpc" in g}
    epp_clusters = {
        n["envoy_grpc"]["cluster_name"]
        for n in _walk(boot)
        if "envoy_grpc" in n and n is not tc.get("grpc_service") and n["envoy_grpc"]["cluster_name"] not in gate_clusters
    }
    for c in boot["static_resources"]["clusters"]:
        if c["name"] in gate_clusters:
            _at(c, gate_port)
        elif c["name"] in epp_clusters:
            _at(c, epp_port)
    client_port = None
    for lis in boot["static_resources"]["listeners"]:
        port = port_for.select_random()
        lis["address"]["socket_address"].update(address="127.0.0.1", port_value=port)
        lis.pop("additional_addresses", None)  # the chart's `::` binds (fixed ports): loopback IPv4 only here
        lis["name"] = f"{lis['name']}-{port}"
        if gate in lis["filter_chains"][0]["filters"][0]["typed_config"].get("http_filters", []):
            client_port = port
    admin = port_for.select_random()
    boot["admin"] = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}}
    assert client_port is not None
    return boot, client_port, admin


@contextmanager
def running_envoy(version: str, boot: dict, admin_port: int, workdir: Path) -> Iterator[None]:
    path = workdir / f"envoy-{version}.json"
    path.write_text(json.dumps(boot))
    log = (workdir / f"envoy-{version}.log").open("w")
    proc = subprocess.Popen(
        [
            str(envoy_binary_of(version)),
            "-c",
            str(path),
            "--concurrency",
            "1",
            "--log-level",
            "warn",
            "--base-id",
            str(admin_port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"Envoy {version} exited: {(workdir / f'envoy-{version}.log').read_text()[-2000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{admin_port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"Envoy {version} not ready in 30 s"
            time.sleep(0.02)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextmanager
def silent_gate() -> Iterator[int]:
    """A socket that accepts connections and reads, never answers: a frozen gate. Yields its port."""
    srv = socket.create_server(("127.0.0.1", port_for.select_random()))
    srv.settimeout(0.2)
    stop = threading.Event()
    held: list[socket.socket] = []

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(2)
        for c in held:
            c.close()
        srv.close()


def _request(port: int) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": "m", "prompt": "hi", "max_tokens": 1},
        timeout=GATE_TIMEOUT_S + 20,
    )


@pytest.fixture(scope="module")
def epp_port(tmp_path_factory):
    """A real ext_proc EPP (this project's picker) for every run of this module."""
    picker = PickerProcess({S.pool: ["127.0.0.1:9"]}, S.pool, tmp_path_factory.mktemp("epp") / "picker.log")
    asyncio.run(picker.start())
    yield picker.port
    picker.stop()


@pytest.mark.parametrize("variant", sorted(gen.ENVOY_VERSIONS))
def test_a_dead_or_stalled_gate_gives_a_retryable_status_on_the_variants_envoy(variant, tmp_path, epp_port):
    version = gen.ENVOY_VERSIONS[variant]
    dead_port = port_for.select_random()  # nobody listens there
    bootstrap = variant_bootstraps()[variant]

    def answer(case: str, gate_port: int) -> tuple[httpx.Response, float]:
        boot, client_port, admin = for_run(bootstrap, gate_port, epp_port)
        (tmp_path / case).mkdir()
        with running_envoy(version, boot, admin, tmp_path / case):
            t0 = time.monotonic()
            r = _request(client_port)
            return r, time.monotonic() - t0

    with silent_gate() as stalled_port, ThreadPoolExecutor(2) as pool:
        cases = {case: pool.submit(answer, case, port) for case, port in (("dead", dead_port), ("stalled", stalled_port))}
        answers = {case: f.result() for case, f in cases.items()}
    for case, (r, took) in answers.items():
        assert r.status_code in RETRYABLE, (
            f"{variant} on Envoy {version}, {case} gate: {r.status_code} {r.headers} {r.text[:200]!r}"
        )
        assert took < GATE_TIMEOUT_S + 10, f"{variant} {case}: {took:.1f} s"
        assert r.headers.get("x-llmd-timeslice-reason") == "gate_unavailable" and r.headers.get("retry-after"), (
            f"{variant} {case}: a retryable refusal names its reason and when to retry: {r.headers}"
        )


def test_envoy_1_37_0_really_answers_403_for_a_failed_http_ext_authz_check(tmp_path, epp_port):
    """The regression the fast path must survive is real on the binary that stands for Istio 1.29's Envoy: the
    fast path's ext_authz filter alone (our refusal mapper left out) gives 403 for a dead gate despite
    ``status_on_error: 503``."""
    boot, client_port, admin = for_run(variant_bootstraps()["istio"], port_for.select_random(), epp_port)
    for node in _walk(boot):
        node.pop("local_reply_config", None)
    with running_envoy("1.37.0", boot, admin, tmp_path):
        r = _request(client_port)
    assert _gate_filter(boot)["typed_config"]["status_on_error"] == {"code": 503}
    assert r.status_code == 403, r.status_code


def test_the_bootstraps_run_here_are_the_validated_ones():
    """Only ports, gate endpoints and the gate timeout differ from what tests/manifests/test_envoy_configs.py validates."""
    for variant, boot in variant_bootstraps().items():
        run, _, _ = for_run(boot, 1)
        a, b = yaml.safe_dump(boot), yaml.safe_dump(run)
        assert a != b and _gate_filter(run)["name"] == _gate_filter(boot)["name"], variant
