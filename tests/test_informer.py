"""The informer both Kubernetes readers use (llmd_timeslice/informer.py): list, watch from the list's
resourceVersion, list again on 410 Gone, errors judged by the reader (waited out, or retried after a growing wait),
and a stop that ends an open watch and a wait at once. Against the fake pod API server (tests/support/kube_pods.py)
through the real ``kubernetes`` client; the round loop on its own at the end."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import pytest

from llmd_timeslice.discovery.kubernetes import make_api_client
from llmd_timeslice.informer import Informer, Resource, run_rounds, stop_thread
from tests.support.kube_pods import NS, FakeKube, make_pod
from tests.support.waits import until


@pytest.fixture
def kube():
    """The fake pod API server, serving while the test runs."""
    with contextlib.ExitStack() as stack:
        fake = FakeKube()
        fake.start()
        stack.callback(fake.stop)
        yield fake


@pytest.fixture
def pods(kube):
    """The pods with a group label, as a resource to inform on (through the real client)."""
    from kubernetes import client

    with contextlib.closing(make_api_client(host=kube.url)) as api:
        yield Resource(client.CoreV1Api(api).list_namespaced_pod, (NS,), {"label_selector": "timeslice.io/group"})


class Seen:
    """What the hooks were called with."""

    def __init__(self) -> None:
        self.changes: list[bool] = []
        self.errors: list[tuple[int | None, str]] = []
        self.gone = 0


def _informer(resource: Resource | None, seen: Seen, **kw) -> Informer:
    kw.setdefault("backoff_s", 0.05)
    return Informer("test pods", resource, on_change=seen.changes.append, **kw)


def _names(inf: Informer) -> set[str]:
    return {o["metadata"]["name"] for o in inf.objects.values()}


async def test_it_lists_then_watches_from_the_lists_resource_version_and_keeps_the_objects_current(kube, pods):
    kube.add(make_pod("s0", "g0"))
    kube.add(make_pod("x", None, role=""))  # not selected
    seen = Seen()
    inf = _informer(pods, seen)
    assert await asyncio.to_thread(inf.sync) and _names(inf) == {"s0"} and seen.changes == [True]
    list_rv = inf.resource_version
    inf.start()
    try:
        kube.add(make_pod("s1", "g0"))
        kube.modify("s0", lambda p: p["metadata"]["labels"].update({"extra": "1"}))
        kube.delete("s1")
        await until(lambda: len(seen.changes) == 4, 10, "three watch events")
        assert seen.changes == [True, False, False, False] and _names(inf) == {"s0"}
        assert inf.objects["s0"]["metadata"]["labels"]["extra"] == "1"
        watch = kube.seen("GET", watch=True)[0]["query"]
        assert watch["resourceVersion"] == list_rv and watch["allowWatchBookmarks"] in ("true", "True")
        assert watch["labelSelector"] == "timeslice.io/group" and inf.relists == 1
    finally:
        t = time.monotonic()
        assert await inf.stop()
    assert time.monotonic() - t < 5, "the open watch was shut, not waited out"


async def test_410_gone_as_an_event_or_as_the_watch_answer_lists_again(kube, pods):
    kube.add(make_pod("s0", "g0"))
    seen = Seen()
    inf = _informer(pods, seen, on_gone=lambda: setattr(seen, "gone", seen.gone + 1))
    await asyncio.to_thread(inf.sync)
    inf.start()
    try:
        await until(lambda: kube.seen("GET", watch=True), 10, "the first watch")
        kube.add(make_pod("s1", "g0"), record=False)  # no event: only a list sees it
        kube.expire_history()
        await until(lambda: "s1" in _names(inf), 10, "a list after the ERROR 410 event")
        # s2 exists before the 410 is armed: whichever watch gets the 410 answer, its list sees s2
        kube.add(make_pod("s2", "g0"), record=False)
        kube.fail_next_watch = [410]
        kube.end_watches()
        await until(lambda: "s2" in _names(inf), 10, "a list after a 410 answer")
        assert inf.relists == 3 and seen.gone == 2 and seen.changes.count(True) == 3
    finally:
        await inf.stop()


async def test_an_error_the_reader_raises_is_retried_after_the_back_off_without_a_list(kube, pods):
    kube.add(make_pod("s0", "g0"))
    kube.fail_next_watch = [500, 500]
    seen = Seen()

    def failed(exc: Exception, verb: str) -> float:
        seen.errors.append((getattr(exc, "status", None), verb))
        raise RuntimeError(f"{verb} failed")

    inf = _informer(pods, seen, on_error=failed)
    await asyncio.to_thread(inf.sync)
    inf.start()
    try:
        kube.add(make_pod("s1", "g0"))
        await until(lambda: "s1" in _names(inf), 10, "the watch resumed")
        assert seen.errors == [(500, "watch"), (500, "watch")] and inf.relists == 1
    finally:
        await inf.stop()


async def test_a_pause_the_reader_asks_for_is_waited_and_stop_cuts_it_short(kube, pods):
    kube.forbid = {"list"}
    seen = Seen()

    def failed(exc: Exception, verb: str) -> float:
        seen.errors.append((getattr(exc, "status", None), verb))
        return 30.0  # a standing condition: check again later

    inf = _informer(pods, seen, on_error=failed)
    assert not await asyncio.to_thread(inf.sync), "the start's list failed: not synced"
    inf.start()
    await until(lambda: len(seen.errors) == 2, 10, "the first round's list")
    t = time.monotonic()
    assert await inf.stop()
    assert time.monotonic() - t < 15 and seen.errors == [(403, "list"), (403, "list")] and not inf.synced


async def test_before_round_pauses_until_a_resource_is_named_and_reset_lists_it_afresh(kube, pods):
    kube.add(make_pod("s0", "g0"))
    seen, rounds = Seen(), []
    chosen: list[Resource] = []
    again = threading.Event()

    def before() -> float | None:  # in the informer's thread, like every hook
        rounds.append(time.monotonic())
        if not chosen:
            return 0.05
        if inf.resource is None or again.is_set():
            again.clear()
            inf.reset(chosen[0])
            assert not inf.objects and inf.resource_version is None and not inf.synced
        return None

    inf = _informer(None, seen, before_round=before)
    assert not await asyncio.to_thread(inf.sync)
    inf.start()
    try:
        await until(lambda: len(rounds) >= 3, 10, "paused rounds")
        assert not kube.seen("GET") and not inf.synced
        chosen.append(pods)
        await until(lambda: inf.synced and _names(inf) == {"s0"}, 10, "listed once a resource is named")
        await until(lambda: kube.watches_open == 1, 10, "the round's watch open")  # else the bump below ends nothing
        again.set()
        kube.end_watches()  # the next round begins
        await until(lambda: inf.synced and inf.relists == 2, 10, "listed again after the reset")
    finally:
        await inf.stop()


# --------------------------------------------------------------------------- the round loop
def test_a_failing_round_is_retried_after_a_growing_wait_and_logged_then_stop_ends_the_loop(caplog):
    stopping = threading.Event()
    calls: list[float] = []

    def one_round() -> None:
        calls.append(time.monotonic())
        if len(calls) <= 3:
            raise RuntimeError(f"watch failed ({len(calls)})")
        if len(calls) == 6:
            stopping.set()

    with caplog.at_level(logging.WARNING):
        run_rounds(one_round, stopping, 0.02, 0.2, logging.getLogger("test.watch"))
    assert len(calls) == 6, "a round that returns is followed by the next; the loop ends once stopped"
    assert [r.getMessage().split(";")[0] for r in caplog.records] == [f"watch failed ({i})" for i in (1, 2, 3)]
    assert all("retrying in" in r.getMessage() for r in caplog.records)
    assert calls[3] - calls[2] >= 0.02, "waited before retrying"


async def test_stop_cuts_a_retry_wait_short_and_stops_the_current_watch():
    stopping = threading.Event()
    stopped_watches = []

    class Watch:
        def stop(self) -> None:
            stopped_watches.append(self)

    def one_round() -> None:
        raise RuntimeError("API server unreachable")

    thread = threading.Thread(target=run_rounds, args=(one_round, stopping, 30.0, 60.0, logging.getLogger("t")))
    thread.start()
    await asyncio.sleep(0.1)  # now in a 30 s wait
    t = time.monotonic()
    assert await stop_thread(thread, stopping, Watch)
    # Well under the 30 s wait (not a speed bound: a loaded machine takes seconds to switch threads).
    assert time.monotonic() - t < 15 and stopped_watches, "the wait ended at once; the round's watch was stopped"
