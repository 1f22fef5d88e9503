"""Small fake inference engines over real HTTP, for what a real engine cannot show here.

* :class:`FakeVllm` speaks vLLM's sleep dialect (``/sleep``, ``/wake_up``, ``/is_sleeping``,
  ``/metrics`` with ``vllm:engine_sleep_state``, ``/collective_rpc``, ``/reset_prefix_cache``,
  ``/v1/models``, ``/v1/completions``) and can *lie*: answer 200 to ``/sleep`` or ``/wake_up``
  while its state does not change. Real vLLM never lies on purpose, so the lie needs a fake.
* :class:`FakeSglang` speaks SGLang's dialect (``POST /release_memory_occupation`` and
  ``/resume_memory_occupation`` with a JSON body ``{"tags": [...] | null}``, ``POST /generate``),
  since SGLang cannot run on this machine.

Both run a stdlib ``ThreadingHTTPServer`` in a background thread and record every call in
``calls`` as ``(method, path, query-or-body)``.
"""

from __future__ import annotations

import abc
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, payload, content_type: str = "application/json") -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _dispatch(self, method: str) -> None:
        n = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(n) if n else b""
        url = urlparse(self.path)
        query = {k: v if len(v) > 1 else v[0] for k, v in parse_qs(url.query).items()}
        body = json.loads(raw) if raw else None
        engine: _FakeEngine = self.server.owner  # type: ignore[attr-defined]
        if engine.dead:  # killed: kept-alive connections get nothing more, like a dead process's sockets
            self.close_connection = True
            return
        with engine.lock:
            engine.calls.append((method, url.path, body if body is not None else query))
        status, payload, ctype = engine.handle(method, url.path, query, body)
        self._send(status, payload, ctype)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")


