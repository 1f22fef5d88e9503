"""The gate reads its pools' InferenceObjectives where the cluster serves them (``--objectives-from-kubernetes``),
through the real ``kubernetes`` client's HTTP layer.

The API server is a small fake (stdlib ``http.server`` in a thread) behind the real one's interface for these
resources, serving ``llm-d.ai/v1alpha2``, ``inference.networking.x-k8s.io/v1alpha2``, both or neither:

* discovery: ``GET /apis`` (``APIGroupList``), ``/apis/<group>`` (``APIGroup``) and ``/apis/<group>/<version>``
  (``APIResourceList``), from tests/fixtures/inference-objectives/discovery.yaml; a group version not served is
  404 with a ``Status`` body, as kube-apiserver answers;
* ``GET /apis/<group>/<version>/namespaces/NS/inferenceobjectives`` lists, or with ``watch=true`` streams
  newline-delimited JSON events over chunked HTTP/1.1 from ``resourceVersion``; a watch ends when its CRD goes;
* 403 answers carry a Kubernetes ``Status`` body, like the real server's.

The objects are the fixtures of each group (tests/fixtures/inference-objectives/, each from a cited commit).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from epp_plugin.gate.objectives_k8s import RBAC_NEEDED, SourceState
from epp_plugin.gate.pool_state import UnknownObjective
from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2_grpc as gpb_grpc
from llmd_timeslice.domain.objectives import Objectives
from llmd_timeslice.status import objectives_line
from tests.support.kube_api import write_kubeconfig
from tests.support.waits import until as _until

NS = "llm-d"
LLMD = "llm-d.ai/v1alpha2"
LEGACY = "inference.networking.x-k8s.io/v1alpha2"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "inference-objectives"
DISCOVERY = yaml.safe_load((FIXTURES / "discovery.yaml").read_text())
OBJECTS = {
    LLMD: list(yaml.safe_load_all((FIXTURES / "llm-d.ai-v1alpha2.yaml").read_text())),
    LEGACY: list(yaml.safe_load_all((FIXTURES / "inference.networking.x-k8s.io-v1alpha2.yaml").read_text())),
}
OBJECTS_PATH = re.compile(r"/apis/([^/]+)/([^/]+)/namespaces/([^/]+)/inferenceobjectives")
NOT_FOUND = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Failure",
    "message": "the server could not find the requested resource",
    "reason": "NotFound",
    "details": {},
    "code": 404,
}


def objective(name: str, priority: int | None, pool: str = "default", group: str | None = None, gv: str = LEGACY) -> dict:
    spec: dict = {"poolRef": {"name": pool, **({"group": group} if group else {})}}
    if priority is not None:
        spec["priority"] = priority
    return {"apiVersion": gv, "kind": "InferenceObjective", "metadata": {"name": name, "namespace": NS}, "spec": spec}


class FakeObjectivesApi:
    """Discovery and the InferenceObjectives of one namespace per served group version, with their event history,
    over HTTP. ``serve(gv, objects)`` installs a CRD (and creates its objects), ``unserve(gv)`` removes it."""

    def __init__(self, forbid: bool = False) -> None:
        self.objects: dict[str, dict[str, dict]] = {}  # group version served -> name -> object
        self.discovery = copy.deepcopy(DISCOVERY)  # its documents, per group version
        self.events: list[tuple[int, str, str, dict]] = []  # (resourceVersion, group version, type, object)
        self.rv = 500
        self.forbid = forbid
        self.discovery_status: int | None = None  # answer discovery with this error status (e.g. 503)
        self.requests: list[tuple[str, bool]] = []
        self.cond = threading.Condition()
        self.stopping = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _json(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                url = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                watch = q.get("watch") in ("true", "1", "True")
                fake.requests.append((url.path, watch))
                with fake.cond:
                    served = list(fake.objects)
                if url.path.rstrip("/") == "/apis":  # the client asks /apis/; the API server answers both
                    groups = [fake.discovery[gv]["group"] for gv in fake.discovery if gv in served]
                    return self._json(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
                parts = url.path.strip("/").split("/")
                if len(parts) == 2 and parts[0] == "apis":
                    for gv in served:
                        if gv.split("/")[0] == parts[1]:
                            return self._json(200, {"kind": "APIGroup", "apiVersion": "v1", **fake.discovery[gv]["group"]})
                    return self._json(404, NOT_FOUND)
                if len(parts) == 3 and parts[0] == "apis" and fake.discovery_status is not None:
                    code = fake.discovery_status
                    return self._json(code, {**NOT_FOUND, "reason": "ServiceUnavailable", "code": code, "message": "etcd"})
                if len(parts) == 3 and parts[0] == "apis":
                    gv = f"{parts[1]}/{parts[2]}"
                    return self._json(200, fake.discovery[gv]["resources"]) if gv in served else self._json(404, NOT_FOUND)
                m = OBJECTS_PATH.fullmatch(url.path)
                gv = f"{m.group(1)}/{m.group(2)}" if m else ""
                if not m or gv not in served:
                    return self._json(404, NOT_FOUND)
                if fake.forbid:
                    group = m.group(1)
                    return self._json(
                        403,
                        {
                            "kind": "Status",
                            "apiVersion": "v1",
                            "status": "Failure",
                            "reason": "Forbidden",
                            "code": 403,
                            "message": f'inferenceobjectives.{group} is forbidden: User "system:serviceaccount:{NS}:'
                            f'llmd-timeslice-gate" cannot list resource "inferenceobjectives" in API group "{group}" '
                            f'in the namespace "{NS}"',
                        },
                    )
                if not watch:
                    with fake.cond:
                        items = [copy.deepcopy(o) for o in fake.objects[gv].values()]
                        rv = fake.rv
                    return self._json(
                        200,
                        {
                            "apiVersion": gv,
                            "kind": "InferenceObjectiveList",
                            "metadata": {"resourceVersion": str(rv)},
                            "items": items,
                        },
                    )
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                since = int(q.get("resourceVersion") or 0)
                deadline = time.monotonic() + float(q.get("timeoutSeconds") or 30)
                try:
                    while not fake.stopping and time.monotonic() < deadline:
                        with fake.cond:
                            if gv not in fake.objects:
                                break  # the CRD went: the API server ends its watches
                            todo = [(rv, k, o) for rv, g, k, o in fake.events if rv > since and g == gv]
                            if not todo:
                                fake.cond.wait(0.1)
                                continue
                        for rv, kind, obj in todo:
                            data = (json.dumps({"type": kind, "object": obj}) + "\n").encode()
                            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                            self.wfile.flush()
                            since = rv
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self._srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._srv.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"
        threading.Thread(target=self._srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def serve(self, gv: str, objects: list[dict] | None = None) -> None:
        """Install the CRD of ``gv`` and create ``objects`` (default: the group's fixtures)."""
        with self.cond:
            self.objects.setdefault(gv, {})
        for obj in OBJECTS[gv] if objects is None else objects:
            self.change("ADDED", obj, gv)

    def unserve(self, gv: str) -> None:
        """Delete the CRD of ``gv``: its objects go with it, its watches end, its paths answer 404."""
        with self.cond:
            self.objects.pop(gv, None)
            self.cond.notify_all()

    def change(self, kind: str, obj: dict, gv: str = LEGACY) -> None:
        with self.cond:
            self.rv += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            if kind == "DELETED":
                self.objects[gv].pop(obj["metadata"]["name"], None)
            else:
                self.objects[gv][obj["metadata"]["name"]] = obj
            self.events.append((self.rv, gv, kind, obj))
            self.cond.notify_all()

    def listed(self, gv: str) -> bool:
        return any(path == f"/apis/{gv}/namespaces/{NS}/inferenceobjectives" for path, _ in self.requests)

    def stop(self) -> None:
        self.stopping = True
        with self.cond:
            self.cond.notify_all()
        self._srv.shutdown()
        self._srv.server_close()


BANDS = Objectives.model_validate({"priority_bands": [{"priority": 10, "max_hold_s": 30, "hold_deadline_s": 5}]})


def _gate(kubeconfig: str | None, **kw) -> GateServer:
    return GateServer(
        GateConfig(
            ext_proc_port=0,
            control_port=0,
            objectives_from_kubernetes=True,
            objectives_namespace=NS,
            kubeconfig=kubeconfig,
            priorities=BANDS,
            **kw,
        )
    )


def _source_gauge(state: str, group_version: str = "") -> float | None:
    return REGISTRY.get_sample_value(
        "llmd_timeslice_gate_objectives_source", {"namespace": NS, "state": state, "group_version": group_version}
    )


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "objectives" in r.name]


