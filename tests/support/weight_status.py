"""Waiting for a group's weight status (the orchestrator closes a switch's record just after the gate
already routes to the woken samplers, so a status read right after the gate serves may still show the
version as pending)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


async def weight_status_when(client: Any, group_id: str, pred: Callable[[Any], bool], timeout_s: float = 30.0) -> Any:
    """The ``WeightStatus`` of ``group_id`` once ``pred`` holds for it; polls every 20 ms. Fails (AssertionError,
    naming the last status seen) after ``timeout_s`` seconds: a bound on a loaded CI machine, not a speed target."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred(status := await client.weight_status(group_id)):
        assert asyncio.get_running_loop().time() < deadline, f"weight status never matched: {status}"
        await asyncio.sleep(0.02)
    return status
