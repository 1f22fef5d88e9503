"""The repair path of one group: the engine audit between switches, the probes of engines that were down, and the
repair wake of out-of-service samplers.

* Audit (``AUDIT_TICK``, every ``audit_interval_s`` or when a gate saw a connection refused): read the engines; in
  SERVING, an engine that cannot be serving what the fleet records
  (:func:`~llmd_timeslice.orchestrator.sampler_fleet.judge_engines`) is taken out of service and woken again
  (``AUDITED`` -> REPAIRING); in OUT_OF_SERVICE, an engine that refused connections and answers again is repaired at
  once (``PROBED``); while a job holds the group (HELD), an engine that was down at the sleep and answers again is put
  to sleep (``RETURNED``), or counted asleep if it already is.
* Repair (``REPAIR_TICK``, the fleet's back-off timer armed whenever the group enters OUT_OF_SERVICE): wake the
  out-of-service samplers again (:meth:`PhaseSwitch.start_resume
  <llmd_timeslice.orchestrator.phase_switch.PhaseSwitch.start_resume>` with ``SwitchKind.REPAIR``).

An engine reading is advisory: one read in an older epoch (the phase changed meanwhile) is ignored. The handlers run
on the actor's task, through the :class:`~llmd_timeslice.orchestrator.group_host.GroupHost` protocol.
"""

from __future__ import annotations

import logging

from llmd_timeslice.domain.group_settings import GroupSpec
from llmd_timeslice.domain.switches import SwitchKind, SwitchRecord
from llmd_timeslice.orchestrator.commands import GROUP_LOGGER, Command
from llmd_timeslice.orchestrator.group_host import GroupHost
from llmd_timeslice.orchestrator.phase_switch import PhaseSwitch, run_step
from llmd_timeslice.orchestrator.phases import GroupCommand, GroupPhase
from llmd_timeslice.orchestrator.sampler_fleet import judge_engines

__all__ = ["RepairPath"]

log = logging.getLogger(GROUP_LOGGER)

C = GroupCommand
P = GroupPhase