async def _status_line(gate: GateServer) -> str:
    """The gate's line of ``llmd-timeslice status`` (a blocking client, as the CLI's, in a thread)."""

    def line() -> str:
        with grpc.insecure_channel(f"127.0.0.1:{gate.control_port}") as ch:
            return objectives_line(gpb_grpc.GateControlServiceStub(ch), [])

    return await asyncio.to_thread(line)


async def _serving(gate: GateServer) -> bool:
    """The data port's gRPC health answer (what Envoy's health check and the pod's probe ask)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gate.ext_proc_port}") as ch:
        answer = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def test_discovery_counts_a_group_version_only_when_it_lists_the_kind():
    """The EPP's test (``gvkExists``): the group version's APIResourceList names kind InferenceObjective. llm-d.ai with
    only llm-d-router's InferenceModelRewrite CRD installed does not count."""
    from kubernetes import client

    from epp_plugin.gate.objectives_discovery import served_group_versions
    from llmd_timeslice.discovery.kubernetes import make_api_client

    api = FakeObjectivesApi()
    api_client = make_api_client(host=api.url)
    try:
        assert served_group_versions(api_client) == []
        api.serve(LEGACY, [])
        api.serve(LLMD, [])
        assert served_group_versions(api_client) == [LLMD, LEGACY], "the EPP's order"
        groups = client.ApisApi(api_client).get_api_versions().groups  # the fixtures parse as the real client's models
        assert sorted(g.preferred_version.group_version for g in groups) == sorted([LLMD, LEGACY])
        resources = api.discovery[LLMD]["resources"]
        resources["resources"] = [r for r in resources["resources"] if r["kind"] != "InferenceObjective"]
        assert served_group_versions(api_client) == [LEGACY]
    finally:
        api_client.close()
        api.stop()


