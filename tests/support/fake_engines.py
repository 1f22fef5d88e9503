"""Small fake inference engines over real HTTP, for what a real engine cannot show here.

* :class:`FakeVllm` speaks vLLM's sleep dialect (``/sleep``, ``/wake_up``, ``/is_sleeping``,
  ``/metrics`` with ``vllm:engine_sleep_state``, ``/collective_rpc``, ``/reset_prefix_cache``,
  ``/pause``, ``/v1/models``, ``/v1/completions``) and can *lie*: answer 200 to ``/sleep`` or
  ``/wake_up`` while its state does not change. Real vLLM never lies on purpose, so the lie needs a fake.
  It also plays the field failures a 2-core CPU cannot produce on demand: a prefix-cache reset refused
  with 200 ``{"success": false}``, several engine cores in mixed sleep states (data parallelism), an
  engine that answers nonsense after a wake, and requests parked while asleep (they wait, as in vLLM,
  until the next wake or an abort).
* :class:`FakeSglang` speaks SGLang's dialect (``POST /release_memory_occupation`` and
  ``/resume_memory_occupation`` with a JSON body ``{"tags": [...] | null}``, ``POST /generate``),
  since SGLang cannot run on this machine.

Both run a stdlib ``ThreadingHTTPServer`` in a background thread and record every call in
``calls`` as ``(method, path, query-or-body)``.
"""

from __future__ import annotations

import abc
import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlparse

