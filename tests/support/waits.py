"""Waiting in tests for a condition the code under test reports (never a fixed sleep)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(pred: Callable[[], object], timeout_s: float = 30.0, what: str = "condition", interval_s: float = 0.02) -> None:
    """Return once ``pred()`` is true, polling every ``interval_s`` seconds. Fails (AssertionError naming ``what``)
    after ``timeout_s`` seconds: a bound for a loaded 2-core CI machine, not a speed target."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        if asyncio.get_running_loop().time() >= deadline:
            raise AssertionError(f"{what} not reached in {timeout_s:g} s")
        await asyncio.sleep(interval_s)