async def test_the_gate_lists_then_watches_the_inference_objectives_of_its_pools(tmp_path):
    api = FakeObjectivesApi()
    api.serve(LEGACY, [])
    api.change("ADDED", objective("eval", 10))
    api.change("ADDED", objective("rollout", None))  # spec.priority unset: 0, as the EPP reads it
    api.change("ADDED", objective("elsewhere", 3, pool="other-pool"))
    api.change("ADDED", objective("foreign", 3, group="example.com"))  # poolRef to another kind of pool: not ours
    api.change("ADDED", objective("huge", 2**40))  # outside int32: left out, the others used
    gate = _gate(write_kubeconfig(tmp_path / "kubeconfig", api.url, NS))
    await gate.start()
    try:
        pool = gate.pools["default"]
        eval_ = pool.objective("eval")
        assert eval_ is not None and eval_.band.priority == 10 and eval_.band.hold_deadline_s == 5, "bands from the file"
        rollout = pool.objective("rollout")
        assert rollout is not None and rollout.band.priority == 0
        for name in ("elsewhere", "foreign", "huge"):
            with pytest.raises(UnknownObjective):
                pool.objective(name)
        assert gate.objective_watch is not None and "huge" in gate.objective_watch.rejected
        assert "spec.priority: Input should be less than or equal to 2147483647" in gate.objective_watch.rejected["huge"]
        api.change("ADDED", objective("canary", 5))
        api.change("DELETED", objective("eval", 10))
        await _until(lambda: "canary" in (pool.priorities.objectives if pool.priorities else {}), 10, "canary watched")
        await _until(lambda: "eval" not in pool.priorities.objectives, 10, "eval deleted")  # type: ignore[union-attr]
        with pytest.raises(UnknownObjective, match="known: canary, rollout"):
            pool.objective("eval")
        reads = [w for path, w in api.requests if path.endswith("/inferenceobjectives")]
        assert reads[:1] == [False] and True in reads, f"a list, then a watch: {reads}"
    finally:
        await gate.stop()
        api.stop()