from tests.support.http_server import QuietHTTPServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY on each accepted socket, as vLLM's server has it (asyncio and uvloop set it on TCP transports): the
    # headers and the body go out in two writes, and with Nagle the body waited for the delayed ACK (~40 ms a call here).
    disable_nagle_algorithm = True

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, payload, content_type: str = "application/json") -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, chunks: list[tuple[float, bytes]]) -> None:
        """SSE answer: headers first, then each chunk after its delay (seconds)."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        for delay, data in chunks:
            time.sleep(delay)
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

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
        if ctype == "text/event-stream":
            self._stream(payload)
        else:
            self._send(status, payload, ctype)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")


class _FakeEngine(abc.ABC):
    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.calls: list[tuple[str, str, object]] = []
        self.lock = threading.Lock()
        self.dead = False
        self.host = host
        self._srv = QuietHTTPServer((host, port), _Handler)
        self._srv.owner = self  # type: ignore[attr-defined]
        self._srv.daemon_threads = True
        # shutdown() returns at the serve loop's next poll (0.5 s by default, paid by every test's teardown)
        self._t = threading.Thread(target=self._srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._srv.server_address[1]}"

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
    ``export_sleep_state``: whether ``/metrics`` has ``vllm:engine_sleep_state``.

    Field failures (attributes a test may set at any time):

    * ``engines``: engine cores behind the server (``engine`` label of the metrics); ``engine_states`` overrides
      the sleep state one engine reports (engine label -> state), as a data-parallel rank that did not follow.
    * ``refuse_prefix_reset``: ``"plain"`` answers ``/reset_prefix_cache`` with 200 ``{"success": false}`` unless
      ``reset_running_requests=true`` (requests hold cache blocks: vLLM 0.32's answer); ``"always"`` refuses both.
    * ``garble_next_wake``: the next full wake leaves the engine answering nonsense (other greedy tokens) until
      its weights are reloaded (``collective_rpc reload_weights``).
    * ``park_while_asleep``: a completion that arrives while asleep, or while ``/sleep`` is being served (vLLM queues
      requests added while it pauses), waits inside, as in vLLM, until the next wake (then it is answered) or
      ``/pause?mode=abort`` (then ``finish_reason: "abort"``, counted in ``vllm:request_success_total``);
      ``abort_route``: whether ``/pause`` exists (404 otherwise, like vLLM without its RL routes);
      ``metrics_count_parked``: whether parked requests show in ``vllm:num_requests_waiting`` (vLLM shows those
      queued before its last engine step, not later arrivals).
    * ``completion_delay_s``: seconds each completion computes (counted in ``vllm:num_requests_running``
      meanwhile); ``/sleep?mode=wait`` waits for running completions, like vLLM.
    * the scheduler pause, as in vLLM 0.32 (``vllm/entrypoints/rl/online/api_router.py``, ``EngineCore`` in
      ``vllm/v1/engine/core.py``): ``POST /pause`` pauses (``paused``), ``POST /resume`` resumes, ``GET /is_paused``;
      ``/is_sleeping`` is true while paused; a full wake resumes the scheduler. ``pause_after_next_wake``: another
      client pauses the engine right after its next full wake and never resumes it; ``wake_resumes_pause`` False: a
      full wake leaves the scheduler paused (a vLLM whose wake does not resume it). Completions sent while paused
      are handled like those sent while asleep.
    * ``core_dead``: the engine core process died behind a live API server, as vLLM 0.32 answers then with
      ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1`` (measured on the CPU build, engine core SIGKILLed while asleep): every
      route that reaches the core answers 500 ``{"error": {"message": "EngineCore encountered an issue..."}}``,
      ``GET /health`` 503, ``/metrics`` keeps the last sleep state; ``die_after_next_sleep``: the next ``/sleep``
      answers 200, then the core dies. :meth:`restart` brings a live core back.
    * ``spec_tokens``: speculative decoding with that many draft tokens per step (0: off, no ``spec_decode``
      counters on ``/metrics``); ``spec_acceptance``: the fraction of draft tokens accepted; ``collapse_spec_next_wake``:
      after the next full wake every draft token is rejected (a draft model not restored: vllm#52479). The counters
      are shaped like vLLM 0.32's (``vllm/v1/spec_decode/metrics.py``: counters with ``engine`` and ``model_name``
      labels, ``_total`` samples and a ``_created`` gauge, as prometheus-client writes a counter).
    * ``reload_delay_s``: seconds each ``collective_rpc reload_weights`` takes (a large model's shards, vllm#35547);
      ``reloads`` counts them, ``max_reloads_in_flight`` the most that ran at once (vLLM would queue a second one
      behind the first in its engine core).
    * ``lora_adapters``: LoRA adapter names served besides the base model (listed by ``/v1/models`` with ``parent``,
      each with its own greedy tokens); ``garble_adapter_next_wake``: that adapter answers other tokens after the
      next full wake until the weights are reloaded (``reload_weights`` resets vLLM 0.32's LoRA state,
      ``GPUModelRunner.reload_weights``): an adapter slot whose memory a level-2 sleep discarded.
    """

    def __init__(
        self,
        lie_on_sleep: bool = False,
        lie_on_wake: bool = False,
        export_sleep_state: bool = True,
        port: int = 0,
        sleep_delay_s: float = 0.0,
        wake_delay_s: float = 0.0,
        host: str = "127.0.0.1",
    ) -> None:
        super().__init__(port, host)
        self.sleep_delay_s, self.wake_delay_s = sleep_delay_s, wake_delay_s
        self.completions_while_asleep = 0
        self.engines = 1
        self.engine_states: dict[str, str] = {}
        self.refuse_prefix_reset = "never"
        self.garble_next_wake = False
        self.garbled = False
        self.park_while_asleep = False
        self.abort_route = True
        self.metrics_count_parked = False
        self.pausing = False
        self.aborted_total = 0
        self.completion_delay_s = 0.0
        self.running = 0
        self._parked: list[dict] = []  # {"event": threading.Event, "aborted": bool}
        self.lie_on_sleep, self.lie_on_wake, self.export_sleep_state = lie_on_sleep, lie_on_wake, export_sleep_state
        self.level = 0  # 0 awake, else the sleep level
        self.paused = False
        self.lora_adapters: list[str] = []
        self.garble_adapter_next_wake = ""
        self.garbled_adapter = ""
        self.core_dead = False
        self.die_after_next_sleep = False
        self.pause_after_next_wake = False
        self.wake_resumes_pause = True
        self.asleep_tags = {"weights", "kv_cache"}
        self.weight_version = "default"  # vLLM's label before any update
        self.weights_path: str | None = None  # last reload_weights(weights_path=...)
        self.transfer_updates: list = []  # update_info of each /update_weights
        self.spec_tokens, self.spec_acceptance, self.collapse_spec_next_wake = 0, 0.7, False
        self.draft_tokens = self.accepted_tokens = 0.0
        self.reload_delay_s = 0.0
        self.reloads = self.reloads_in_flight = self.max_reloads_in_flight = 0

    def _state(self) -> str:
        return {0: "awake", 1: "weights_offloaded", 2: "discard_all"}[self.level]

    def restart(self) -> None:
        """Like the engine's process restarting on its own (a pod restart), same address: awake, with its
        initial weights and weight version label again."""
        with self.lock:
            self.level = 0
            self.paused = self.core_dead = False
            self.asleep_tags = {"weights", "kv_cache"}
            self.weight_version = "default"
            self.weights_path = None

    def _release_parked(self, aborted: bool) -> int:
        with self.lock:
            parked, self._parked = self._parked, []
        for entry in parked:
            entry["aborted"] = aborted
            entry["event"].set()
        if aborted:
            self.aborted_total += len(parked)
        return len(parked)

    @property
    def parked(self) -> int:
        """Completions waiting inside the sleeping engine now."""
        return len(self._parked)

    def _tokens(self, prompt: str, n: int, model: str = "fake") -> list[int]:
        """Greedy tokens of ``prompt``: a function of the prompt, the weights loaded, the model or adapter (and of the
        garbling)."""
        garbled = self.garbled or (model != "fake" and model == self.garbled_adapter)
        seed = f"{self.weights_path or 'initial'}|{'garbled' if garbled else 'ok'}|{model}|{prompt}"
        digest = hashlib.sha256(seed.encode()).digest()
        return [digest[i % len(digest)] * 7 % 1000 for i in range(n)]

    def _completion(self, body: dict):
        prompts = body.get("prompt", "")
        prompts = prompts if isinstance(prompts, list) else [prompts]
        n = int(body.get("max_tokens") or 1)
        if self.level != 0 or self.paused or (self.pausing and self.park_while_asleep):
            self.completions_while_asleep += 1  # a real vLLM would hang this request
            if self.park_while_asleep:
                entry = {"event": threading.Event(), "aborted": False}
                with self.lock:
                    self._parked.append(entry)
                entry["event"].wait(120)
                if entry["aborted"]:
                    return (
                        200,
                        {"choices": [{"index": i, "text": "", "finish_reason": "abort"} for i in range(len(prompts))]},
                        "application/json",
                    )
        if body.get("stream"):
            chunks = [(self.completion_delay_s, b'data: {"choices": [{"text": "x"}]}\n\n'), (0.0, b"data: [DONE]\n\n")]
            return 200, chunks, "text/event-stream"
        with self.lock:
            self.running += 1
        try:
            time.sleep(self.completion_delay_s)
        finally:
            with self.lock:
                self.running -= 1
        if self.spec_tokens:
            with self.lock:
                drafted = float(n * len(prompts) * self.spec_tokens)
                self.draft_tokens += drafted
                self.accepted_tokens += drafted * self.spec_acceptance
        model = body.get("model") if body.get("model") in self.lora_adapters else "fake"  # any other name: the base
        choices = []
        for i, p in enumerate(prompts):
            tokens = self._tokens(str(p), n, model)
            choice = {"index": i, "text": " ".join(map(str, tokens)), "finish_reason": "length"}
            if body.get("return_token_ids"):
                choice["token_ids"] = tokens
            choices.append(choice)
        return 200, {"choices": choices}, "application/json"

    def _sleep(self, query: dict):
        time.sleep(self.sleep_delay_s)
        if query.get("mode", "abort") == "wait":
            deadline = time.monotonic() + 60
            while self.running and time.monotonic() < deadline:
                time.sleep(0.01)
        if not self.lie_on_sleep:
            self.level = int(query.get("level", 1))
            self.asleep_tags = {"weights", "kv_cache"}
        return 200, {"status": "sleeping", "level": int(query.get("level", 1))}, "application/json"

    _DEAD_CORE = {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause."}}

    def handle(self, method, path, query, body):
        if self.core_dead and path not in ("/metrics", "/v1/models"):
            if path == "/health":
                return 503, "", "text/plain"
            if path == "/is_paused":
                return 500, {"error": "Failed to fetch pause status: " + self._DEAD_CORE["error"]["message"]}, "application/json"
            return 500, self._DEAD_CORE, "application/json"
        if path == "/health":
            return 200, "", "text/plain"
        if path == "/is_sleeping":
            return 200, {"is_sleeping": self.level != 0 or self.paused}, "application/json"
        if path == "/is_paused":
            return (
                (404, {"detail": "Not Found"}, "application/json")
                if not self.abort_route
                else (
                    200,
                    {"is_paused": self.paused},
                    "application/json",
                )
            )
        if path == "/resume":
            self.paused = False
            if self.level == 0:
                self._release_parked(aborted=False)
            return 200, {"status": "resumed"}, "application/json"
        if path == "/metrics":
            lines = ["# TYPE vllm:num_requests_running gauge", "# TYPE vllm:num_requests_waiting gauge"]
            for e in range(self.engines):  # the running count goes to engine 0; parked requests are not counted (vLLM
                # publishes counts only when its engine core steps, which it does not while paused)
                lines.append(f'vllm:num_requests_running{{engine="{e}"}} {float(self.running if e == 0 else 0)}')
                waiting = self.parked if e == 0 and self.metrics_count_parked else 0
                lines.append(f'vllm:num_requests_waiting{{engine="{e}"}} {float(waiting)}')
            if self.export_sleep_state:
                lines.append("# TYPE vllm:engine_sleep_state gauge")
                for e in range(self.engines):
                    state = self.engine_states.get(str(e), self._state())
                    for s in ("awake", "weights_offloaded", "discard_all"):
                        lines.append(
                            f'vllm:engine_sleep_state{{engine="{e}",model_name="fake",sleep_state="{s}"}} '
                            f"{1.0 if s == state else 0.0}"
                        )
            if self.spec_tokens:
                for name, value in (("draft_tokens", self.draft_tokens), ("accepted_tokens", self.accepted_tokens)):
                    lines += [
                        f"# HELP vllm:spec_decode_num_{name}_total Number of {name.replace('_', ' ')}.",
                        f"# TYPE vllm:spec_decode_num_{name}_total counter",
                        f'vllm:spec_decode_num_{name}_total{{engine="0",model_name="fake"}} {value}',
                        f"# TYPE vllm:spec_decode_num_{name}_created gauge",
                        f'vllm:spec_decode_num_{name}_created{{engine="0",model_name="fake"}} 1.7e9',
                    ]
            lines += [
                "# TYPE vllm:request_success counter",
                f'vllm:request_success_total{{engine="0",finished_reason="abort"}} {float(self.aborted_total)}',
            ]
            return 200, "\n".join(lines) + "\n", "text/plain"
        if path == "/sleep":
            self.pausing = True
            try:
                return self._sleep(query)
            finally:
                self.pausing = False
                if self.die_after_next_sleep:
                    self.die_after_next_sleep, self.core_dead = False, True
        if path == "/wake_up":
            time.sleep(self.wake_delay_s)
            tags = query.get("tags")
            tags = [tags] if isinstance(tags, str) else (tags or ["weights", "kv_cache"])
            if not self.lie_on_wake:
                self.asleep_tags -= set(tags)
                if not self.asleep_tags and (self.level or self.paused):
                    self.level = 0
                    if self.garble_next_wake:
                        self.garble_next_wake, self.garbled = False, True
                    if self.collapse_spec_next_wake:
                        self.collapse_spec_next_wake, self.spec_acceptance = False, 0.0
                    if self.garble_adapter_next_wake:
                        self.garbled_adapter, self.garble_adapter_next_wake = self.garble_adapter_next_wake, ""
                    if self.wake_resumes_pause:
                        self.paused = False
                        self._release_parked(aborted=False)
                    if self.pause_after_next_wake:
                        self.pause_after_next_wake, self.paused = False, True
            return 200, {"status": "awake" if self.level == 0 else "sleeping", "tags": tags}, "application/json"
        if path == "/pause":
            if not self.abort_route:
                return 404, {"detail": "Not Found"}, "application/json"
            if query.get("mode", "abort") == "abort":
                self._release_parked(aborted=True)
                time.sleep(0.02)  # like AsyncLLM.pause_generation: lets the abort outputs out first
            self.paused = True
            return 200, {"status": "paused"}, "application/json"
        if path == "/collective_rpc":
            if (body or {}).get("method") == "reload_weights":
                if "weights" in self.asleep_tags and self.level:
                    return 500, {"error": "weights are asleep"}, "application/json"
                with self.lock:
                    self.reloads += 1
                    self.reloads_in_flight += 1
                    self.max_reloads_in_flight = max(self.max_reloads_in_flight, self.reloads_in_flight)
                try:
                    time.sleep(self.reload_delay_s)
                finally:
                    with self.lock:
                        self.reloads_in_flight -= 1
                self.weights_path = ((body or {}).get("kwargs") or {}).get("weights_path", self.weights_path)
                self.garbled, self.garbled_adapter = False, ""
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
            preempt = query.get("reset_running_requests") == "true"
            refused = self.refuse_prefix_reset == "always" or (self.refuse_prefix_reset == "plain" and not preempt)
            return 200, {"success": not refused}, "application/json"
        if path == "/v1/models":
            cards = [{"id": "fake", "parent": None}] + [{"id": a, "parent": "fake"} for a in self.lora_adapters]
            return 200, {"data": cards}, "application/json"
        if path == "/v1/completions":
            return self._completion(body or {})
        return 404, {"error": path}, "application/json"


class FakeSglang(_FakeEngine):
    """SGLang's memory-occupation endpoints; ``released`` holds the released tags.
    ``fail_release``: answer 400 like SGLang does on a bad request.

    Also, as in sgl-project/sglang (``python/sglang/srt/entrypoints/http_server.py``, the scheduler's metrics
    collector): ``GET /metrics`` with ``sglang:num_running_reqs`` / ``sglang:num_queue_reqs`` (``metrics`` False:
    404, a server without ``--enable-metrics``); ``POST /pause_generation {"mode": ...}`` (``abort`` ends the
    requests inside) and ``POST /continue_generation``; ``GET /get_weight_version``; ``POST /generate`` with a list of
    texts answering a list (``output_ids``: greedy tokens, a function of the prompt and of the weights).

    Field failures: :meth:`queue` puts requests inside the engine (running, for ``for_s`` seconds); a release while
    requests are inside answers 500 like SGLang's idle assertion and is counted in ``released_while_busy``;
    ``garble_next_resume``: the next full resume leaves it answering other tokens (until :meth:`restart`).
    """

    ALL_TAGS = frozenset({"weights", "kv_cache", "cuda_graph"})

    def __init__(self, fail_release: bool = False) -> None:
        super().__init__()
        self.fail_release = fail_release
        self.released: set[str] = set()
        self.metrics = True
        self.paused = False
        self.garble_next_resume = False
        self.garbled = False
        self.released_while_busy = 0
        self.aborted = 0
        self._inside = 0
        self._busy_until = 0.0

    def queue(self, n: int, for_s: float) -> None:
        """``n`` requests inside the engine for the next ``for_s`` seconds (then they finish)."""
        self._inside, self._busy_until = n, time.monotonic() + for_s

    @property
    def inside(self) -> int:
        return self._inside if time.monotonic() < self._busy_until else 0

    def restart(self) -> None:
        self.released, self.paused, self.garbled = set(), False, False

    def _tokens(self, prompt: str, n: int) -> list[int]:
        digest = hashlib.sha256(f"{'garbled' if self.garbled else 'ok'}|{prompt}".encode()).digest()
        return [digest[i % len(digest)] * 5 % 900 for i in range(n)]

    def _generate(self, body: dict):
        if self.released:
            return 503, {"error": f"released: {sorted(self.released)}"}, "application/json"
        texts = body.get("text", "")
        n = int((body.get("sampling_params") or {}).get("max_new_tokens") or 1)
        answers = [
            {"text": "x", "output_ids": self._tokens(str(t), n), "meta_info": {"finish_reason": {"type": "length"}}}
            for t in (texts if isinstance(texts, list) else [texts])
        ]
        return 200, answers if isinstance(texts, list) else answers[0], "application/json"

    def handle(self, method, path, query, body):
        tags = set((body or {}).get("tags") or self.ALL_TAGS)
        if path == "/release_memory_occupation" and method == "POST":
            if self.fail_release:
                return 400, {"error": "memory saver is not enabled (--enable-memory-saver)"}, "application/json"
            if self.inside:
                self.released_while_busy += 1
                return 500, {"error": "release_memory_occupation should be called only when server is idle."}, "application/json"
            self.released |= tags
            return 200, "", "text/plain"
        if path == "/resume_memory_occupation" and method == "POST":
            self.released -= tags
            if not self.released and self.garble_next_resume:
                self.garble_next_resume, self.garbled = False, True
            return 200, "", "text/plain"
        if path == "/generate" and method == "POST":
            return self._generate(body or {})
        if path == "/metrics" and method == "GET":
            if not self.metrics:
                return 404, {"detail": "Not Found"}, "application/json"
            text = (
                "# TYPE sglang:num_running_reqs gauge\n"
                f'sglang:num_running_reqs{{model_name="fake"}} {float(self.inside)}\n'
                "# TYPE sglang:num_queue_reqs gauge\n"
                'sglang:num_queue_reqs{model_name="fake"} 0.0\n'
            )
            return 200, text, "text/plain"
        if path == "/pause_generation" and method == "POST":
            self.paused = True
            if (body or {}).get("mode", "abort") == "abort":
                self.aborted += self.inside
                self._inside = 0
            return 200, {"message": "Generation paused successfully.", "status": "ok"}, "application/json"
        if path == "/continue_generation" and method == "POST":
            self.paused = False
            return 200, {"message": "Generation continued successfully.", "status": "ok"}, "application/json"
        if path == "/get_weight_version" and method == "GET":
            return 200, {"weight_version": "default"}, "application/json"
        return 404, {"error": path}, "application/json"