class _FakeEngine(abc.ABC):
    def __init__(self, port: int = 0) -> None:
        self.calls: list[tuple[str, str, object]] = []
        self.lock = threading.Lock()
        self.dead = False
        self._srv = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
        self._srv.owner = self  # type: ignore[attr-defined]
        self._srv.daemon_threads = True
        self._t = threading.Thread(target=self._srv.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._srv.server_address[1]}"

    def start(self):
        self._t.start()
        return self

    def stop(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()

    def kill(self) -> None:
        """Like a killed process: stop listening and answer nothing more on open connections."""
        self.dead = True
        self.stop()

    def paths(self, method: str = "POST") -> list[str]:
        return [p for m, p, _ in self.calls if m == method]

    @abc.abstractmethod
    def handle(self, method: str, path: str, query: dict, body) -> tuple[int, object, str]:
        """Answer one request: ``(status, JSON body or text, content type)``."""


class FakeVllm(_FakeEngine):
    """vLLM's sleep endpoints. ``lie_on_sleep`` / ``lie_on_wake``: answer 200 but keep the state;
    ``export_sleep_state``: whether ``/metrics`` has ``vllm:engine_sleep_state``."""

    def __init__(self, lie_on_sleep: bool = False, lie_on_wake: bool = False, export_sleep_state: bool = True,
                 port: int = 0, sleep_delay_s: float = 0.0, wake_delay_s: float = 0.0) -> None:
        super().__init__(port)
        self.sleep_delay_s, self.wake_delay_s = sleep_delay_s, wake_delay_s
        self.completions_while_asleep = 0
        self.lie_on_sleep, self.lie_on_wake, self.export_sleep_state = lie_on_sleep, lie_on_wake, export_sleep_state
        self.level = 0  # 0 awake, else the sleep level
        self.asleep_tags = {"weights", "kv_cache"}
        self.weight_version = "default"  # vLLM's label before any update
        self.weights_path: str | None = None  # last reload_weights(weights_path=...)
        self.transfer_updates: list = []  # update_info of each /update_weights

    def _state(self) -> str:
        return {0: "awake", 1: "weights_offloaded", 2: "discard_all"}[self.level]

    def restart(self) -> None:
        """Like the engine's process restarting on its own (a pod restart), same address: awake, with its
        initial weights and weight version label again."""
        with self.lock:
            self.level = 0
            self.asleep_tags = {"weights", "kv_cache"}
            self.weight_version = "default"
            self.weights_path = None

    def handle(self, method, path, query, body):
        if path == "/is_sleeping":
            return 200, {"is_sleeping": self.level != 0}, "application/json"
        if path == "/metrics":
            lines = ["# TYPE vllm:num_requests_running gauge", 'vllm:num_requests_running{engine="0"} 0.0',
                     "# TYPE vllm:num_requests_waiting gauge", 'vllm:num_requests_waiting{engine="0"} 0.0']
            if self.export_sleep_state:
                lines.append("# TYPE vllm:engine_sleep_state gauge")
                for s in ("awake", "weights_offloaded", "discard_all"):
                    lines.append(f'vllm:engine_sleep_state{{engine="0",sleep_state="{s}"}} '
                                 f'{1.0 if s == self._state() else 0.0}')
            return 200, "\n".join(lines) + "\n", "text/plain"
        if path == "/sleep":
            time.sleep(self.sleep_delay_s)
            if not self.lie_on_sleep:
                self.level = int(query.get("level", 1))
                self.asleep_tags = {"weights", "kv_cache"}
            return 200, {"status": "sleeping", "level": int(query.get("level", 1))}, "application/json"
        if path == "/wake_up":
            time.sleep(self.wake_delay_s)
            tags = query.get("tags")
            tags = [tags] if isinstance(tags, str) else (tags or ["weights", "kv_cache"])
            if not self.lie_on_wake:
                self.asleep_tags -= set(tags)
                if not self.asleep_tags:
                    self.level = 0
            return 200, {"status": "awake" if self.level == 0 else "sleeping", "tags": tags}, "application/json"
        if path == "/collective_rpc":
            if (body or {}).get("method") == "reload_weights":
                if "weights" in self.asleep_tags and self.level:
                    return 500, {"error": "weights are asleep"}, "application/json"
                self.weights_path = ((body or {}).get("kwargs") or {}).get("weights_path", self.weights_path)
            return 200, {"results": [None]}, "application/json"
        if path == "/update_weight_version":
            self.weight_version = body["new_version"]
            return 200, {"success": True, "new_version": body["new_version"]}, "application/json"
        if path == "/weight_info":
            return 200, {"weight_version": self.weight_version}, "application/json"
        if path in ("/init_weight_transfer_engine", "/start_weight_update"):
            return 200, {"message": "ok"}, "application/json"
        if path == "/update_weights":
            self.transfer_updates.append(body["update_info"])
            return 200, {"message": "Weights updated"}, "application/json"
        if path == "/finish_weight_update":
            self.weight_version = body.get("weight_version") or self.weight_version
            return 200, {"message": "Weight update finished"}, "application/json"
        if path == "/reset_prefix_cache":
            return 200, {"success": True}, "application/json"
        if path == "/v1/models":
            return 200, {"data": [{"id": "fake"}]}, "application/json"
        if path == "/v1/completions":
            if self.level != 0:
                self.completions_while_asleep += 1  # a real vLLM would hang this request
            return 200, {"choices": [{"text": "x", "finish_reason": "length"}]}, "application/json"
        return 404, {"error": path}, "application/json"


class FakeSglang(_FakeEngine):
    """SGLang's memory-occupation endpoints; ``released`` holds the released tags.
    ``fail_release``: answer 400 like SGLang does on a bad request."""

    ALL_TAGS = frozenset({"weights", "kv_cache", "cuda_graph"})

    def __init__(self, fail_release: bool = False) -> None:
        super().__init__()
        self.fail_release = fail_release
        self.released: set[str] = set()

    def handle(self, method, path, query, body):
        tags = set((body or {}).get("tags") or self.ALL_TAGS)
        if path == "/release_memory_occupation" and method == "POST":
            if self.fail_release:
                return 400, {"error": "memory saver is not enabled (--enable-memory-saver)"}, "application/json"
            self.released |= tags
            return 200, "", "text/plain"
        if path == "/resume_memory_occupation" and method == "POST":
            self.released -= tags
            return 200, "", "text/plain"
        if path == "/generate" and method == "POST":
            if self.released:
                return 503, {"error": f"released: {sorted(self.released)}"}, "application/json"
            return 200, {"text": "x", "meta_info": {"finish_reason": {"type": "length"}}}, "application/json"
        return 404, {"error": path}, "application/json"