async def test_only_llm_d_ai_served_its_objectives_set_the_bands(tmp_path, caplog):
    """The cluster of the llm-d guides today: llm-d-router's CRD only (the legacy group is absent)."""
    caplog.set_level(logging.INFO)
    api = FakeObjectivesApi()
    api.serve(LLMD)
    gate = _gate(write_kubeconfig(tmp_path / "kubeconfig", api.url, NS))
    await gate.start()
    try:
        pool = gate.pools["default"]
        eval_ = pool.objective("eval")
        assert eval_ is not None and eval_.band.priority == 10 and eval_.band.hold_deadline_s == 5
        assert pool.objective("rollout").band.priority == 0  # type: ignore[union-attr]
        assert pool.objective("batch").band.sheddable  # type: ignore[union-attr]
        status = gate.objectives_source()
        assert status is not None and (status.state, status.group_version, status.objectives) == (
            SourceState.READING,
            LLMD,
            3,
        )
        assert api.listed(LLMD) and not api.listed(LEGACY), "only the served group is read"
        assert _source_gauge("reading", LLMD) == 1 and _source_gauge("no_crd") == 0
        assert (await _status_line(gate)) == f"objectives: 3 InferenceObjectives from {LLMD} in {NS}; priority bands on"
        assert not _warnings(caplog), _warnings(caplog)
    finally:
        await gate.stop()
        api.stop()
    assert _source_gauge("reading", LLMD) is None, "a stopped gate withdraws its series"


async def test_neither_group_served_the_gate_serves_with_bands_off_and_says_so_once(tmp_path, caplog):
    """The outage of issue 37 §1: no InferenceObjective CRD used to end the gate (exit 2) and take Envoy down."""
    api = FakeObjectivesApi()  # serves neither group
    gate = _gate(write_kubeconfig(tmp_path / "kubeconfig", api.url, NS), objectives_recheck_s=1)
    await gate.start()
    try:
        assert await _serving(gate), "the data plane serves"
        pool = gate.pools["default"]
        assert pool.priorities is None and pool.objective("eval") is None, "bands off: the header is ignored"
        status = gate.objectives_source()
        assert status is not None and status.state is SourceState.NO_CRD and not status.bands
        await _until(lambda: sum(p.endswith("/v1alpha2") for p, _ in api.requests) >= 4, 10, "discovery asked again")
        warnings = _warnings(caplog)
        assert len(warnings) == 1, f"one warning line, not one per check: {warnings}"
        assert f"serves neither {LLMD} nor {LEGACY}" in warnings[0] and "priority bands off" in warnings[0]
        assert _source_gauge("no_crd") == 1 and _source_gauge("reading") == 0
        line = await _status_line(gate)
        assert line.startswith("[yellow]objectives: no_crd: priority bands off: the API server serves neither"), line
    finally:
        await gate.stop()
        api.stop()


async def test_both_groups_served_the_gate_reads_the_one_the_epp_prefers(tmp_path, caplog):
    """llm-d-router's EPP reads llm-d.ai and ignores the legacy objects (controller_config.go): so does the gate."""
    api = FakeObjectivesApi()
    api.serve(LEGACY)
    api.serve(LLMD)
    gate = _gate(write_kubeconfig(tmp_path / "kubeconfig", api.url, NS))
    await gate.start()
    try:
        pool = gate.pools["default"]
        assert pool.objective("eval").band.priority == 10, "llm-d.ai's eval (the legacy one has 3)"  # type: ignore[union-attr]
        with pytest.raises(UnknownObjective):
            pool.objective("legacy-only")
        assert not api.listed(LEGACY)
        status = gate.objectives_source()
        assert status is not None and status.served == (LLMD, LEGACY) and status.group_version == LLMD
        assert any("ignoring the others' objects, as the EPP does" in w for w in _warnings(caplog))
        assert f"served: {LLMD}, {LEGACY}" in (await _status_line(gate))
    finally:
        await gate.stop()
        api.stop()


async def test_crds_that_appear_or_go_are_followed(tmp_path, caplog):
    """No CRD -> legacy installed (bands on) -> llm-d.ai installed (switch, with a warning) -> both removed (off)."""
    api = FakeObjectivesApi()
    gate = _gate(write_kubeconfig(tmp_path / "kubeconfig", api.url, NS), objectives_recheck_s=1)
    await gate.start()
    pool = gate.pools["default"]
    try:
        assert pool.priorities is None
        api.serve(LEGACY)
        await _until(lambda: pool.priorities is not None and "eval" in pool.priorities.objectives, 15, "legacy read")
        assert pool.objective("eval").band.priority == 3  # type: ignore[union-attr]
        api.serve(LLMD)
        await _until(lambda: pool.objective("eval").band.priority == 10, 15, "switched to llm-d.ai")  # type: ignore[union-attr]
        with pytest.raises(UnknownObjective):
            pool.objective("legacy-only")
        assert any(f"now reading {LLMD} (was {LEGACY})" in w for w in _warnings(caplog)), _warnings(caplog)
        api.unserve(LLMD)
        await _until(lambda: gate.objectives_source().group_version == LEGACY, 15, "back to legacy")  # type: ignore[union-attr]
        api.unserve(LEGACY)
        await _until(lambda: pool.priorities is None, 15, "bands off once no CRD is served")
        assert gate.objectives_source().state is SourceState.NO_CRD  # type: ignore[union-attr]
        assert await _serving(gate)
    finally:
        await gate.stop()
        api.stop()


