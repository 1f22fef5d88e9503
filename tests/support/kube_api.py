"""A small Kubernetes API server for tests: namespaced ConfigMaps (``/api/v1``) and Leases
(``/apis/coordination.k8s.io/v1``), GET / PUT (replace) / POST (create), answering as the API server does
(k8s.io/apiserver, optimistic concurrency): every write stamps a new ``metadata.resourceVersion``; a PUT
carrying another version than the stored one is 409 Conflict, a POST of an existing name 409 AlreadyExists,
a GET or PUT of a missing object 404. The real ``kubernetes`` client talks to it over HTTP."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler

from tests.support.http_server import QuietHTTPServer
from tests.support.kube_pods import FakeKube

_KINDS = {"configmaps": ("v1", "ConfigMap"), "leases": ("coordination.k8s.io/v1", "Lease")}


def write_kubeconfig(path, url: str, namespace: str) -> str:
    """A kubeconfig file naming ``url`` (no auth) and ``namespace``, for a child process; returns its path."""
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "test", "cluster": {"server": url}}],
                "users": [{"name": "test", "user": {}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": namespace}}],
                "current-context": "test",
            }
        )
    )
    return str(path)


class FakeKubeApi:
    """ConfigMaps and Leases in memory behind an HTTP server on 127.0.0.1 (``url``).

    Args:
        deny: answer every request 403 Forbidden (RBAC tests).
        pods: also serve these pods (``/api/v1/namespaces/NS/pods``: list, watch, patch), so that one server is the
            whole API of a process that discovers pods and keeps its state and Lease there.

    ``items`` holds the ConfigMaps and ``leases`` the Leases, by ``(namespace, name)``; ``requests`` lists
    ``(method, path)``; ``put_versions`` the resourceVersion each PUT carried; ``conflicts`` counts 409 answers.
    """

    def __init__(self, deny: bool = False, pods: FakeKube | None = None) -> None:
        self.items: dict[tuple[str, str], dict] = {}
        self.leases: dict[tuple[str, str], dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.put_versions: list[str | None] = []
        self.conflicts = 0
        self.rv = 1000
        self._lock = threading.Lock()
        owner = self

        def stamp(body: dict) -> dict:
            owner.rv += 1
            body.setdefault("metadata", {})["resourceVersion"] = str(owner.rv)
            return body

        def status(code: int, reason: str, message: str = "") -> dict:
            return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code, "message": message}

        base = pods.handler_class() if pods is not None else BaseHTTPRequestHandler

        class Handler(base):
            def log_message(self, *a):
                pass

            def _pods(self) -> bool:
                return pods is not None and "/pods" in self.path.split("?")[0]

            def _reply(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self):
                # api/v1/namespaces/NS/configmaps[/NAME] or apis/coordination.k8s.io/v1/namespaces/NS/leases[/NAME]
                parts = self.path.split("?")[0].strip("/").split("/")
                at = parts.index("namespaces")
                ns, kind = parts[at + 1], parts[at + 2]
                name = parts[at + 3] if len(parts) > at + 3 else None
                store = owner.items if kind == "configmaps" else owner.leases
                return kind, store, ns, name

            def _handle(self, method):
                owner.requests.append((method, self.path))
                if deny:
                    return self._reply(403, status(403, "Forbidden"))
                kind, store, ns, name = self._route()
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                with owner._lock:
                    if method == "GET":
                        obj = store.get((ns, name))
                        missing = status(404, "NotFound", f'{kind} "{name}" not found')
                        return self._reply(200, obj) if obj else self._reply(404, missing)
                    if method == "PUT":
                        if (ns, name) not in store:
                            return self._reply(404, status(404, "NotFound", f'{kind} "{name}" not found'))
                        sent = (body.get("metadata") or {}).get("resourceVersion")
                        owner.put_versions.append(sent)
                        current = store[(ns, name)]["metadata"]["resourceVersion"]
                        if sent and sent != current:
                            owner.conflicts += 1
                            return self._reply(
                                409,
                                status(
                                    409,
                                    "Conflict",
                                    f'Operation cannot be fulfilled on {kind} "{name}": the object has been modified; '
                                    "please apply your changes to the latest version and try again",
                                ),
                            )
                        api_version, k = _KINDS[kind]
                        body.update(apiVersion=api_version, kind=k)
                        store[(ns, name)] = stamp(body)
                        return self._reply(200, body)
                    name = body["metadata"]["name"]
                    if (ns, name) in store:
                        owner.conflicts += 1
                        return self._reply(409, status(409, "AlreadyExists", f'{kind} "{name}" already exists'))
                    api_version, k = _KINDS[kind]
                    body.update(apiVersion=api_version, kind=k)
                    body["metadata"]["namespace"] = ns
                    store[(ns, name)] = stamp(body)
                    return self._reply(201, body)

            def do_GET(self):  # noqa: N802 (http.server's names)
                if self._pods():
                    return super().do_GET()
                self._handle("GET")

            def do_PUT(self):  # noqa: N802 (http.server's names)
                self._handle("PUT")

            def do_POST(self):  # noqa: N802 (http.server's names)
                self._handle("POST")

        self._srv = QuietHTTPServer(("127.0.0.1", 0), Handler)
        self._srv.daemon_threads = True  # pod watches stay open
        self._pods = pods
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"
        threading.Thread(target=self._srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def lease(self, namespace: str, name: str) -> dict:
        """The Lease's spec as stored ({} when it does not exist)."""
        with self._lock:
            return dict((self.leases.get((namespace, name)) or {}).get("spec") or {})

    def take_lease(self, namespace: str, name: str, holder: str) -> None:
        """Another client writes the Lease: ``holder`` holds it from now on (a new resourceVersion)."""
        import datetime

        with self._lock:
            obj = self.leases[(namespace, name)]
            now = datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
            obj["spec"].update(holderIdentity=holder, renewTime=now, acquireTime=now)
            obj["spec"]["leaseTransitions"] = int(obj["spec"].get("leaseTransitions") or 0) + 1
            self.rv += 1
            obj["metadata"]["resourceVersion"] = str(self.rv)

    def stop(self) -> None:
        if self._pods is not None:
            self._pods.stop()
        self._srv.shutdown()
        self._srv.server_close()
