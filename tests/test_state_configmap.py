"""Cluster-mode persistence: the orchestrator's state in a ConfigMap, through the real kubernetes client
against a small fake API server (GET/PUT/POST configmaps, with the API server's resourceVersion checks), a
restart that restores the holder, and two writers that conflict instead of overwriting each other."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmd_timeslice.discovery.kubernetes import make_api_client
from llmd_timeslice.orchestrator.errors import StateConflict
from llmd_timeslice.orchestrator.groups import StateNotSaved
from llmd_timeslice.orchestrator.persistence import ConfigMapStateStore
from llmd_timeslice.orchestrator.server import OrchestratorServer
from tests.test_orchestrator import LEASE_INV, RecordingActions


class FakeConfigMaps:
    """Namespaced ConfigMaps: GET, PUT (replace) and POST (create), as the API server answers them: every write
    gets a new ``metadata.resourceVersion``; a PUT carrying an older one is 409 Conflict, a POST of an existing
    name 409 AlreadyExists."""

    def __init__(self, deny: bool = False) -> None:
        self.items: dict[tuple[str, str], dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.put_versions: list[str | None] = []  # the resourceVersion each PUT carried
        self.rv = 1000
        owner = self

        def stamp(body: dict) -> dict:
            owner.rv += 1
            body.setdefault("metadata", {})["resourceVersion"] = str(owner.rv)
            return body

        def conflict(reason: str, message: str) -> dict:
            return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": 409, "message": message}

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
                    sent = (body.get("metadata") or {}).get("resourceVersion")
                    owner.put_versions.append(sent)
                    current = owner.items[(ns, name)]["metadata"]["resourceVersion"]
                    if sent and sent != current:
                        return self._reply(
                            409,
                            conflict(
                                "Conflict",
                                f"Operation cannot be fulfilled on configmaps "
                                f'"{name}": the object has been modified; please apply your '
                                "changes to the latest version and try again",
                            ),
                        )
                    owner.items[(ns, name)] = stamp(body)
                    return self._reply(200, body)
                name = body["metadata"]["name"]
                if (ns, name) in owner.items:
                    return self._reply(409, conflict("AlreadyExists", f'configmaps "{name}" already exists'))
                owner.items[(ns, name)] = stamp(body)
                return self._reply(201, body)

            def do_GET(self):
                self._handle("GET")

            def do_PUT(self):
                self._handle("PUT")

            def do_POST(self):
                self._handle("POST")

        self._srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"
        threading.Thread(target=self._srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

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
    second = OrchestratorServer(
        LEASE_INV,
        port=0,
        actions=RecordingActions(),
        state_store=ConfigMapStateStore(make_api_client(host=apiserver.url), "ml", "orch-state"),
    )
    await second.start()
    try:
        assert second.orchestrator.groups["g0"].holder == "trainer"
        await second.orchestrator.yield_("trainer", "g0", token)
    finally:
        await second.stop()


def _holder(apiserver) -> str:
    return json.loads(apiserver.items[("ml", "orch-state")]["data"]["state.json"])["groups"]["g"]["holder"]


def test_two_writers_of_one_configmap_conflict_instead_of_overwriting(apiserver):
    a = ConfigMapStateStore(make_api_client(host=apiserver.url), "ml", "orch-state")
    b = ConfigMapStateStore(make_api_client(host=apiserver.url), "ml", "orch-state")
    assert a.load() is None and b.load() is None
    a.save({"version": 1, "groups": {"g": {"holder": "a"}}})
    with pytest.raises(StateConflict, match=r"another writer.*HTTP 409"):
        b.save({"version": 1, "groups": {"g": {"holder": "b"}}})  # b would create what a created meanwhile
    assert _holder(apiserver) == "a", "nothing was overwritten"
    b.load()
    b.save({"version": 1, "groups": {"g": {"holder": "b"}}})  # b read a's write first: fine
    with pytest.raises(StateConflict, match="second orchestrator"):
        a.save({"version": 1, "groups": {"g": {"holder": "a2"}}})  # a's resourceVersion is stale now
    assert _holder(apiserver) == "b"
    assert apiserver.put_versions and all(apiserver.put_versions), "every replace carries a resourceVersion"


async def test_an_orchestrator_refuses_a_grant_when_another_wrote_its_configmap(apiserver):
    """The orchestrator's own writes check the version too: with a second writer on its ConfigMap, a grant cannot
    be saved, so it is not handed out (the acquire fails with the reason) and the other writer's state stands."""
    store = ConfigMapStateStore(make_api_client(host=apiserver.url), "ml", "orch-state")
    srv = OrchestratorServer(LEASE_INV, port=0, actions=RecordingActions(), state_store=store)
    await srv.start()
    try:
        other = ConfigMapStateStore(make_api_client(host=apiserver.url), "ml", "orch-state")
        other.load()
        other.save({"version": 1, "groups": {"g0": {"holder": "someone-else"}}})
        with pytest.raises(StateNotSaved, match="another writer"):
            await srv.orchestrator.acquire("trainer", "g0")
        assert srv.orchestrator.groups["g0"].holder is None
        saved = json.loads(apiserver.items[("ml", "orch-state")]["data"]["state.json"])
        assert saved["groups"]["g0"]["holder"] == "someone-else"
    finally:
        await srv.stop()


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