class RepairPath:
    """The audit and repair of the group ``host``, whose wakes ``switch`` runs."""

    def __init__(self, host: GroupHost, switch: PhaseSwitch) -> None:
        self._g = host
        self._switch = switch
        self.reading = False
        """An engine read is in flight (one at a time; cleared when its outcome arrives, or by a recovery)."""

    # ------------------------------------------------------------------ audit
    async def on_audit_tick(self, cmd: Command) -> None:
        """Read the engines the phase asks about (none while a read is in flight, or if they cannot be read)."""
        g = self._g
        g.enter(g.phase, C.AUDIT_TICK)
        if self.reading or not g.actions.can_read_engines:
            return
        if g.phase is P.HELD:  # a sampler whose engine was down at the sleep: is it back (and awake)?
            samplers, done = [s for s in g.spec.samplers if s.address in g.fleet.unreachable], C.PROBED
        elif g.phase is P.SERVING:
            samplers, done = list(g.spec.samplers), C.AUDITED
        else:  # OUT_OF_SERVICE: is an engine that refused connections back?
            samplers, done = [s for s in g.spec.samplers if s.address in g.fleet.errors], C.PROBED
        if not samplers:
            return
        self.reading = True
        g.spawn(self._read(g.spec.copy(samplers=samplers), done, g.epoch), "audit")

    async def _read(self, spec: GroupSpec, done: GroupCommand, epoch: int) -> None:
        g = self._g
        try:
            readings = await g.actions.read_engines(spec)
        except Exception as exc:  # a reading is advisory: the next tick tries again
            log.warning("group=%s engine audit could not read the engines: %s", spec.group_id, exc)
            readings = {}
        g.post(Command(done, readings=readings, epoch=epoch))

    async def on_audited(self, cmd: Command) -> None:
        """Readings of a serving group: engines at fault go out of service and are woken again (a repair)."""
        g = self._g
        faults = judge_engines(g.spec.samplers, g.fleet, cmd.readings or {}) if cmd.epoch == g.epoch else {}
        if not faults:
            g.enter(P.SERVING, C.AUDITED)
            return
        for addr, (_, why) in sorted(faults.items()):
            log.error("group=%s sampler %s: %s; taking it out of service to wake it again", g.group_id, addr, why)
        g.fleet.take_faults(faults)
        g.last_error = "; ".join(f"{a}: {why}" for a, (_, why) in sorted(faults.items()))
        bad = [s for s in g.spec.samplers if s.address in faults]
        self._switch.start_resume(
            SwitchKind.REPAIR, C.AUDITED, samplers=bad, engine_faults={a: f for a, (f, _) in faults.items()}
        )

    async def on_probed(self, cmd: Command) -> None:
        """Readings of engines that were down: repaired at once when one answers again (out of service), or put to
        sleep (held)."""
        g = self._g
        if g.phase is P.HELD:
            self._probed_held(cmd)
            return
        back = g.fleet.answering_again(cmd.readings or {}) if cmd.epoch == g.epoch else []
        for addr in back:
            log.warning("group=%s sampler %s: its engine answers again; repairing now", g.group_id, addr)
        if back:
            self.start_repair(C.PROBED)
        else:
            g.enter(P.OUT_OF_SERVICE, C.PROBED)

    def _probed_held(self, cmd: Command) -> None:
        """While a job holds the group: each sampler left out of the sleep that answers again is put to sleep (an
        engine back from a restart is awake and takes accelerator memory), or counted asleep if it already is."""
        g = self._g
        asleep, awake = g.fleet.returned(cmd.readings or {}) if cmd.epoch == g.epoch else ([], [])
        for addr in asleep:
            self._back_asleep(addr, "it reports itself asleep")
        g.enter(P.HELD, C.PROBED)
        if awake and not g.fleet.returning:
            samplers = [s for s in g.spec.samplers if s.address in awake]
            log.warning("group=%s samplers %s answer again while the group is held: putting them to sleep", g.group_id, awake)
            holder = g.leases.holder or ""
            rec = SwitchRecord(g.group_id, SwitchKind.TO_JOB, holder, g.clock.wall())
            rec.sleep_level = g.spec.sleep_level_for(holder, holder in g.ledger.publishers)
            g.fleet.returning = set(awake)
            spec = g.spec.copy(samplers=samplers)
            g.spawn(run_step(g.post, g.actions.suspend_samplers, spec, rec, C.RETURNED, C.RETURNED), "returned")

    def _back_asleep(self, addr: str, how: str) -> None:
        g = self._g
        g.fleet.back_asleep(addr)
        g.mark_dirty()
        log.warning("group=%s sampler %s is back and asleep (%s); it serves again when the holder yields", g.group_id, addr, how)

    async def on_returned(self, cmd: Command) -> None:
        """The samplers back from being down were put to sleep (verified), or not: those that did are counted in;
        the others are tried again at the next probe."""
        g = self._g
        rec, addrs = cmd.record, g.fleet.returning
        g.fleet.returning = set()
        if cmd.error is not None:  # those that did fall asleep report it at the next probe, the others are tried again
            log.error("group=%s putting returned samplers %s to sleep failed: %s", g.group_id, sorted(addrs), cmd.error)
        elif rec is not None:
            for addr in sorted(addrs - set(rec.unreachable)):
                self._back_asleep(addr, "put to sleep, verified")
        g.enter(P.HELD, C.RETURNED)

    # ------------------------------------------------------------------ repair
    async def on_repair_tick(self, cmd: Command) -> None:
        g = self._g
        log.warning(
            "group=%s samplers out of service (%s); retrying the wake",
            g.group_id,
            g.last_error or ", ".join(sorted(g.fleet.errors)),
        )
        self.start_repair(C.REPAIR_TICK)

    def start_repair(self, kind: GroupCommand) -> None:
        """Wake the out-of-service samplers again (because of ``kind``)."""
        bad = [s for s in self._g.spec.samplers if s.address in self._g.fleet.errors]
        self._switch.start_resume(SwitchKind.REPAIR, kind, samplers=bad)
