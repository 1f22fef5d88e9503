"""The harness of the group state machine's tests: scripted switch actions, a manual clock, a persister that can
fail, and ``Env`` (an orchestrator with one group ``s`` and the edges it walked)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from llmd_timeslice.domain.group_settings import GroupSpec, SamplerEndpoint
from llmd_timeslice.domain.switches import EngineReading
from llmd_timeslice.orchestrator.clock import ManualClock
from llmd_timeslice.orchestrator.groups import Command, Orchestrator, _Waiter
from llmd_timeslice.orchestrator.phases import (
    GroupCommand,
    GroupPhase,
)
from llmd_timeslice.orchestrator.switch import SwitchActions

C, P = GroupCommand, GroupPhase
S1 = SamplerEndpoint("p", "10.0.0.1:8000", "10.0.0.1:9001", "s1")
S2 = SamplerEndpoint("p", "10.0.0.2:8000", "10.0.0.2:9001", "s2")
S3 = SamplerEndpoint("p", "10.0.0.3:8000", "10.0.0.3:9001", "s3")


class ScriptedActions(SwitchActions):
    """Each step records its call; a step named in ``hold`` waits for :meth:`release`; ``fail`` makes the next
    call of a step raise; wakes of ``fail_samplers`` fail; ``readings`` is what the engines report."""

    can_read_engines = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[str]]] = []
        self.hold: set[str] = set()
        self._gates: dict[str, asyncio.Event] = {}
        self.fail: dict[str, Exception] = {}
        self.fail_samplers: set[str] = set()
        self.readings: dict[str, EngineReading] = {}
        self.down: set[str] = set()  # samplers whose engine is down at a sleep (left out of it: record.unreachable)

    async def _step(self, name: str, spec: GroupSpec) -> None:
        self.calls.append((name, spec.group_id, [s.address for s in spec.samplers]))
        if name in self.hold:
            await self._gates.setdefault(name, asyncio.Event()).wait()
        err = self.fail.pop(name, None)
        if err is not None:
            raise err

    def release(self, name: str) -> None:
        self.hold.discard(name)
        gate = self._gates.pop(name, None)
        if gate is not None:
            gate.set()

    async def drain_samplers(self, spec, record):
        await self._step("drain", spec)

    async def suspend_samplers(self, spec, record):
        await self._step("suspend", spec)
        for s in spec.samplers:
            if s.address in self.down:
                record.unreachable[s.address] = "connection refused"

    async def resume_samplers(self, spec, record):
        await self._step("resume", spec)
        bad = [s.address for s in spec.samplers if s.address in self.fail_samplers]
        for s in spec.samplers:
            if s.address in bad:
                record.sampler_errors[s.address] = "its engine did not wake"
            elif record.weights is not None:
                record.sampler_versions[s.address] = record.weights.version
        if bad:
            raise RuntimeError(f"wake failed on {bad}")

    async def read_engines(self, spec):
        await self._step("read", spec)
        return {s.address: self.readings[s.address] for s in spec.samplers if s.address in self.readings}

    async def publish_asleep(self, spec):
        self.calls.append(("asleep", spec.group_id, [s.address for s in spec.samplers]))


class Bug(Exception):
    """An exception type the core does not expect (not an OrchestratorError, not a step failure)."""


class MalformedReading:
    """An engine reading whose fields raise when read: a driver returning garbage."""

    @property
    def unreachable(self):
        raise Bug("reading has no 'unreachable'")


class FlakyPersister:
    """Stands in for StatePersister: ``failures`` next saves raise."""

    def __init__(self) -> None:
        self.failures = 0
        self.saves = 0

    async def save(self) -> None:
        self.saves += 1
        if self.failures > 0:
            self.failures -= 1
            raise OSError("disk full")


class Env:
    def __init__(self, repair_first_s: float = 2.0, audit_interval_s: float = 1000.0) -> None:
        self.clock = ManualClock()
        self.acts = ScriptedActions()
        self.orch = Orchestrator([GroupSpec("s", [S1, S2]), GroupSpec("t")], self.acts, clock=self.clock)
        self.orch.start_repair(first_s=repair_first_s, max_s=60.0, audit_interval_s=audit_interval_s)
        self.edges: set[tuple[GroupPhase, GroupCommand, GroupPhase]] = set()
        self.boom: dict[tuple[str, GroupPhase, GroupCommand, GroupPhase], Exception] = {}
        self.orch.on_transition = self._moved
        self.tasks: list[asyncio.Task] = []

    def _moved(self, g, a: GroupPhase, c: GroupCommand, b: GroupPhase) -> None:
        """Record the edge, or raise the exception ``boom`` names for it (a bug in the middle of a handler)."""
        err = self.boom.pop((g.group_id, a, c, b), None)
        if err is not None:
            raise err
        self.edges.add((a, c, b))

    def g(self, gid: str = "s"):
        return self.orch.groups[gid]

    def task(self, coro: Awaitable) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self.tasks.append(t)
        return t

    async def wait(self, phase: GroupPhase, gid: str = "s", pred: Callable | None = None) -> None:
        await self.g(gid).wait_until(lambda g: g.phase is phase and (pred is None or pred(g)), 5)

    async def close(self) -> None:
        await self.orch.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    # ---- reach a phase
    async def held(self, gid: str = "s", job: str = "A") -> None:
        await self.orch.acquire(job, gid)

    async def out_of_service(self) -> None:
        await self.held()
        self.acts.fail_samplers = {S2.address}
        await self.orch.yield_("A", "s")
        await self.wait(P.OUT_OF_SERVICE)
        self.acts.fail_samplers = set()

    async def draining(self) -> None:
        self.acts.hold.add("drain")
        self.task(self.orch.acquire("A", "s"))
        await self.wait(P.DRAINING)

    async def suspending(self) -> None:
        self.acts.hold.add("suspend")
        self.task(self.orch.acquire("A", "s"))
        await self.wait(P.SUSPENDING)

    async def resuming(self) -> None:
        await self.held()
        self.acts.hold.add("resume")
        await self.orch.yield_("A", "s")
        await self.wait(P.RESUMING)

    async def repairing(self) -> None:
        await self.out_of_service()
        self.acts.hold.add("resume")
        self.clock.advance(2.0)
        await self.wait(P.REPAIRING)

    async def deferred(self) -> None:
        await self.held("t")
        await self.orch.yield_("A", "t")
        await self.wait(P.DEFERRED, "t")

    async def queued(self, job: str = "B", gid: str = "s") -> asyncio.Task:
        t = self.task(self.orch.acquire(job, gid))
        await self.g(gid).wait_until(lambda g: any(w.job_id == job for w in g.waiters), 5)
        return t

    async def abandon(self, gid: str) -> None:
        w = _Waiter("ghost", 0.0, asyncio.get_running_loop().create_future())
        assert await self.g(gid).ask(Command(C.ABANDON, waiter=w)) is True


def spec_s(*samplers: SamplerEndpoint, **settings) -> GroupSpec:
    return GroupSpec("s", list(samplers), **settings)