async def test_an_api_server_that_fails_discovery_leaves_the_bands_off_until_it_answers(tmp_path):
    api = FakeObjectivesApi()
    api.serve(LLMD)
    api.discovery_status = 503
    gate = _gate(write_kubeconfig(tmp_path / "kubeconfig", api.url, NS))
    await gate.start()
    try:
        assert (await _serving(gate)) and gate.pools["default"].priorities is None
        status = gate.objectives_source()
        assert status is not None and status.state is SourceState.UNREACHABLE and "503" in status.detail, status
        api.discovery_status = None
        await _until(lambda: gate.pools["default"].priorities is not None, 15, "bands on once discovery answers")
    finally:
        await gate.stop()
        api.stop()


async def test_a_gate_without_rbac_serves_with_bands_off_naming_the_rbac_it_needs(tmp_path, caplog):
    api = FakeObjectivesApi(forbid=True)
    api.serve(LLMD)
    gate = _gate(write_kubeconfig(tmp_path / "kubeconfig", api.url, NS))
    await gate.start()
    try:
        assert (await _serving(gate)) and gate.pools["default"].priorities is None
        status = gate.objectives_source()
        assert status is not None and status.state is SourceState.FORBIDDEN
        for text in (status.detail, (await _status_line(gate)), *_warnings(caplog)):
            assert "403 Forbidden" in text and "inferenceobjectives.llm-d.ai" in text, text
            assert RBAC_NEEDED in text and "components/gate-objectives" in text, text
        assert "get, list and watch on inferenceobjectives in the API groups llm-d.ai and inference.networking" in RBAC_NEEDED
        assert len(_warnings(caplog)) == 1 and _source_gauge("forbidden") == 1
    finally:
        await gate.stop()
        api.stop()


async def test_an_unreachable_api_server_leaves_the_bands_off_and_the_gate_serving(tmp_path, caplog):
    api = FakeObjectivesApi()
    url = api.url
    api.stop()  # nothing listens there now
    gate = _gate(write_kubeconfig(tmp_path / "kubeconfig", url, NS))
    await gate.start()
    try:
        assert (await _serving(gate)) and gate.pools["default"].priorities is None
        status = gate.objectives_source()
        assert status is not None and status.state is SourceState.UNREACHABLE and "unreachable" in status.detail
        assert _source_gauge("unreachable") == 1
    finally:
        await gate.stop()


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\ncurrent-context: missing\n", id="no-context"),
        pytest.param("{{{ not: yaml", id="not-yaml"),
    ],
)
def test_a_kubeconfig_that_cannot_be_loaded_is_bad_input_the_gate_exits_2_naming_it(tmp_path, text):
    """The one start failure left with --objectives-from-kubernetes: a named kubeconfig the client cannot load (bad
    input, one line naming the file). The cluster's state never ends the gate (tests above)."""
    bad = tmp_path / "kubeconfig"
    bad.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMD_TIMESLICE_")}
    args = ["gate", "--ext-proc-port", "0", "--control-port", "0", "--metrics-port", "0"]
    args += ["--objectives-from-kubernetes", "--kubeconfig", str(bad)]
    r = subprocess.run([sys.executable, "-m", "llmd_timeslice.cli", *args], capture_output=True, text=True, timeout=60, env=env)
    errors = [line for line in r.stderr.splitlines() if line.startswith("llmd-timeslice: error:")]
    assert r.returncode == 2 and len(errors) == 1, (r.returncode, r.stderr[-2000:])
    assert f"no usable kubeconfig ({bad})" in errors[0] and "Traceback" not in r.stderr
