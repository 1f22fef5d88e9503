"""The sampler fleet of one group: which weight version each sampler serves, which are out of service and why,
whose engine refused connections, which are being put back to sleep while the group is held, and the repair
back-off that wakes the out-of-service ones again. :func:`judge_engines` compares engine readings with it.

The group's actor (:class:`~llmd_timeslice.orchestrator.group.Group`) changes the fleet from its handlers (one task).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from llmd_timeslice.domain.group_settings import SamplerEndpoint
from llmd_timeslice.domain.switches import EngineFault, EngineReading
from llmd_timeslice.orchestrator.clock import Clock, TimerHandle

__all__ = ["SamplerFleet", "judge_engines"]


class SamplerFleet:
    """Samplers of one group by address (``ip:port``); ``clock`` arms the repair timer (monotonic seconds)."""

    def __init__(self, addresses: Iterable[str], clock: Clock) -> None:
        self._clock = clock
        self.versions: dict[str, int] = {a: 0 for a in addresses}
        """Address -> the weight version it serves (0: its initial weights)."""
        self.errors: dict[str, str] = {}
        """Out-of-service samplers -> why."""
        self.unreachable: set[str] = set()
        """Out-of-service samplers whose engine refused connections (repaired as soon as it answers again)."""
        self.returning: set[str] = set()
        """Samplers back from being down, being put to sleep while the group is held."""
        self._repair_timer: TimerHandle | None = None
        self._repair_delay: float | None = None

    @property
    def repair_armed(self) -> bool:
        """Whether the repair timer is armed."""
        return self._repair_timer is not None

    @property
    def repair_delay_s(self) -> float | None:
        """Seconds of the armed (or last) repair back-off; None after a reset."""
        return self._repair_delay

    def schedule_repair(self, first_s: float, max_s: float, tick: Callable[[], None]) -> float:
        """Arm the repair timer: ``first_s`` seconds after a reset, then doubling up to ``max_s``; ``tick`` is called
        when it fires. Returns the delay in seconds."""
        delay = first_s if self._repair_delay is None else min(self._repair_delay * 2, max_s)
        self._repair_delay = delay
        if self._repair_timer is not None:
            self._repair_timer.cancel()
        self._repair_timer = self._clock.call_at(self._clock.now() + delay, tick)
        return delay

    def cancel_repair(self, reset: bool) -> None:
        """Disarm the repair timer; ``reset``: the next back-off starts at ``first_s`` again."""
        if self._repair_timer is not None:
            self._repair_timer.cancel()
            self._repair_timer = None
        if reset:
            self._repair_delay = None


def judge_engines(
    samplers: Iterable[SamplerEndpoint], fleet: SamplerFleet, readings: dict[str, EngineReading]
) -> dict[str, tuple[EngineFault, str]]:
    """Sampler address -> (fault, why) for each serving sampler whose engine cannot be serving what ``fleet``
    records. Only samplers in service are judged; an engine without a weight version label by sleep only."""
    faults: dict[str, tuple[EngineFault, str]] = {}
    for smp in samplers:
        r = readings.get(smp.address)
        if r is None or smp.address in fleet.errors:
            continue
        want = fleet.versions.get(smp.address, 0)
        if r.unreachable:
            faults[smp.address] = (
                EngineFault.UNREACHABLE,
                f"its engine refuses connections or does not answer (down, restarting or hung): {r.unreachable}",
            )
        elif r.sleeping:
            faults[smp.address] = (EngineFault.ASLEEP, "its engine sleeps while it should serve")
        elif want > 0 and r.weight_version is not None and r.weight_version != str(want):
            faults[smp.address] = (
                EngineFault.RESTARTED,
                f"its engine reports weight version {r.weight_version!r}, not {want} (it restarted "
                "on its own and serves its initial weights)",
            )
    return faults
