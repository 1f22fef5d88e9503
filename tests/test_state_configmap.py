"""Cluster-mode persistence: the orchestrator's state in a ConfigMap, through the real kubernetes client
against a small fake API server (GET/PUT/POST configmaps), and a restart that restores the holder."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmd_timeslice.discovery.kubernetes import make_api_client
from llmd_timeslice.orchestrator.persistence import ConfigMapStateStore
from llmd_timeslice.orchestrator.server import OrchestratorServer
from tests.test_orchestrator import LEASE_INV, RecordingActions


class FakeConfigMaps:
    """Namespaced ConfigMaps: GET, PUT (replace) and POST (create), as the API server answers them."""

    def __init__(self, deny: bool = False) -> None:
        self.items: dict[tuple[str, str], dict] = {}
        self.requests: list[tuple[str, str]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _key(self):
                parts = self.path.split("?")[0].strip("/").split("/")  # api v1 namespaces NS configmaps [NAME]
                return parts[3], (parts[5] if len(parts) > 5 else None)

            def _handle(self, method):
                owner.requests.append((method, self.path))
                if deny:
                    return self._reply(403, {"kind": "Status", "code": 403, "reason": "Forbidden"})
                ns, name = self._key()
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                if method == "GET":
                    obj = owner.items.get((ns, name))
                    return self._reply(200, obj) if obj else self._reply(404, {"kind": "Status", "code": 404})
                if method == "PUT":
                    if (ns, name) not in owner.items:
                        return self._reply(404, {"kind": "Status", "code": 404})
                    owner.items[(ns, name)] = body
                    return self._reply(200, body)
                name = body["metadata"]["name"]
                owner.items[(ns, name)] = body
                return self._reply(201, body)

            def do_GET(self):
                self._handle("GET")

            def do_PUT(self):
                self._handle("PUT")

            def do_POST(self):
                self._handle("POST")

        self._srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"
        threading.Thread(target=self._srv.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()


@pytest.fixture
def apiserver():
    s = FakeConfigMaps()
    yield s
    s.stop()


async def test_state_survives_a_restart_in_a_configmap(apiserver):
    store = ConfigMapStateStore(make_api_client(host=apiserver.url), "ml", "orch-state")
    assert store.load() is None
    first = OrchestratorServer(LEASE_INV, port=0, actions=RecordingActions(), state_store=store)
    await first.start()
    await first.orchestrator.acquire("trainer", "g0")
    token = first.orchestrator.lease("trainer", "g0").token
    await first.stop()
    assert ("POST", "/api/v1/namespaces/ml/configmaps") in apiserver.requests, "created on first save"
    saved = json.loads(apiserver.items[("ml", "orch-state")]["data"]["state.json"])
    assert saved["groups"]["g0"]["holder"] == "trainer"
    second = OrchestratorServer(LEASE_INV, port=0, actions=RecordingActions(),
                                state_store=ConfigMapStateStore(make_api_client(host=apiserver.url), "ml", "orch-state"))
    await second.start()
    try:
        assert second.orchestrator.groups["g0"].holder == "trainer"
        await second.orchestrator.yield_("trainer", "g0", token)
    finally:
        await second.stop()


def test_forbidden_configmap_says_which_rbac_verb():
    s = FakeConfigMaps(deny=True)
    try:
        store = ConfigMapStateStore(make_api_client(host=s.url), "ml", "orch-state")
        with pytest.raises(RuntimeError, match="needs `get` on configmaps"):
            store.load()
        with pytest.raises(RuntimeError, match="update"):
            store.save({"version": 1, "groups": {}})
    finally:
        s.stop()
