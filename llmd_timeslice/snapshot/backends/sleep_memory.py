"""A sleep counts only when the device memory is really free: the residual an engine still holds after a sleep,
polled until it settles, checked against a budget (docs/snapshot.md, "Device memory after a sleep").

Why: an engine's 200 to its sleep call proves little. A sleep can free nothing (vLLM's own check misses the
allocator's ``expandable_segments`` set under the newer ``PYTORCH_ALLOC_CONF`` name: huggingface/trl#5794), the
memory left after each sleep can grow cycle after cycle until the trainer runs out (NVIDIA-NeMo/RL#2619: 4, 11,
25 GiB), and SGLang answers its release before the memory is freed (THUDM/slime#579). So after every sleep:

1. read the engine's memory (per process where NVML lists its pids, else the device's: :mod:`.device_memory`)
   every ``poll_s`` until ``settle_reads`` readings in a row stay within ``tolerance_bytes`` of each other and the
   last one is within budget, or ``settle_timeout_s`` passed (never one read right after the 200);
2. the budget of a sleep at level L: the absolute budget the group sets for L (``residual_budget_bytes`` of the
   group settings, sent with the command), else the residual of this engine's first verified sleep at L plus
   ``margin_bytes``; every sleep must also free at least ``min_freed_fraction`` of what the engine held before
   it (the only check of a first sleep without an absolute budget);
3. over budget when the time is up: :class:`MemoryNotFreed`, the figures in its message; the engine stays out of
   service and the trainer is not granted memory that is not free.

The readings of one sleep keep the scope of the reading before it (a process NVML no longer lists after the sleep
holds 0 bytes). Shapes: bytes (int), seconds (float).
"""

from __future__ import annotations

import asyncio
import time

from llmd_timeslice.snapshot.backends.base import BackendError, SleepResidual
from llmd_timeslice.snapshot.backends.device_memory import MemoryReading, MemorySource

GIB = 1024**3


def gib(n: float) -> str:
    """``n`` bytes as GiB with two decimals, e.g. ``'4.00 GiB'``."""
    return f"{n / GIB:.2f} GiB"


class MemoryNotFreed(BackendError):
    """The engine reports asleep but holds more device memory than its budget (``residual`` has the figures)."""

    def __init__(self, message: str, residual: SleepResidual) -> None:
        super().__init__(message)
        self.residual = residual


