"""Open-loop load through the router: OpenAI completions at a fixed rate, some streaming (SSE).

Each request is recorded with its outcome; a request counts as completed only when it returned
200 and, for streams, ended with ``data: [DONE]``. The gate's ``x-llmd-timeslice-hold-ms``
response header gives the time it was held, ``x-llmd-timeslice-weight-version`` the weight version
of the engine that served it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass

import httpx

from llmd_timeslice import protocol

PROMPTS = [
    "the quick brown fox",
    "once upon a time",
    "a small model on a slow machine",
    "training and sampling take turns",
    "the router holds the request",
    "hello world",
]


@dataclass
class RequestRecord:
    """One request: times in seconds since the demo's start, ``hold_ms`` from the gate."""

    kind: str  # "load", "rollout" or "eval" (the second traffic class: an InferenceObjective's requests)
    stream: bool
    sent_at: float
    done_at: float = 0.0
    status: int = 0
    hold_ms: int = 0
    weight_version: int = -1  # -1: the gate did not say
    min_weight_version: int = 0
    ok: bool = False
    error: str = ""
    text: str = ""
    reason: str = ""  # the gate's refusal reason (``x-llmd-timeslice-reason``), "" if none
    retry_after_s: float | None = None  # ``retry-after`` of a refusal, seconds

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("text")
        return d


async def sse_lines(r: httpx.Response):
    """Lines of a server-sent-events body, split on ``\n`` only. (httpx's ``aiter_lines`` follows
    ``str.splitlines`` and also splits on U+2028, U+0085 and friends, which vLLM leaves raw inside its JSON
    strings: one such completion in the soak run looked like a truncated event.)"""
    buf = b""
    async for chunk in r.aiter_bytes():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8", "replace")


def percentile(values: list[float], q: int) -> float:
    """The ``q``-th percentile (1..99, inclusive method) of ``values``; 0.0 for none."""
    import statistics

    if not values:
        return 0.0
    if len(values) == 1:
        return float(values[0])
    return float(statistics.quantiles(values, n=100, method="inclusive")[q - 1])


def _read_gate_headers(rec: RequestRecord, headers: httpx.Headers) -> None:
    rec.hold_ms = int(headers.get(protocol.HOLD_MS_HEADER, 0))
    rec.weight_version = int(headers.get(protocol.WEIGHT_VERSION_HEADER, -1))
    rec.reason = headers.get(protocol.REASON_HEADER, "")
    retry_after = headers.get("retry-after", "")
    rec.retry_after_s = float(retry_after) if retry_after.replace(".", "", 1).isdigit() else None


async def send_completion(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str,
    *,
    stream: bool,
    kind: str,
    t0: float,
    max_tokens: int = 12,
    temperature: float = 0.8,
    min_weight_version: int = 0,
    objective: str | None = None,
) -> RequestRecord:
    """Send one completion through the router and record what the client saw; with ``min_weight_version``
    the gate holds it until an engine at that weight version (or newer) serves; ``objective`` names its
    InferenceObjective (header ``x-gateway-inference-objective``: its priority band at the gate)."""
    rec = RequestRecord(kind, stream, time.monotonic() - t0, min_weight_version=min_weight_version)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": stream}
    headers = {protocol.MIN_WEIGHT_VERSION_HEADER: str(min_weight_version)} if min_weight_version else {}
    if objective:
        headers[protocol.OBJECTIVE_HEADER] = objective
    try:
        if stream:
            async with client.stream("POST", url + "/v1/completions", json=body, headers=headers or None) as r:
                rec.status = r.status_code
                _read_gate_headers(rec, r.headers)
                done = False
                async for line in sse_lines(r):
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        choices = json.loads(line[6:]).get("choices") or [{}]
                        rec.text += choices[0].get("text", "")
                rec.ok = r.status_code == 200 and done
                if r.status_code == 200 and not done:
                    rec.error = "stream ended without [DONE]"
                elif r.status_code != 200:
                    rec.error = f"HTTP {r.status_code}"
        else:
            r = await client.post(url + "/v1/completions", json=body, headers=headers or None)
            rec.status = r.status_code
            _read_gate_headers(rec, r.headers)
            rec.ok = r.status_code == 200 and bool(r.json().get("choices"))
            if rec.ok:
                rec.text = r.json()["choices"][0]["text"]
            else:
                rec.error = f"HTTP {r.status_code}: {r.text[:200]}"
    except (httpx.HTTPError, ValueError) as exc:
        rec.error = repr(exc)
    rec.done_at = time.monotonic() - t0
    return rec


class LoadGenerator:
    """Sends ``rps`` requests per second until stopped; every ``stream_every``-th one streams (0: none). Each is
    recorded as ``kind``; with ``objective`` each names that InferenceObjective (a second traffic class, e.g.
    evaluation requests in a band with a hold deadline)."""

    def __init__(
        self,
        url: str,
        model: str,
        rps: float,
        t0: float,
        stream_every: int = 3,
        kind: str = "load",
        objective: str | None = None,
        max_tokens: int = 12,
    ) -> None:
        self.url, self.model, self.rps, self.t0, self.stream_every = url, model, rps, t0, stream_every
        self.kind, self.objective, self.max_tokens = kind, objective, max_tokens
        self.records: list[RequestRecord] = []
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def run(self, client: httpx.AsyncClient) -> None:
        i = 0
        next_at = time.monotonic()
        while not self._stop.is_set():
            stream = self.stream_every > 0 and i % self.stream_every == 0
            task = asyncio.create_task(
                send_completion(
                    client,
                    self.url,
                    self.model,
                    PROMPTS[i % len(PROMPTS)],
                    stream=stream,
                    kind=self.kind,
                    t0=self.t0,
                    max_tokens=self.max_tokens,
                    objective=self.objective,
                )
            )
            self._tasks.add(task)
            task.add_done_callback(self._done)
            i += 1
            next_at += 1 / self.rps
            try:
                await asyncio.wait_for(self._stop.wait(), max(0.0, next_at - time.monotonic()))
            except TimeoutError:
                pass

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            self.records.append(task.result())

    async def stop(self, drain_timeout_s: float = 120.0) -> None:
        """Stop sending and wait for the requests still in flight (bounded)."""
        self._stop.set()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=drain_timeout_s)
