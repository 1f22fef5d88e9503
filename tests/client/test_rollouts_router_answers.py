"""The rollout helper against the llm-d router's answers as they are now, and the gate's, through a real HTTP server
that answers like the router does.

The EPP's refusals are Envoy immediate responses built by llm-d-router ``pkg/common/error/error.go``
(``BuildErrResponse``, at 645ba71ef15a): the status of the error code (ResourceExhausted -> 429, ServiceUnavailable ->
503), the body ``inference error: <Code> - <message>`` (Envoy sends a local reply's body as ``text/plain``) and the
error's headers set on the answer, ``x-llm-d-request-dropped-reason: <reason>``. Which reason, with which status:
``pkg/epp/requestcontrol/admission.go`` (``translateFlowControlOutcome``) at v0.9.0 (5f4e762f341a), v0.10.0
(71f4f0999f95, #2047) and main (645ba71ef15a, #2462: filters draining every candidate).

- a TTL eviction (429 from v0.10.0, 503 on v0.9.0) and an empty pool (503 rejected-no-endpoints) are repeated with
  exponential back-off within the caller's budget, and returned as a typed refusal once the budget is spent;
- ``rejected-saturated`` (flow control's capacity limit; #2462's filters leaving no candidate) and a reason this
  client does not know are returned at once, typed, with ``x-should-retry: false``: the SDK does not repeat them;
- the gate's own 429 + ``x-llmd-timeslice-status`` keeps its meaning (the status it carries, the gate's rules).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler

import pytest

from llmd_timeslice import protocol
from llmd_timeslice.client.integrations import (
    DROPPED_REASON_HEADER,
    GateRetryPolicy,
    Refusal,
    TimeSliceRollouts,
    refusal_of,
)
from tests.support.http_server import QuietHTTPServer

COMPLETION = {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [{"index": 0, "text": "ok"}]}


def epp_refusal(status: int, code: str, message: str, reason: str) -> tuple[int, dict[str, str], bytes]:
    """An answer of the EPP's ``BuildErrResponse``: status, ``x-llm-d-request-dropped-reason``, plain-text body."""
    return status, {DROPPED_REASON_HEADER: reason, "content-type": "text/plain"}, f"inference error: {code} - {message}".encode()


TTL_EXPIRED_V010 = epp_refusal(429, "ResourceExhausted", "request timed out in queue: ttl expired", "rejected-ttl-expired")
TTL_EXPIRED_V090 = epp_refusal(503, "ServiceUnavailable", "request timed out in queue: ttl expired", "rejected-ttl-expired")
NO_ENDPOINTS = epp_refusal(
    503, "ServiceUnavailable", "request timed out in queue and no endpoints are available: ttl expired", "rejected-no-endpoints"
)
SATURATED_FILTERS = epp_refusal(
    429, "ResourceExhausted", "no candidates left after filtering the endpoints", "rejected-saturated"
)
OK = (200, {"content-type": "application/json"}, json.dumps(COMPLETION).encode())