class SleepMemoryCheck:
    """One engine's check of the memory its sleeps leave (module doc).

    Args:
        source: reads the engine's memory (None: not checked; :func:`~.device_memory.say_unchecked_once` said so).
        min_freed_fraction: every sleep frees at least this fraction of what the engine held before it (0: off).
        margin_bytes: the default budget is the first verified residual at the level plus this.
        settle_timeout_s: most seconds to wait for the memory to settle within budget.
        poll_s: seconds between readings.
        settle_reads: readings in a row within ``tolerance_bytes`` that make a settled figure.
        tolerance_bytes: how far two readings may differ and count as the same.

    Raises:
        ValueError: a fraction outside [0, 1], a negative margin or duration, fewer than 2 settle reads.
    """

    def __init__(
        self,
        source: MemorySource | None,
        *,
        min_freed_fraction: float = 0.5,
        margin_bytes: int = GIB,
        settle_timeout_s: float = 60.0,
        poll_s: float = 0.25,
        settle_reads: int = 3,
        tolerance_bytes: int = 64 * 1024**2,
    ) -> None:
        if not 0.0 <= min_freed_fraction <= 1.0:
            raise ValueError("min_freed_fraction must be in [0, 1]")
        if margin_bytes < 0 or settle_timeout_s < 0 or poll_s < 0 or tolerance_bytes < 0:
            raise ValueError("margin_bytes, settle_timeout_s, poll_s and tolerance_bytes must be >= 0")
        if settle_reads < 2:
            raise ValueError("settle_reads must be >= 2")
        self.source = source
        self.min_freed_fraction = min_freed_fraction
        self.margin_bytes = margin_bytes
        self.settle_timeout_s = settle_timeout_s
        self.poll_s = poll_s
        self.settle_reads = settle_reads
        self.tolerance_bytes = tolerance_bytes
        self.first_residual: dict[int, int] = {}
        """Sleep level -> residual of this engine's first verified sleep at that level (bytes)."""

    async def before_sleep(self) -> MemoryReading | None:
        """The engine's memory before its sleep (None: not checked)."""
        return None if self.source is None else await asyncio.to_thread(self.source, None)

    def budget(self, level: int, group_budget: int | None) -> tuple[int | None, str]:
        """``(bytes, source)`` of the budget a sleep at ``level`` is checked against."""
        if group_budget:
            return group_budget, "group"
        if level in self.first_residual:
            return self.first_residual[level] + self.margin_bytes, "first_sleep"
        return None, "none"

    def _within(self, before: int, after: int, budget: int | None) -> bool:
        if budget is not None and after > budget:
            return False
        return not (self.min_freed_fraction > 0 and before > 0 and before - after < self.min_freed_fraction * before)

    async def after_sleep(
        self, before: MemoryReading | None, level: int, group_budget: int | None = None, who: str = "engine"
    ) -> SleepResidual | None:
        """Poll until the memory settles within budget or the time is up (module doc); returns the residual (None:
        not checked). Raises :class:`MemoryNotFreed` with the figures when over budget."""
        if before is None or self.source is None:
            return None
        budget, source = self.budget(level, group_budget)
        t0 = time.monotonic()
        window: list[int] = []
        while True:
            await asyncio.sleep(self.poll_s)
            reading = await asyncio.to_thread(self.source, before.scope)
            if reading is not None:
                window = [*window, reading.bytes][-self.settle_reads :]
            settled = len(window) == self.settle_reads and max(window) - min(window) <= self.tolerance_bytes
            waited = time.monotonic() - t0
            if window and settled and self._within(before.bytes, window[-1], budget):
                break
            if waited >= self.settle_timeout_s:
                if not window:
                    return None  # NVML stopped answering: nothing to judge (logged by the source)
                if self._within(before.bytes, window[-1], budget):
                    break  # within budget though still moving
                raise self._refusal(before, window, level, budget, source, waited, who)
        residual = SleepResidual(window[-1], before.bytes, budget, source, before.scope, level, time.monotonic() - t0)
        self.first_residual.setdefault(level, residual.bytes)
        return residual

    def _refusal(
        self, before: MemoryReading, window: list[int], level: int, budget: int | None, source: str, waited: float, who: str
    ) -> MemoryNotFreed:
        after = window[-1]
        residual = SleepResidual(after, before.bytes, budget, source, before.scope, level, waited)
        counted = "its processes' memory (NVML per process)" if before.scope == "process" else "the device's used memory"
        why = []
        if budget is not None and after > budget:
            basis = (
                "the group's residual_budget_bytes"
                if source == "group"
                else f"its first verified sleep's {gib(self.first_residual[level])} + {gib(self.margin_bytes)} margin"
            )
            why.append(f"over its budget of {gib(budget)} ({budget} bytes: {basis})")
        freed = before.bytes - after
        if self.min_freed_fraction > 0 and before.bytes > 0 and freed < self.min_freed_fraction * before.bytes:
            why.append(f"freed {gib(freed)} of {gib(before.bytes)} ({freed / before.bytes:.0%} < {self.min_freed_fraction:.0%})")
        return MemoryNotFreed(
            f"{who} reports asleep (level {level}) but still holds {gib(after)} ({after} bytes) of device memory, "
            f"{' and '.join(why)}; measured as {counted}, {len(window)} readings over {waited:.1f} s "
            f"(last: {', '.join(gib(w) for w in window)}). The sleep is not verified and the engine stays out of "
            "service: is sleep mode enabled and the allocator's expandable_segments off (PYTORCH_CUDA_ALLOC_CONF "
            "and PYTORCH_ALLOC_CONF)? Restart the engine to free what it leaked",
            residual,
        )
