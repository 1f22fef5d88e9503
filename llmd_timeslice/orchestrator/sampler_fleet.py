"""The sampler fleet of one group: which weight version each sampler serves, which are out of service and why,
whose engine refused connections, which are being put back to sleep while the group is held, and the repair
back-off that wakes the out-of-service ones again. :func:`judge_engines` compares engine readings with it.

The group's actor (:class:`~llmd_timeslice.orchestrator.group.Group`) changes the fleet from its handlers (one task).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

from llmd_timeslice.domain.group_settings import SamplerEndpoint
from llmd_timeslice.domain.switches import EngineFault, EngineReading, SwitchRecord
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
    def serving_version(self) -> int:
        """Highest weight version any in-service sampler serves (0: the initial weights)."""
        return max((v for a, v in self.versions.items() if a not in self.errors), default=0)

    # ------------------------------------------------------------------ membership
    def add(self, address: str) -> None:
        """A sampler joins (discovery): it serves its initial weights until a wake loads the group's version."""
        self.versions[address] = 0

    def remove(self, address: str) -> None:
        """A sampler leaves (discovery): forgotten."""
        self.versions.pop(address, None)
        self.errors.pop(address, None)
        self.unreachable.discard(address)

    # ------------------------------------------------------------------ outcomes
    def take_wake(self, rec: SwitchRecord, known: Collection[str]) -> None:
        """The outcome of a wake of samplers at ``known`` addresses (others left the group meanwhile): the versions
        they loaded; one woken without an error is back in service, one with an error is out of service (why)."""
        for address, version in rec.sampler_versions.items():
            if address in known:
                self.versions[address] = version
                if address not in rec.sampler_errors:
                    self.errors.pop(address, None)
                    self.unreachable.discard(address)
        self.errors.update({a: e for a, e in rec.sampler_errors.items() if a in known})

    def down_at_sleep(self, unreachable: Mapping[str, str]) -> bool:
        """Samplers whose engine was down at a sleep (address -> why): out of service (they hold no accelerator
        memory) until they answer again, then put to sleep. Returns whether there were any."""
        for addr, why in unreachable.items():
            self.errors[addr] = f"its engine was down at the sleep ({why}); out of service, put to sleep when it answers again"
            self.unreachable.add(addr)
        return bool(unreachable)

    def take_faults(self, faults: Mapping[str, tuple[EngineFault, str]]) -> None:
        """Engines the audit judged (:func:`judge_engines`) go out of service; a restarted one serves its initial
        weights, an unreachable one is repaired as soon as it answers again."""
        for addr, (fault, why) in faults.items():
            self.errors[addr] = why
            if fault is EngineFault.RESTARTED:
                self.versions[addr] = 0
            elif fault is EngineFault.UNREACHABLE:
                self.unreachable.add(addr)

    def answering_again(self, readings: Mapping[str, EngineReading]) -> list[str]:
        """Readings of out-of-service engines: the unreachable ones are recorded; returns those that were unreachable
        and answer now (no longer recorded unreachable)."""
        back = []
        for addr, r in readings.items():
            if r.unreachable:
                self.unreachable.add(addr)
            elif addr in self.unreachable:
                self.unreachable.discard(addr)
                back.append(addr)
        return back

    def returned(self, readings: Mapping[str, EngineReading]) -> tuple[list[str], list[str]]:
        """Readings while a job holds the group: of the engines that were down at the sleep and answer now, those
        asleep and those awake (to be put to sleep), by address."""
        asleep: list[str] = []
        awake: list[str] = []
        for addr, r in sorted(readings.items()):
            if r.unreachable or addr not in self.unreachable:
                continue
            (asleep if r.sleeping else awake).append(addr)
        return asleep, awake

    def back_asleep(self, address: str) -> None:
        """A sampler down at the sleep is back and asleep: counted in again (it serves after the holder yields)."""
        self.unreachable.discard(address)
        self.errors.pop(address, None)

    def mark_unknown(self, addresses: Iterable[str], why: str) -> None:
        """Samplers whose state is unknown (``why``) go out of service, unless they are already, so that a repair
        wakes and verifies them."""
        for addr in addresses:
            self.errors.setdefault(addr, why)

    # ------------------------------------------------------------------ repair back-off
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
