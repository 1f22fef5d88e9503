"""The gate reads its pools' InferenceObjectives from the Kubernetes API (``--objectives-from-kubernetes``), through
the real ``kubernetes`` client's HTTP layer.

The API server is a small fake (stdlib ``http.server`` in a thread) behind the real one's interface for this
resource: ``GET /apis/inference.networking.x-k8s.io/v1alpha2/namespaces/NS/inferenceobjectives`` lists, or with
``watch=true`` streams newline-delimited JSON events over chunked HTTP/1.1 from ``resourceVersion``; 403 answers
carry a Kubernetes ``Status`` body, like the real server's.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from epp_plugin.gate.objectives_k8s import ObjectivesApiError
from epp_plugin.gate.pool_state import UnknownObjective
from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice.domain.objectives import Objectives
from tests.support.kube_api import write_kubeconfig
from tests.support.waits import until as _until

NS = "llm-d"
PATH = re.compile(r"/apis/inference\.networking\.x-k8s\.io/v1alpha2/namespaces/([^/]+)/inferenceobjectives")


def objective(name: str, priority: int | None, pool: str = "default", group: str | None = None) -> dict:
    spec: dict = {"poolRef": {"name": pool, **({"group": group} if group else {})}}
    if priority is not None:
        spec["priority"] = priority
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


class FakeObjectivesApi:
    """The InferenceObjectives of one namespace and their event history, served over HTTP."""

    def __init__(self, forbid: bool = False) -> None:
        self.objects: dict[str, dict] = {}
        self.events: list[tuple[int, str, dict]] = []
        self.rv = 500
        self.forbid = forbid
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
                m = PATH.fullmatch(url.path)
                watch = q.get("watch") in ("true", "1", "True")
                fake.requests.append((url.path, watch))
                if not m:
                    return self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound", "message": "no route"})
                if fake.forbid:
                    return self._json(
                        403,
                        {
                            "kind": "Status",
                            "apiVersion": "v1",
                            "status": "Failure",
                            "reason": "Forbidden",
                            "code": 403,
                            "message": f'inferenceobjectives.inference.networking.x-k8s.io is forbidden: User "system:'
                            f'serviceaccount:{NS}:llmd-timeslice-gate" cannot list resource "inferenceobjectives"',
                        },
                    )
                if not watch:
                    with fake.cond:
                        items = [copy.deepcopy(o) for o in fake.objects.values()]
                        rv = fake.rv
                    return self._json(
                        200, {"kind": "InferenceObjectiveList", "metadata": {"resourceVersion": str(rv)}, "items": items}
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
                            todo = [(rv, k, o) for rv, k, o in fake.events if rv > since]
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

    def change(self, kind: str, obj: dict) -> None:
        with self.cond:
            self.rv += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            if kind == "DELETED":
                self.objects.pop(obj["metadata"]["name"], None)
            else:
                self.objects[obj["metadata"]["name"]] = obj
            self.events.append((self.rv, kind, obj))
            self.cond.notify_all()

    def stop(self) -> None:
        self.stopping = True
        with self.cond:
            self.cond.notify_all()
        self._srv.shutdown()
        self._srv.server_close()


BANDS = Objectives.model_validate({"priority_bands": [{"priority": 10, "max_hold_s": 30, "hold_deadline_s": 5}]})


def _gate(kubeconfig: str, **kw) -> GateServer:
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


async def test_the_gate_lists_then_watches_the_inference_objectives_of_its_pools(tmp_path):
    api = FakeObjectivesApi()
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
        assert any(w for _, w in api.requests) and not any(w for _, w in api.requests[:1]), "a list, then a watch"
    finally:
        await gate.stop()
        api.stop()


async def test_a_gate_without_rbac_for_inference_objectives_says_what_it_needs(tmp_path):
    api = FakeObjectivesApi(forbid=True)
    gate = _gate(write_kubeconfig(tmp_path / "kubeconfig", api.url, NS))
    try:
        with pytest.raises(ObjectivesApiError) as exc:
            await gate.start()
        msg = str(exc.value)
        assert "403 Forbidden" in msg and "inferenceobjectives.inference.networking.x-k8s.io" in msg
        assert "get, list and watch" in msg and "components/gate-objectives" in msg
    finally:
        await gate.stop()
        api.stop()
