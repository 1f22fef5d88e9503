"""The event loop the sync faces run their asyncio core on: one daemon thread per process.

:func:`run` hands a coroutine to that loop and blocks the calling thread until it finishes, returning its
result or raising its exception (the same role as anyio's ``BlockingPortal.call``; a daemon thread of our own
so that a client nobody closed never keeps the interpreter from exiting, and one loop for every sync client in
the process instead of a thread each). A forked child starts its own loop on first use. See
``docs/decisions/one-client-core.md``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_pid = 0


def loop() -> asyncio.AbstractEventLoop:
    """The process's core loop, started on first use (again in a forked child)."""
    global _loop, _pid
    with _lock:
        if _loop is None or _pid != os.getpid():
            new = asyncio.new_event_loop()
            threading.Thread(target=new.run_forever, name="llmd-timeslice-client-loop", daemon=True).start()
            _loop, _pid = new, os.getpid()
        return _loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the core loop and wait for it; raises what it raises. Called from the loop's own thread
    (a callback of the core) it would deadlock, so that raises RuntimeError. An interrupt of the waiting thread
    (KeyboardInterrupt) cancels the coroutine."""
    target = loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is target:
        coro.close()
        raise RuntimeError("a sync client call from the client's own event loop thread (e.g. inside a callback)")
    future = asyncio.run_coroutine_threadsafe(coro, target)
    try:
        return future.result()
    except concurrent.futures.CancelledError:
        raise asyncio.CancelledError() from None
    except BaseException:
        future.cancel()
        raise