class ScriptedRouter:
    """A real HTTP server on loopback answering each request with the next answer of ``script`` (the last repeats);
    ``requests`` counts what reached it."""

    def __init__(self, *script: tuple[int, dict[str, str], bytes]) -> None:
        self.script = list(script)
        self.requests = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                with lock:
                    owner.requests += 1
                    status, headers, body = owner.script[min(owner.requests, len(owner.script)) - 1]
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        lock = threading.Lock()
        self._srv = QuietHTTPServer(("127.0.0.1", 0), Handler)
        self._srv.daemon_threads = True
        threading.Thread(target=self._srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"

    def stop(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()


@pytest.fixture
def router_factory():
    routers: list[ScriptedRouter] = []

    def make(*script):
        routers.append(ScriptedRouter(*script))
        return routers[-1]

    yield make
    for r in routers:
        r.stop()


FAST = dict(default_delay_s=0.01, backoff_multiplier=2.0, max_delay_s=1.0)


@pytest.mark.parametrize(
    ("answer", "version"), [(TTL_EXPIRED_V010, "v0.10.0+: 429"), (TTL_EXPIRED_V090, "v0.9.0: 503"), (NO_ENDPOINTS, "empty pool")]
)
def test_a_ttl_eviction_or_an_empty_pool_is_repeated_with_back_off_until_served(router_factory, answer, version):
    router = router_factory(answer, answer, answer, OK)
    rollouts = TimeSliceRollouts(router.url, retry=GateRetryPolicy(budget_s=60, **FAST))
    with rollouts.http_client() as c:
        r = c.post(router.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200, version
    rec = rollouts.records[-1]
    reason = answer[1][DROPPED_REASON_HEADER]
    assert (rec.attempts, rec.refusals, rec.refusal) == (4, [reason] * 3, None), version
    assert rec.retry_wait_s == pytest.approx(0.01 + 0.02 + 0.04), "exponential back-off: 0.01, 0.02, 0.04 s"
    assert router.requests == 4


async def test_a_ttl_eviction_past_the_callers_budget_is_returned_typed_and_the_sdk_does_not_repeat_it(router_factory):
    import openai

    router = router_factory(TTL_EXPIRED_V010)
    # Waits of 0.1 and 0.2 s fit a 0.6 s budget with 0.3 s to spare for the three requests themselves (under load each
    # took more than the 10 ms a 0.05 s budget left them); the next wait, 0.4 s, cannot fit (0.3 + 0.4 > 0.6).
    policy = GateRetryPolicy(budget_s=0.6, default_delay_s=0.1, backoff_multiplier=2.0, max_delay_s=1.0)
    rollouts = TimeSliceRollouts(router.url, retry=policy, max_retries=2)
    client = rollouts.async_openai()
    with pytest.raises(openai.RateLimitError) as err:
        await client.completions.create(model="m", prompt="x", max_tokens=1)
    await client.close()
    refusal = refusal_of(err.value.response)
    assert refusal is not None and (refusal.source, refusal.reason, refusal.status) == ("router", "rejected-ttl-expired", 429)
    rec = rollouts.records[-1]
    assert rec.refusal == Refusal(
        "router", "rejected-ttl-expired", 429, "inference error: ResourceExhausted - request timed out in queue: ttl expired"
    )
    # Within 0.6 s: waits of 0.1 and 0.2 fit, the next 0.4 does not: 3 attempts, then one SDK call only.
    assert rec.attempts == 3 and router.requests == 3, (rec.attempts, router.requests)


@pytest.mark.parametrize(
    "answer",
    [
        SATURATED_FILTERS,
        epp_refusal(429, "ResourceExhausted", "band full", "rejected-saturated"),
        epp_refusal(503, "ServiceUnavailable", "a reason from a newer EPP", "rejected-by-something-new"),
    ],
)
def test_a_saturated_or_unknown_router_refusal_is_returned_at_once_typed_never_repeated(router_factory, answer):
    import openai

    router = router_factory(answer, OK)
    rollouts = TimeSliceRollouts(router.url, retry=GateRetryPolicy(budget_s=60, **FAST), max_retries=2)
    client = rollouts.openai()
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="m", prompt="x", max_tokens=1)
    client.close()
    assert err.value.status_code == answer[0]
    assert err.value.response.headers["x-should-retry"] == "false"
    assert router.requests == 1, "neither the helper nor the SDK repeated it"
    rec = rollouts.records[-1]
    assert rec.refusal is not None and rec.refusal.source == "router"
    assert rec.refusal.reason == answer[1][DROPPED_REASON_HEADER] and rec.refusal.message == answer[2].decode()
    assert rollouts.failed() == [rec]


def test_the_gates_own_429_with_its_status_header_keeps_its_meaning(router_factory):
    """Without Envoy's local-reply mapping a gate 5xx arrives as 429 + x-llmd-timeslice-status: the reason and the
    carried status are the gate's; the gate's header wins over an EPP header on the same answer."""
    gate_503_as_429 = (
        429,
        {
            protocol.REASON_HEADER: "hold_expired",
            protocol.STATUS_HEADER: "503",
            "retry-after": "0",
            DROPPED_REASON_HEADER: "rejected-saturated",
            "content-type": "application/json",
        },
        b'{"error": {"type": "hold_expired", "message": "held 600 s"}}',
    )
    router = router_factory(gate_503_as_429, OK)
    rollouts = TimeSliceRollouts(router.url, retry=GateRetryPolicy(budget_s=60, **FAST))
    with rollouts.http_client() as c:
        assert c.post(router.url + "/v1/completions", json={"prompt": "x"}).status_code == 200
    assert rollouts.records[-1].refusals == ["hold_expired"], "retried by the gate's rule, not refused as saturated"
    queue_full = (
        429,
        {protocol.REASON_HEADER: "unknown_pool", protocol.STATUS_HEADER: "503", "content-type": "application/json"},
        b"{}",
    )
    router = router_factory(queue_full, OK)
    rollouts = TimeSliceRollouts(router.url, retry=GateRetryPolicy(budget_s=60, **FAST))
    with rollouts.http_client() as c:
        r = c.post(router.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 429 and r.headers["x-should-retry"] == "false"
    assert rollouts.records[-1].refusal == Refusal("gate", "unknown_pool", 503, "{}")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (
            {"router_reasons": frozenset({"rejected-ttl-expired", "rejected-typo"})},
            "unknown router refusal reason(s) ['rejected-typo']",
        ),
        ({"backoff_multiplier": 0.5}, "backoff_multiplier must be >= 1, got 0.5"),
    ],
)
def test_bad_router_retry_settings_are_refused_naming_them(kwargs, needle):
    with pytest.raises(ValueError) as err:
        GateRetryPolicy(**kwargs)
    assert needle in str(err.value)


def test_the_rl_loop_example_rides_out_a_ttl_eviction_and_reports_a_saturated_refusal(router_factory):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"
    spec = importlib.util.spec_from_file_location("example_rl_loop", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # prompt 1: evicted by the queue TTL, then served; prompt 2: shed (saturated); prompts 3 and 4: served.
    router = router_factory(TTL_EXPIRED_V010, OK, SATURATED_FILTERS, OK)
    recs = mod.rollout(router.url, "m", 0)
    assert [r["status"] for r in recs] == [200, 429, 200, 200]
    assert recs[1]["refusal"] == (
        "router refused with 429 rejected-saturated: inference error: ResourceExhausted - "
        "no candidates left after filtering the endpoints"
    )
    assert [r["refusal"] for r in recs if r is not recs[1]] == [None, None, None]
    assert router.requests == 5
