"""A Kubernetes API server of pods for tests, behind the same interface as the real one (the real ``kubernetes``
client talks to it over HTTP): ``GET /api/v1/namespaces/NS/pods`` lists (with ``labelSelector``) or, with
``watch=true``, streams newline-delimited JSON events over chunked HTTP/1.1 from ``resourceVersion`` (410 Gone
when that is older than its history); ``PATCH .../pods/NAME`` applies a label patch. 403 answers carry a
Kubernetes ``Status`` body, like the real server's. Each request is recorded with its monotonic time (``at``)."""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlparse

from tests.support.http_server import QuietHTTPServer

NS = "llm-d-timeslice"


def make_pod(
    name: str,
    group: str | None,
    role: str = "sampler",
    ip: str = "10.0.0.1",
    ready: bool = True,
    phase: str = "Running",
    annotations: dict | None = None,
    labels: dict | None = None,
    terminating: bool = False,
) -> dict:
    lab = {
        "app": "vllm-sampler",
        **({"timeslice.io/group": group} if group else {}),
        **({"timeslice.io/role": role} if role else {}),
        **(labels or {}),
    }
    meta = {"name": name, "namespace": NS, "uid": f"uid-{name}", "labels": lab, "annotations": annotations or {}}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "containers": [
                {"name": "vllm", "image": "vllm", "ports": [{"name": "http", "containerPort": 8000}]},
                {
                    "name": "timeslice-sidecar",
                    "image": "ts",
                    "ports": [{"name": "ts-grpc", "containerPort": 9001}, {"name": "ts-metrics", "containerPort": 9095}],
                },
            ]
        },
        "status": {"phase": phase, "podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def _matches(pod: dict, selector: str) -> bool:
    labels = pod["metadata"].get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, eq, value = term.partition("=")
        if eq and labels.get(key) != value:
            return False
        if not eq and key not in labels:
            return False
    return True


class FakeKube:
    """The pods of one namespace, their event history, and switches to make the API misbehave."""

    def __init__(self) -> None:
        self.pods: dict[str, dict] = {}
        self.rv = 100
        self.events: list[tuple[int, str, dict]] = []
        self.oldest_rv = 0  # a watch from an older resourceVersion gets 410 Gone
        self.forbid: set[str] = set()  # RBAC verbs refused with 403
        self.fail_next_watch: list[int] = []  # statuses for the next watch requests
        self.fail_next_patch: list[int] = []  # statuses for the next patch requests
        self.requests: list[dict] = []
        self.cond = threading.Condition()
        self.generation = 0  # bump to end every open watch stream
        self.watches_open = 0  # watch streams past their start (a generation bump ends each of them)
        self.stopping = False
        self._server: QuietHTTPServer | None = None

    # ------------------------------------------------------------ state
    def _change(self, kind: str, pod: dict, record: bool = True) -> None:
        with self.cond:
            self.rv += 1
            pod["metadata"]["resourceVersion"] = str(self.rv)
            if kind == "DELETED":
                self.pods.pop(pod["metadata"]["name"], None)
            else:
                self.pods[pod["metadata"]["name"]] = pod
            if record:
                self.events.append((self.rv, kind, copy.deepcopy(pod)))
            self.cond.notify_all()

    def add(self, pod: dict, record: bool = True) -> None:
        self._change("ADDED", pod, record)

    def modify(self, name: str, fn) -> None:
        pod = copy.deepcopy(self.pods[name])
        fn(pod)
        self._change("MODIFIED", pod)

    def delete(self, name: str) -> None:
        self._change("DELETED", copy.deepcopy(self.pods[name]))

    def expire_history(self) -> None:
        """Forget every event so far (etcd compaction) and end open watches: resuming gets 410 Gone."""
        with self.cond:
            self.oldest_rv = self.rv
            self.events.clear()
            self.generation += 1
            self.cond.notify_all()

    def end_watches(self) -> None:
        """End open watch streams (as a server-side timeout would); history kept."""
        with self.cond:
            self.generation += 1
            self.cond.notify_all()

    def seen(self, method: str, watch: bool | None = None) -> list[dict]:
        return [r for r in self.requests if r["method"] == method and (watch is None or r["watch"] == watch)]

    # ------------------------------------------------------------ server
    def start(self) -> str:
        self._server = QuietHTTPServer(("127.0.0.1", 0), self.handler_class())
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self.url

    def handler_class(self) -> type[BaseHTTPRequestHandler]:
        """The request handler of these pods (``do_GET``, ``do_PATCH``); :class:`~tests.support.kube_api.FakeKubeApi`
        serves it beside its ConfigMaps and Leases when given ``pods``."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _json(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str, message: str) -> None:
                self._json(
                    code,
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Failure",
                        "message": message,
                        "reason": reason,
                        "code": code,
                    },
                )

            def _forbidden(self, verb: str, ns: str) -> None:
                self._status(
                    403,
                    "Forbidden",
                    f'pods is forbidden: User "system:serviceaccount:{ns}:'
                    f'llmd-timeslice-orchestrator" cannot {verb} resource "pods" in API '
                    f'group "" in the namespace "{ns}"',
                )

            def do_GET(self):
                url = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", url.path)
                if not m:
                    return self._status(404, "NotFound", f"no route {url.path}")
                ns = m.group(1)
                watch = q.get("watch") in ("true", "1", "True")
                fake.requests.append(
                    {
                        "method": "GET",
                        "path": url.path,
                        "query": q,
                        "watch": watch,
                        "headers": dict(self.headers),
                        "at": time.monotonic(),
                    }
                )
                verb = "watch" if watch else "list"
                if verb in fake.forbid:
                    return self._forbidden(verb, ns)
                selector = q.get("labelSelector", "")
                if not watch:
                    with fake.cond:
                        items = [copy.deepcopy(p) for p in fake.pods.values() if _matches(p, selector)]
                        rv = fake.rv
                    return self._json(
                        200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(rv)}, "items": items}
                    )
                if fake.fail_next_watch:
                    return self._status(fake.fail_next_watch.pop(0), "InternalError", "etcd is having a bad day")
                self._stream(q, selector)

            def _chunk(self, obj: dict) -> None:
                data = (json.dumps(obj) + "\n").encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _stream(self, q: dict, selector: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                since = int(q.get("resourceVersion") or 0)
                deadline = time.monotonic() + float(q.get("timeoutSeconds") or 30)
                with fake.cond:
                    gen = fake.generation
                    if since < fake.oldest_rv:
                        self._chunk(
                            {
                                "type": "ERROR",
                                "object": {
                                    "kind": "Status",
                                    "apiVersion": "v1",
                                    "metadata": {},
                                    "status": "Failure",
                                    "message": f"too old resource version: {since} ({fake.oldest_rv})",
                                    "reason": "Expired",
                                    "code": 410,
                                },
                            }
                        )
                        self.wfile.write(b"0\r\n\r\n")
                        return
                    fake.watches_open += 1
                try:
                    while True:
                        with fake.cond:
                            todo = [(rv, k, p) for rv, k, p in fake.events if rv > since]
                            if not todo:
                                ended = fake.stopping or fake.generation != gen or time.monotonic() > deadline
                                if not ended:
                                    fake.cond.wait(0.1)
                                    continue
                        if not todo:
                            if q.get("allowWatchBookmarks") in ("true", "True"):
                                self._chunk(
                                    {
                                        "type": "BOOKMARK",
                                        "object": {
                                            "kind": "Pod",
                                            "apiVersion": "v1",
                                            "metadata": {"resourceVersion": str(since)},
                                        },
                                    }
                                )
                            self.wfile.write(b"0\r\n\r\n")
                            self.wfile.flush()
                            return
                        for rv, kind, pod in todo:
                            since = rv
                            if _matches(pod, selector):
                                self._chunk({"type": kind, "object": pod})
                except (BrokenPipeError, ConnectionResetError, OSError):
                    return
                finally:
                    with fake.cond:
                        fake.watches_open -= 1

            def do_PATCH(self):
                url = urlparse(self.path)
                m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", url.path)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fake.requests.append(
                    {
                        "method": "PATCH",
                        "path": url.path,
                        "watch": False,
                        "content_type": self.headers.get("Content-Type"),
                        "body": json.loads(body or b"{}"),
                        "at": time.monotonic(),
                    }
                )
                if not m:
                    return self._status(404, "NotFound", "no route")
                ns, name = m.groups()
                if "patch" in fake.forbid:
                    return self._forbidden("patch", ns)
                if fake.fail_next_patch:
                    return self._status(fake.fail_next_patch.pop(0), "InternalError", "etcd is having a bad day")
                if name not in fake.pods:
                    return self._status(404, "NotFound", f'pods "{name}" not found')
                patch = json.loads(body)
                fake.modify(name, lambda p: p["metadata"]["labels"].update(patch["metadata"]["labels"]))
                self._json(200, fake.pods[name])

        return Handler

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
