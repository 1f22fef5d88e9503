"""Discovery's updates of one group (``SPEC_UPDATE``): samplers that join or leave, and changed settings.

An update applies in a stable phase (FREE, SERVING, OUT_OF_SERVICE, HELD, DEFERRED; the module doc of
``discovery/sync.py``); while a switch is in flight it is kept (a newer one replaces it) and applied once the group
is stable again (:meth:`SpecUpdates.settle`, after every command). Samplers that leave are taken out of service at the
gates for good; samplers that join an idle group are woken and verified before they serve (a ``DISCOVERED`` wake);
joining a held group, they serve after its next wake. Settings change at once, except while a job holds the group:
then when its samplers are back. The handlers run on the actor's task, through the
:class:`~llmd_timeslice.orchestrator.group_host.GroupHost` protocol.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from llmd_timeslice.domain.group_settings import GroupSpec
from llmd_timeslice.domain.switches import SwitchKind
from llmd_timeslice.orchestrator.commands import GROUP_LOGGER, NO_REPLY, Command
from llmd_timeslice.orchestrator.group_host import GroupHost
from llmd_timeslice.orchestrator.phase_switch import PhaseSwitch
from llmd_timeslice.orchestrator.phases import STABLE_PHASES, GroupCommand, GroupPhase

__all__ = ["SpecUpdates"]

log = logging.getLogger(GROUP_LOGGER)

C = GroupCommand
P = GroupPhase


class SpecUpdates:
    """Discovery's updates of the group ``host``, whose wakes ``switch`` runs."""

    def __init__(self, host: GroupHost, switch: PhaseSwitch) -> None:
        self._g = host
        self._switch = switch
        self.pending: GroupSpec | None = None
        """An update kept until the switch in flight ends."""
        self.pending_replies: list[asyncio.Future[Any]] = []
        self._pending_settings: GroupSpec | None = None

    async def on_spec_update(self, cmd: Command) -> object:
        spec = cmd.spec
        assert spec is not None
        g = self._g
        replies = [r for r in (cmd.reply,) if r is not None]
        if g.phase not in STABLE_PHASES:
            # Applied when the switch in flight ends (the next stable phase); a newer update replaces this one.
            self.pending = spec
            self.pending_replies.extend(replies)
            g.enter(g.phase, C.SPEC_UPDATE)
            return NO_REPLY
        replies = self.pending_replies + replies
        self.pending, self.pending_replies = None, []
        await self._apply(spec, replies)
        return NO_REPLY

    async def settle(self) -> None:
        """After each command: in a stable phase, apply the update kept meanwhile, then settings deferred while the
        group was held (once it is not)."""
        g = self._g
        if self.pending is not None and g.phase in STABLE_PHASES:
            spec, replies = self.pending, self.pending_replies
            self.pending, self.pending_replies = None, []
            await self._apply(spec, replies)
        if self._pending_settings is not None and g.phase in STABLE_PHASES and g.phase is not P.HELD:
            g.spec.apply_settings(self._pending_settings)
            self._pending_settings = None
            log.info("group=%s deferred settings applied", g.group_id)

    async def _apply(self, spec: GroupSpec, replies: list[asyncio.Future[Any]]) -> None:
        """Apply ``spec`` in a stable phase; ``replies`` get None once applied (for new samplers of an idle group:
        once they are woken)."""
        g, kind = self._g, C.SPEC_UPDATE
        have = {s.address: s for s in g.spec.samplers}
        want = {s.address: s for s in spec.samplers}
        removed = [s for a, s in have.items() if want.get(a) != s]
        added = [s for a, s in want.items() if have.get(a) != s]
        if removed:
            g.spec.samplers = [s for s in g.spec.samplers if s not in removed]
            for s in removed:
                g.fleet.remove(s.address)
            g.mark_dirty()
            log.info("group=%s samplers removed %s", g.group_id, [s.address for s in removed])
            try:
                await g.actions.retire_samplers(removed)
            except Exception as exc:
                log.error("group=%s taking removed samplers out of service failed: %s", g.group_id, exc)
        if added:
            g.spec.samplers = g.spec.samplers + added
            for s in added:
                g.fleet.add(s.address)
            g.mark_dirty()
        if spec.settings() != g.spec.settings():
            if g.phase is P.HELD:
                log.warning("group=%s is held: settings change deferred until its samplers are back", g.group_id)
                self._pending_settings = spec
            else:
                g.spec.apply_settings(spec)
                self._pending_settings = None
        phase = g.phase
        if phase is P.HELD:
            if added:
                log.warning(
                    "group=%s is held by %r: samplers %s join now and serve after its next wake",
                    g.group_id,
                    g.leases.holder,
                    [s.address for s in added],
                )
            g.enter(P.HELD, kind)
        elif added:
            new = [s.address for s in added]
            log.info("group=%s samplers added %s; waking/verifying them before they serve", g.group_id, new)
            g.leases.deferred_job = None
            self._switch.start_resume(SwitchKind.DISCOVERED, kind, samplers=added, replies=replies)
            return
        elif not g.spec.samplers and phase in (P.SERVING, P.OUT_OF_SERVICE):
            g.enter(P.FREE, kind)
        elif phase is P.OUT_OF_SERVICE and not g.fleet.errors:
            g.enter(P.SERVING, kind)
        else:
            g.enter(phase, kind)
        for r in replies:
            if not r.done():
                r.set_result(None)
