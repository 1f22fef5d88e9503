"""What the official ``openai`` SDK does when the gate refuses a request, without and with the rollout helper.

Real Envoy + gate + picker; the endpoint behind them only answers ``/v1/completions`` (the refusals come from the
gate, so no engine is involved until the request is admitted). Measured here and written in docs/integrations.md:

* ``hold_expired`` (503, ``retry-after: 5``): the SDK alone retries twice, 5 s apart, then raises
  ``InternalServerError`` (3 attempts); the helper repeats it within its budget until the pool serves again. The
  test makes the gate's ``retry-after`` 1 s (the refusal's class attribute, which both edges send): the SDK and the
  helper wait whatever the gate sends, so the attempts are the same and the test runs 10 s shorter.
* ``hold_queue_full`` (429, ``retry-after: 1``): the SDK alone retries twice, 1 s apart, then raises
  ``RateLimitError``; the helper waits the ``retry-after`` and completes.
* the helper's final answer to a gate refusal carries ``x-should-retry: false``: the SDK adds no retry on top.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from epp_plugin.gate.pool_state import EndpointState
from llmd_timeslice import protocol
from llmd_timeslice.client.integrations import GateRetryPolicy, TimeSliceRollouts
from tests.support.fake_engines import FakeVllm
from tests.support.router import start_router

pytestmark = pytest.mark.envoy
# openai is imported by the tests (~0.6 s of CPU otherwise in every pytest-xdist worker's collection)


@pytest.fixture
def engine():
    e = FakeVllm().start()
    yield e
    e.stop()


def _counting_client(cls, statuses: list):
    """A plain httpx client that records each response the SDK receives (instrumentation only)."""
    if cls is httpx.Client:
        return httpx.Client(event_hooks={"response": [lambda r: statuses.append(r.status_code)]})

    async def hook(r):
        statuses.append(r.status_code)

    return httpx.AsyncClient(event_hooks={"response": [hook]})


def _engine_answer(engine: FakeVllm, prompt: str, max_tokens: int) -> str:
    """What the engine itself answers to ``prompt`` (its greedy tokens as text): the router must pass it unchanged."""
    return httpx.post(engine.url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=10).json()[
        "choices"
    ][0]["text"]


async def _serve_once_refused(pool, address: str, refused: int, version: int = 0) -> None:
    """Turn ``address`` SERVING as soon as the pool refused more than ``refused`` requests (read before the helper's
    request: its first attempt was refused, and it now waits the gate's ``retry-after``, so its next attempt finds
    the pool serving)."""
    while pool.refused_total == refused:
        await asyncio.sleep(0.02)
    pool.set_states([(address, EndpointState.SERVING, version)])


async def test_hold_expired_the_sdk_alone_gives_up_after_two_retries_the_helper_completes(artifacts, engine, monkeypatch):
    import openai

    from epp_plugin.gate.refusals import HoldExpired

    monkeypatch.setattr(HoldExpired, "retry_after_s", 1)  # the gate's 5 s: the same attempts, 10 s longer
    addr = engine.url.removeprefix("http://")
    stack = await start_router(artifacts, [addr], max_hold_s=0.1)  # each held attempt expires after 0.1 s
    try:
        stack.pool().set_states([(addr, EndpointState.ASLEEP, 0)])
        statuses: list[int] = []
        plain = openai.AsyncOpenAI(
            base_url=stack.url + "/v1", api_key="x", http_client=_counting_client(httpx.AsyncClient, statuses)
        )
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as exc:
            await plain.completions.create(model="tiny", prompt="hi", max_tokens=2)
        sdk_s = time.monotonic() - t0
        assert statuses == [503, 503, 503], "the SDK's default: 1 attempt + 2 retries"
        assert exc.value.response.headers[protocol.REASON_HEADER] == "hold_expired"
        assert exc.value.response.headers["retry-after"] == "1"
        assert sdk_s >= 2.0, "the SDK waited the gate's retry-after before each of its two retries"
        print(f"\nhold_expired, SDK alone: {len(statuses)} attempts, gave up after {sdk_s:.1f} s")

        rollouts = TimeSliceRollouts(stack.url, min_weight_version=2)
        client = rollouts.async_openai()
        flip = asyncio.create_task(_serve_once_refused(stack.pool(), addr, stack.pool().refused_total, version=2))
        with rollouts.rollout("r0") as r:
            t0 = time.monotonic()
            out = await client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        helper_s = time.monotonic() - t0
        await flip
        assert out.choices[0].text == _engine_answer(engine, "hi", 2)
        (rec,) = r.records
        assert rec.refusals == ["hold_expired"] and rec.attempts == 2 and rec.status == 200
        assert rec.min_weight_version == 2 and r.served_weight_version == 2
        assert rec.retry_wait_s == 1.0, "waited exactly the gate's retry-after"
        print(f"hold_expired, with the helper: completed after {helper_s:.1f} s, {rec.attempts} attempts")
        await plain.close()
        await client.close()
    finally:
        await stack.stop()


def test_hold_queue_full_the_sdk_alone_raises_rate_limit_the_helper_completes(artifacts, engine, loop_thread):
    import openai

    addr = engine.url.removeprefix("http://")
    stack = loop_thread.run(start_router(artifacts, [addr], max_held=1, max_hold_s=20))
    try:
        loop_thread.run(_set(stack.pool(), addr, EndpointState.ASLEEP))
        occupant = threading.Thread(
            target=lambda: httpx.post(stack.url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": "a"})
        )
        occupant.start()
        _wait(lambda: stack.pool().held == 1)
        statuses: list[int] = []
        plain = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", http_client=_counting_client(httpx.Client, statuses))
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as exc:
            plain.completions.create(model="tiny", prompt="hi", max_tokens=2)
        sdk_s = time.monotonic() - t0
        assert statuses == [429, 429, 429] and exc.value.response.headers[protocol.REASON_HEADER] == "hold_queue_full"
        print(f"\nhold_queue_full, SDK alone: {len(statuses)} attempts, gave up after {sdk_s:.1f} s")

        rollouts = TimeSliceRollouts(stack.url)
        client = rollouts.openai()
        flip = asyncio.run_coroutine_threadsafe(
            _serve_once_refused(stack.pool(), addr, stack.pool().refused_total), loop_thread.loop
        )
        t0 = time.monotonic()
        out = client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        helper_s = time.monotonic() - t0
        flip.result(10)
        occupant.join(30)
        assert out.choices[0].text == _engine_answer(engine, "hi", 2)
        (rec,) = rollouts.records
        assert rec.ok and rec.refusals[0] == "hold_queue_full" and rec.attempts >= 2
        assert rec.min_weight_version is None, "no minimum version set: no header sent"
        print(f"hold_queue_full, with the helper: completed after {helper_s:.1f} s, {rec.attempts} attempts")

        # Budget spent: the refusal reaches the caller once, and the SDK does not retry it on its own.
        loop_thread.run(_set(stack.pool(), addr, EndpointState.ASLEEP))
        occupant = threading.Thread(
            target=lambda: httpx.post(stack.url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": "a"})
        )
        occupant.start()
        _wait(lambda: stack.pool().held == 1)
        no_budget = TimeSliceRollouts(stack.url, retry=GateRetryPolicy(budget_s=0))
        with pytest.raises(openai.RateLimitError):
            no_budget.openai().completions.create(model="tiny", prompt="hi", max_tokens=2)
        (rec,) = no_budget.records
        assert rec.attempts == 1 and rec.refusals == ["hold_queue_full"], "x-should-retry: false stops the SDK"
        loop_thread.run(_set(stack.pool(), addr, EndpointState.SERVING))
        occupant.join(30)
    finally:
        loop_thread.run(stack.stop())


def test_a_refusal_that_retrying_cannot_fix_is_returned_at_once(artifacts, engine, loop_thread):
    import openai

    addr = engine.url.removeprefix("http://")
    stack = loop_thread.run(start_router(artifacts, [addr], max_hold_s=5))
    try:
        loop_thread.run(_set(stack.pool(), addr, EndpointState.SERVING))
        rollouts = TimeSliceRollouts(stack.url, min_weight_version=0)
        with pytest.raises(openai.BadRequestError):
            rollouts.openai().completions.create(
                model="tiny", prompt="hi", max_tokens=2, extra_headers={protocol.MIN_WEIGHT_VERSION_HEADER: "latest"}
            )
        (rec,) = rollouts.records
        assert rec.status == 400 and rec.refusals == ["bad_min_weight_version"] and rec.attempts == 1
        ok = rollouts.openai().completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert ok.choices[0].text == _engine_answer(engine, "hi", 2) and rollouts.records[-1].served_weight_version == 0
        assert not rollouts.below_requested() and len(rollouts.failed()) == 1
    finally:
        loop_thread.run(stack.stop())


def test_bad_helper_input_is_named():
    with pytest.raises(ValueError, match=r"min_weight_version must be an integer >= 0, got -1"):
        TimeSliceRollouts("http://127.0.0.1:1", min_weight_version=-1)
    r = TimeSliceRollouts("http://127.0.0.1:1/v1/")
    assert r.base_url == "http://127.0.0.1:1/v1"
    with pytest.raises(ValueError, match="got '3'"):
        r.min_weight_version = "3"
    with pytest.raises(ValueError, match=r"unknown gate refusal reason\(s\) \['hold_forever'\]; known: bad_min_weight"):
        GateRetryPolicy(reasons=frozenset({"hold_forever"}))
    resp = httpx.Response(503, headers={protocol.REASON_HEADER: "unknown_pool"})
    assert GateRetryPolicy().delay(resp, 0.0, 0.0) is None, "a configuration error is not retried"
    resp = httpx.Response(503, headers={protocol.REASON_HEADER: "hold_expired", "retry-after": "5"})
    assert GateRetryPolicy(budget_s=4).delay(resp, 0.0, 0.0) is None
    assert GateRetryPolicy(max_delay_s=2).delay(resp, 0.0, 0.0) == 2


async def _set(pool, address, state, version: int = 0) -> None:
    pool.set_states([(address, state, version)])


def _wait(pred, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
