"""Apply discovered group changes to a running orchestrator, as commands to its groups.

Discovery never edits a group: :class:`InventorySync` (one snapshot at a time) and the orchestrator's reconcile
loop (:class:`~llmd_timeslice.discovery.reconcile.Reconciler`, one worker per group) send each group of a new
snapshot (from :class:`~llmd_timeslice.discovery.kubernetes.KubernetesDiscovery`) to
:meth:`~llmd_timeslice.orchestrator.groups.Orchestrator.update_spec`, and the group's own task applies
it between phase switches (``SPEC_UPDATE`` in :mod:`llmd_timeslice.orchestrator.phases`):

* **new group**: created (no samplers), then its samplers are added as below;
* **sampler added**: it joins the group's spec at once. If the group's samplers hold the accelerators
  and nothing is in flight (serving, or out of service waiting for a repair), it is woken (a no-op on
  an awake engine), loaded with the group's weight version, verified and published SERVING now.
  Otherwise (a job holds the group) it is *not* published: the gate does not route to it, and the
  group's next wake wakes, verifies and publishes it with the others;
* **sampler removed** (pod deleted, terminating, changed): published ASLEEP at the gates (out of
  service; the state stream has no "removed") and dropped from the spec;
* **settings changed** (sleep level, drain timeout, lease TTL, scheduling policy, job priorities,
  sleep-level policy, per-job sleep levels): applied at once unless a job holds the group; then they
  apply when its samplers are back;
* during a phase switch, the update waits for the switch to end (the next stable phase);
* **group gone** from discovery: kept (it may hold a lease), its samplers removed as above.
"""

from __future__ import annotations

import asyncio
import logging

from llmd_timeslice.domain.group_settings import GroupSpec
from llmd_timeslice.orchestrator.groups import Orchestrator

log = logging.getLogger(__name__)


class InventorySync:
    """Applies group snapshots to ``orchestrator`` (see the module docstring); one snapshot at a time."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orch = orchestrator
        self._serial = asyncio.Lock()

    async def apply(self, specs: list[GroupSpec]) -> None:
        """Bring the orchestrator's groups to ``specs``; returns once every group applied it (a group in the
        middle of a switch applies it when the switch ends)."""
        async with self._serial:
            changed = [
                s
                for s in desired_specs(self.orch, specs)
                if s.group_id not in self.orch.groups or differs(self.orch.groups[s.group_id].spec, s)
            ]
            await asyncio.gather(*(self.orch.update_spec(s) for s in changed))


def desired_specs(orch: Orchestrator, specs: list[GroupSpec]) -> list[GroupSpec]:
    """The spec each group should have after snapshot ``specs``, by group id: a group of ``orch`` that
    discovery no longer finds keeps existing with no samplers (logged)."""
    desired = {s.group_id: s for s in specs}
    for gid, g in orch.groups.items():
        if gid not in desired and g.spec.samplers:
            log.warning("group %s: no pods match any more; its samplers are removed, the group is kept", gid)
            desired[gid] = g.spec.copy(samplers=[])
    return [desired[gid] for gid in sorted(desired)]


def differs(have: GroupSpec, want: GroupSpec) -> bool:
    """Whether applying ``want`` changes a group now at ``have`` (its samplers or its settings)."""
    return have.samplers != want.samplers or have.settings() != want.settings()


def inventory_from_specs(specs: list[GroupSpec]):
    """An :class:`~llmd_timeslice.discovery.static.Inventory` for the orchestrator server (may be empty)."""
    from llmd_timeslice.domain.inventory import Inventory

    groups = [s.copy() for s in specs]
    if not groups:
        return Inventory.model_construct(groups=[])
    return Inventory(groups=groups)
