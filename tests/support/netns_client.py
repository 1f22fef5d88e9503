"""Clients a test runs *on* a namespace node (tests/support/netns_nodes.py): the router and the orchestrator are
reachable only from inside the nodes' network, so the test starts these as processes there and reads their JSON.

``python -m tests.support.netns_client serve ROUTER N``
    N completions one after another; prints ``{"ok": k, "answers": [...]}``.
``python -m tests.support.netns_client serve-until ROUTER N RECEIVED_FILE BEFORE TIMEOUT_S``
    ``serve ROUTER N`` again and again (every 0.1 s) until all N are answered 200 *and* the engine whose received
    prompts ``RECEIVED_FILE`` lists (one per line, written by tests/support/fake_engine_process.py) got more than
    ``BEFORE``, or ``TIMEOUT_S`` passed; prints the last round's record with ``done`` and ``rounds`` added. One
    process for a wait that a test would otherwise poll with a ``serve`` process per round.
``python -m tests.support.netns_client load ROUTER OUT STOP_FILE CONCURRENCY``
    CONCURRENCY clients, each sending completions one after another until ``STOP_FILE`` exists; every request's
    prompt is unique (``req-<client>-<n>``) and its outcome one JSON line in ``OUT``
    (``{"prompt", "status", "error", "t0", "t1"}``), so a test can match failures with what each engine received.
``python -m tests.support.netns_client trainer ORCH TOKEN_FILE GROUP ROUTER ENGINE_URL...``
    A trainer's turn: acquire the group, read every engine's ``/is_sleeping``, send one completion (held while the
    group is held), yield, wait until every engine is awake, read the held completion's answer; prints the record.
``python -m tests.support.netns_client acquire ORCH TOKEN_FILE GROUP TIMEOUT_S``
    One acquire with a deadline; prints ``{"granted", "error", "took_s"}`` (and releases if granted).

Completions name the model ``NETNS_CLIENT_MODEL`` (default ``fake``, the fake engine's); ``serve`` waits
``NETNS_CLIENT_TIMEOUT_S`` (default 10) for each.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

import httpx

COMPLETION = {"model": os.environ.get("NETNS_CLIENT_MODEL", "fake"), "prompt": "hi", "max_tokens": 2}
"""The completion every command sends (``NETNS_CLIENT_MODEL``: the served model's name; default the fake engine's)."""


def _answer(r: httpx.Response) -> dict:
    return {"status": r.status_code, "reason": r.headers.get("x-llmd-timeslice-reason"), "body": r.text[:200]}


def serve(router: str, n: int) -> dict:
    answers = []
    with httpx.Client(timeout=float(os.environ.get("NETNS_CLIENT_TIMEOUT_S", "10"))) as c:
        for _ in range(n):
            try:
                answers.append(_answer(c.post(f"{router}/v1/completions", json=COMPLETION)))
            except httpx.HTTPError as exc:
                answers.append({"status": None, "error": repr(exc)})
    return {"ok": sum(a["status"] == 200 for a in answers), "answers": answers}


def serve_until(router: str, n: int, received: Path, before: int, timeout_s: float) -> dict:
    deadline, rounds = time.monotonic() + timeout_s, 0
    while True:
        rec, rounds = serve(router, n), rounds + 1
        got = len(received.read_text().split()) if received.exists() else 0
        done = rec["ok"] == n and got > before
        if done or time.monotonic() > deadline:
            return {**rec, "done": done, "rounds": rounds, "received": got}
        time.sleep(0.1)


async def _load(router: str, out: Path, stop: Path, concurrency: int) -> None:
    lines = out.open("a", buffering=1)

    async def client(k: int) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            n = 0
            while not stop.exists():
                prompt = f"req-{k}-{n}"
                n += 1
                t0, rec = time.time(), {"prompt": prompt}
                try:
                    r = await c.post(f"{router}/v1/completions", json={**COMPLETION, "prompt": prompt})
                    rec.update(status=r.status_code, reason=r.headers.get("x-llmd-timeslice-reason"), error=None)
                except httpx.HTTPError as exc:
                    rec.update(status=None, error=repr(exc))
                rec.update(t0=t0, t1=time.time())
                lines.write(json.dumps(rec) + "\n")

    await asyncio.gather(*(client(k) for k in range(concurrency)))
    lines.close()


def _wait_held(router: str, timeout_s: float = 30) -> None:
    """Until the gate of ``router``'s stack (its metrics on the stack's default port) holds a request of the default
    pool, or ``timeout_s`` passed."""
    from urllib.parse import urlparse

    from llmd_timeslice.local.stack_file import StackPorts
    from tests.support.prometheus import sample

    metrics = f"http://{urlparse(router).hostname}:{StackPorts().gate_metrics}/metrics"
    deadline = time.monotonic() + timeout_s
    while (sample(metrics, "llmd_timeslice_gate_held", pool="default") or 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)


def trainer(orch: str, token_file: str, group: str, router: str, engines: list[str]) -> dict:
    from llmd_timeslice.client.client import TimeSliceOrchestratorClient

    rec: dict = {}
    token = Path(token_file).read_text().strip()
    held: dict = {}

    def send() -> None:
        try:
            held.update(_answer(httpx.post(f"{router}/v1/completions", json=COMPLETION, timeout=60)))
        except httpx.HTTPError as exc:
            held.update(status=None, error=repr(exc))
        held["at"] = time.monotonic()

    with (
        TimeSliceOrchestratorClient(orch, job_id="trainer", group_id=group, token=token) as client,
        httpx.Client(timeout=10) as c,
    ):
        t0 = time.monotonic()
        client.acquire(timeout_sec=60)
        rec["acquire_s"] = round(time.monotonic() - t0, 2)
        rec["asleep_while_held"] = {u: c.get(f"{u}/is_sleeping").json()["is_sleeping"] for u in engines}
        t = threading.Thread(target=send)
        t.start()
        _wait_held(router)  # the request is held at the gate meanwhile (unless answered: recorded below)
        rec["answered_while_held"] = dict(held)
        released = time.monotonic()
        client.release()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            awake = {u: not c.get(f"{u}/is_sleeping").json()["is_sleeping"] for u in engines}
            if all(awake.values()):
                break
            time.sleep(0.1)
        rec["awake_after_yield"] = awake
        t.join(60)
        rec["held_request"] = {k: v for k, v in held.items() if k != "at"}
        rec["held_answered_after_yield_s"] = round(held["at"] - released, 2) if "at" in held else None
    return rec


def acquire(orch: str, token_file: str, group: str, timeout_s: float) -> dict:
    from llmd_timeslice.client.client import TimeSliceOrchestratorClient

    token = Path(token_file).read_text().strip()
    t0 = time.monotonic()
    with TimeSliceOrchestratorClient(orch, job_id="trainer", group_id=group, token=token) as client:
        try:
            client.acquire(timeout_sec=timeout_s)
        except Exception as exc:  # the record names it
            return {"granted": False, "error": f"{type(exc).__name__}: {exc}"[:600], "took_s": round(time.monotonic() - t0, 2)}
        took = round(time.monotonic() - t0, 2)
        client.release()
    return {"granted": True, "error": None, "took_s": took}


def main(argv: list[str]) -> None:
    cmd, args = argv[0], argv[1:]
    if cmd == "serve":
        print(json.dumps(serve(args[0], int(args[1]))))
    elif cmd == "serve-until":
        print(json.dumps(serve_until(args[0], int(args[1]), Path(args[2]), int(args[3]), float(args[4]))))
    elif cmd == "load":
        asyncio.run(_load(args[0], Path(args[1]), Path(args[2]), int(args[3])))
    elif cmd == "trainer":
        print(json.dumps(trainer(args[0], args[1], args[2], args[3], args[4:])))
    elif cmd == "acquire":
        print(json.dumps(acquire(args[0], args[1], args[2], float(args[3]))))
    else:
        raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
