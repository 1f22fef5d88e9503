"""The list-then-watch loop both Kubernetes readers run (llmd_timeslice/watch_rounds.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from llmd_timeslice.watch_rounds import run_rounds, stop_watch_thread


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
    assert await stop_watch_thread(thread, stopping, Watch)
    # Well under the 30 s wait (not a speed bound: a loaded machine takes seconds to switch threads).
    assert time.monotonic() - t < 15 and stopped_watches, "the wait ended at once; the round's watch was stopped"
