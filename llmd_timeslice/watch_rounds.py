"""Rounds of list-then-watch against the Kubernetes API, retried until stopped: the loop of the orchestrator's pod
discovery (llmd_timeslice/discovery/kubernetes.py) and of the gate's InferenceObjective reader
(epp_plugin/gate/objectives_k8s.py), each in a thread of its own."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential_jitter


def run_rounds(
    one_round: Callable[[], None],
    stopping: threading.Event,
    backoff_s: float,
    backoff_max_s: float,
    log: logging.Logger,
) -> None:
    """Call ``one_round`` (a list when needed, then one watch request) again and again until ``stopping`` is set.

    A round that raises is retried after a doubling, jittered wait (tenacity: ``backoff_s`` seconds first, at most
    ``backoff_max_s``), logged at WARNING with the error and the wait; setting ``stopping`` cuts the wait short and
    ends the loop. Returns once stopped; raises nothing."""

    def retrying_in(state: RetryCallState) -> None:
        wait_s = state.next_action.sleep if state.next_action is not None else 0.0
        log.warning("%s; retrying in %.1f s", state.outcome.exception() if state.outcome else "", wait_s)

    def pause(seconds: float) -> None:
        stopping.wait(seconds)  # stop() ends the wait

    retrying = Retrying(
        retry=retry_if_exception_type(Exception),
        reraise=True,
        stop=lambda state: stopping.is_set(),
        sleep=pause,
        wait=wait_exponential_jitter(multiplier=backoff_s, max=backoff_max_s, jitter=backoff_s),
        before_sleep=retrying_in,
    )
    while not stopping.is_set():
        try:
            retrying(one_round)
        except Exception:
            return  # stopped during a failing round


async def stop_watch_thread(
    thread: threading.Thread, stopping: threading.Event, current_watch: Callable[[], Any], timeout_s: float = 5.0
) -> bool:
    """Set ``stopping`` and wait up to ``timeout_s`` seconds for ``thread`` (running :func:`run_rounds`) to end.

    ``current_watch()`` returns the round's ``kubernetes.watch.Watch`` or None; its ``stop()`` shuts the socket of an
    open watch response, repeated while waiting, since the thread may be between creating the Watch and opening its
    request. Returns whether the thread ended (a daemon thread left running otherwise)."""
    stopping.set()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline:
        w = current_watch()
        if w is not None:
            w.stop()
        await asyncio.to_thread(thread.join, 0.05)
    return not thread.is_alive()
