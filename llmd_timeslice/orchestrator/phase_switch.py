"""A phase switch of one group, step by step: to a job (drain, sleep, grant) and back to the samplers (wake, verify,
serve).

To a job: :meth:`PhaseSwitch.start_drain` (phase DRAINING) runs ``drain_samplers``; its outcome ``DRAINED`` starts
``suspend_samplers`` (SUSPENDING); ``SUSPENDED`` grants the lease to the waiter the switch is for (or the next one),
``DRAIN_FAILED`` / ``SUSPEND_FAILED`` fail that waiter and wake every sampler again (a rollback). Back to the
samplers (after a yield, a rollback, a repair, a start-up reconcile or new samplers): :meth:`PhaseSwitch.start_resume`
(RESUMING or REPAIRING) runs ``resume_samplers`` for a :meth:`PhaseSwitch.resume_record`; its outcome takes the
versions loaded and the samplers that failed into the fleet and the weight ledger, then the group serves, stays out
of service, or drains again for a job that queued meanwhile.

Each step is a task of the group (:meth:`GroupHost.spawn`) calling the
:class:`~llmd_timeslice.orchestrator.switch.SwitchActions`; it posts its outcome back as a command, so the actor keeps
taking commands while a switch is in flight. The handlers here run on the actor's task, through the
:class:`~llmd_timeslice.orchestrator.group_host.GroupHost` protocol.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from llmd_timeslice.domain.group_settings import GroupSpec, SamplerEndpoint
from llmd_timeslice.domain.switches import EngineFault, SwitchKind, SwitchRecord
from llmd_timeslice.orchestrator.commands import GROUP_LOGGER, Command, fail
from llmd_timeslice.orchestrator.errors import SwitchFailed
from llmd_timeslice.orchestrator.group_host import GroupHost
from llmd_timeslice.orchestrator.lease import Waiter
from llmd_timeslice.orchestrator.phases import GroupCommand, GroupPhase
from llmd_timeslice.weights.update import WeightUpdate

__all__ = ["PhaseSwitch", "SwitchInFlight", "resume_record", "run_step"]

log = logging.getLogger(GROUP_LOGGER)

C = GroupCommand
P = GroupPhase

Step = Callable[[GroupSpec, SwitchRecord], Coroutine[Any, Any, None]]


@dataclass(eq=False)
class SwitchInFlight:
    """The switch in flight: its record, the waiter it is for (to a job), and replies due when it ends."""

    record: SwitchRecord
    waiter: Waiter | None = None
    replies: list[asyncio.Future[Any]] = field(default_factory=list)


def resume_record(
    group_id: str,
    kind: SwitchKind,
    after_job: str,
    samplers: list[SamplerEndpoint],
    versions: dict[str, int],
    target: WeightUpdate | None,
    wall: float,
) -> SwitchRecord:
    """A record for waking ``samplers`` of group ``group_id`` (at wall-clock time ``wall``, after ``after_job``): the
    weight version each serves (``versions``: address -> version), and the version to load, ``target``, when any is
    below it (always for a reconcile or repair: an engine may have restarted meanwhile)."""
    rec = SwitchRecord(group_id, kind, after_job, wall)
    for smp in samplers:
        rec.sampler_versions[smp.address] = versions.get(smp.address, 0)
    if target is not None and (
        kind in (SwitchKind.RECONCILE, SwitchKind.REPAIR) or any(v < target.version for v in rec.sampler_versions.values())
    ):
        rec.weights = target
    return rec


async def run_step(
    post: Callable[[Command], None], action: Step, spec: GroupSpec, rec: SwitchRecord, ok: GroupCommand, failed: GroupCommand
) -> None:
    """Run ``action(spec, rec)`` and post its outcome: ``ok``, or ``failed`` with the error."""
    try:
        await action(spec, rec)
    except Exception as exc:
        post(Command(failed, record=rec, error=exc))
        return
    post(Command(ok, record=rec))


class PhaseSwitch:
    """The switches of the group ``host``, one in flight at a time (:attr:`in_flight`)."""

    def __init__(self, host: GroupHost) -> None:
        self._g = host
        self.in_flight: SwitchInFlight | None = None

    def take(self) -> SwitchInFlight | None:
        """The switch in flight, forgotten (its steps are cancelled by the caller: a recovery)."""
        sw, self.in_flight = self.in_flight, None
        return sw

    # ------------------------------------------------------------------ to a job
    def start_drain(self, kind: GroupCommand) -> None:
        """Switch to the waiter the group's policy picks: drain the samplers (because of ``kind``)."""
        g = self._g
        w = g.next_waiter()
        rec = SwitchRecord(g.group_id, SwitchKind.TO_JOB, w.job_id, g.clock.wall())
        rec.sleep_level = g.spec.sleep_level_for(w.job_id, w.job_id in g.ledger.publishers)
        rec.cause = kind.value
        self.in_flight = SwitchInFlight(rec, w)
        g.enter(P.DRAINING, kind)
        g.spawn(run_step(g.post, g.actions.drain_samplers, g.spec.copy(), rec, C.DRAINED, C.DRAIN_FAILED), "drain")

    async def on_drained(self, cmd: Command) -> None:
        g, sw = self._g, self.in_flight
        assert sw is not None
        g.enter(P.SUSPENDING, C.DRAINED)
        g.spawn(run_step(g.post, g.actions.suspend_samplers, g.spec.copy(), sw.record, C.SUSPENDED, C.SUSPEND_FAILED), "suspend")

    async def on_suspended(self, cmd: Command) -> None:
        """The samplers sleep: the waiter the switch is for gets the lease (one whose engine was down is out of
        service, put to sleep once it answers); if it gave up, the next waiter; if none waits, wake them again."""
        g, sw = self._g, self.in_flight
        assert sw is not None
        self.in_flight = None
        g.record(sw.record)
        if g.fleet.down_at_sleep(sw.record.unreachable):
            g.mark_dirty()
        w = sw.waiter
        if w is not None and not w.future.done():
            await g.grant(w, C.SUSPENDED)
        elif g.leases.waiters:
            await g.grant(g.next_waiter(), C.SUSPENDED)
        else:
            self.start_resume(SwitchKind.TO_SAMPLERS, C.SUSPENDED)

    async def on_failed(self, cmd: Command) -> None:
        """The drain or the sleep failed: the waiter gets :class:`SwitchFailed`, and every sampler is woken and
        verified again (some may be asleep, one half-asleep)."""
        g, sw = self._g, self.in_flight
        assert sw is not None
        self.in_flight = None
        rec = sw.record
        rec.ok, rec.error = False, str(cmd.error)
        g.record(rec)
        g.last_error = f"switch to job {rec.job_id!r} failed: {cmd.error}"
        log.error("group=%s %s", g.group_id, g.last_error)
        w = sw.waiter
        if w is not None:
            g.leases.remove(w)
            fail(w.future, SwitchFailed(g.last_error + "; samplers are being woken again"))
        self.start_resume(SwitchKind.TO_SAMPLERS, cmd.kind, after_job=rec.job_id)

    # ------------------------------------------------------------------ back to the samplers
    def resume_record(self, kind: SwitchKind, after_job: str = "", samplers: list[SamplerEndpoint] | None = None) -> SwitchRecord:
        """:func:`resume_record` for ``samplers`` of the group (default: all), to its target weight version."""
        g = self._g
        targets = g.spec.samplers if samplers is None else samplers
        return resume_record(g.group_id, kind, after_job, targets, g.fleet.versions, g.ledger.target, g.clock.wall())

    def start_resume(
        self,
        kind: SwitchKind,
        cmd: GroupCommand,
        after_job: str = "",
        samplers: list[SamplerEndpoint] | None = None,
        replies: list[asyncio.Future[Any]] | None = None,
        engine_faults: dict[str, EngineFault] | None = None,
    ) -> None:
        """Wake ``samplers`` (default: all) because of ``cmd``: a repair (phase REPAIRING) or another wake (RESUMING).
        Samplers with ``engine_faults`` are taken out of service at the gates first. ``replies`` get None when the
        wake ends."""
        g = self._g
        targets = list(g.spec.samplers) if samplers is None else samplers
        rec = self.resume_record(kind, after_job, targets)
        rec.cause = cmd.value
        rec.engine_faults = dict(engine_faults or {})
        self.in_flight = SwitchInFlight(rec, None, list(replies or []))
        repair = kind is SwitchKind.REPAIR
        g.enter(P.REPAIRING if repair else P.RESUMING, cmd)
        spec = g.spec.copy(samplers=targets)
        done = C.REPAIRED if repair else C.RESUMED
        take_out = g.actions.take_out_of_service if engine_faults else None
        g.spawn(self._resume_step(spec, rec, done, take_out), "repair" if repair else "resume")

    async def _resume_step(
        self,
        spec: GroupSpec,
        rec: SwitchRecord,
        done: GroupCommand,
        take_out: Callable[[GroupSpec], Coroutine[Any, Any, None]] | None,
    ) -> None:
        if take_out is not None:
            try:
                await take_out(spec)
            except Exception as exc:
                log.error("group=%s taking %s out of service failed: %s", spec.group_id, [s.address for s in spec.samplers], exc)
        g = self._g
        try:
            await g.actions.resume_samplers(spec, rec)
        except Exception as exc:
            g.post(Command(done, record=rec, error=exc))
            return
        g.post(Command(done, record=rec))

    async def on_resumed(self, cmd: Command) -> None:
        """A wake ended (``RESUMED`` or ``REPAIRED``): its outcome goes into the fleet and the ledger; the group drains
        again for a waiter, stays out of service, or serves."""
        g, sw = self._g, self.in_flight
        assert sw is not None and cmd.record is sw.record
        self.in_flight = None
        rec = sw.record
        if cmd.error is not None:
            rec.ok, rec.error = False, str(cmd.error)
            g.last_error = {
                SwitchKind.REPAIR: f"repair wake failed: {cmd.error}; retrying with back-off",
                SwitchKind.DISCOVERED: f"new samplers failed verification: {cmd.error}; they stay out of service",
            }.get(rec.kind, f"waking the samplers failed: {cmd.error}; they stay out of service")
            log.error("group=%s %s", g.group_id, g.last_error)
        elif rec.kind is SwitchKind.REPAIR:
            g.last_error = ""
            log.warning("group=%s repaired: %s back in service", g.group_id, sorted(rec.sampler_versions))
        g.fleet.take_wake(rec, {s.address for s in g.spec.samplers})
        g.mark_dirty()
        g.ledger.take_wake(rec, g.fleet.serving_version)
        g.record(rec)
        if g.leases.waiters:
            self.start_drain(cmd.kind)
        elif g.fleet.errors:
            g.enter(P.OUT_OF_SERVICE, cmd.kind)
        else:
            g.enter(P.SERVING, cmd.kind)
        for r in sw.replies:
            if not r.done():
                r.set_result(None)
