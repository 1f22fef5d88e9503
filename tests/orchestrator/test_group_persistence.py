"""The group state machine's persistence: awaited per transition, coalesced, off the event loop, before a grant is
returned."""

from __future__ import annotations

import asyncio
import threading
import time

from llmd_timeslice.orchestrator.persistence import StatePersister
from tests.orchestrator.group_machine_support import (
    Env,
)


# -------------------------------------------------------------------------------------------- persistence
class SlowStore:
    """A store whose save takes ``delay_s`` and records where it ran."""

    def __init__(self, delay_s: float = 0.05) -> None:
        self.delay_s = delay_s
        self.states: list[dict] = []
        self.threads: set[int] = set()

    def load(self):
        return None

    def save(self, state: dict) -> None:
        self.threads.add(threading.get_ident())
        time.sleep(self.delay_s)
        self.states.append(state)


async def test_state_is_saved_off_the_event_loop_coalesced_and_before_a_grant_is_returned():
    store = SlowStore()
    e = Env()
    e.orch.persister = StatePersister(store, e.orch.snapshot)
    try:
        beats = 0

        async def ticker() -> None:  # the loop stays responsive while the store sleeps
            nonlocal beats
            while True:
                beats += 1
                await asyncio.sleep(0.005)

        tick = e.task(ticker())
        await e.orch.acquire("A", "t")
        saved = store.states[-1]["groups"]["t"]
        assert saved["holder"] == "A" and saved["phase"] == "held", "the grant was saved before it was returned"
        assert threading.get_ident() not in store.threads and beats >= 5
        # Twenty jobs queue and take the group in turn: far fewer writes than transitions.
        jobs = [e.task(e.orch.acquire(f"j{i}", "t")) for i in range(20)]
        await e.g("t").wait_until(lambda g: len(g.waiters) == 20, 5)
        writes_before = len(store.states)
        await e.orch.yield_("A", "t")
        for i in range(20):
            await jobs[i]
            await e.orch.yield_(f"j{i}", "t")
        await e.orch.persister.close()
        assert store.states[-1]["groups"]["t"]["phase"] == "deferred"
        assert len(store.states) - writes_before < 40, len(store.states) - writes_before
        tick.cancel()
    finally:
        await e.close()
