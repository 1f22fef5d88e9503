"""Apply discovered group changes to a running orchestrator, without racing its phase switches.

:class:`SerializedActions` wraps the orchestrator's switch actions with one lock per group, so a
suspend or resume and a change of that group's samplers never overlap. :class:`InventorySync`
applies each new group snapshot (from :class:`~llmd_timeslice.discovery.kubernetes.KubernetesDiscovery`)
under that lock:

* **new group**: created (empty), then its samplers are added as below;
* **sampler added**: it joins the group's spec at once. If the group's samplers hold the accelerators
  and nothing is in flight (IDLE, no holder, no waiter), it is woken (a no-op on an awake engine),
  verified and published SERVING now, through the same actions as any resume. Otherwise (a trainer
  holds the group, or a switch is queued) it is *not* published: the gate does not route to it,
  and the group's next suspend puts it to sleep with the others or the next resume wakes,
  verifies and publishes it;
* **sampler removed** (pod deleted, terminating, changed): published ASLEEP at the gates (out of
  service; the state stream has no "removed") and dropped from the spec;
* **sleep level / drain timeout changed**: applied when the group is IDLE with its samplers
  loaded; otherwise kept pending with a warning, and applied after the group's next resume or
  the next snapshot;
* **group gone** from discovery: kept (it may hold a lock), its samplers removed as above.

It reaches into :class:`~llmd_timeslice.orchestrator.groups.Group` (``spec``, ``state``,
``holder``, ``waiters``, ``loaded_job``): the orchestrator has no public "update group" call yet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import defaultdict

from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as gpb
from llmd_timeslice.orchestrator.groups import (
    SAMPLERS,
    Group,
    GroupSpec,
    GroupState,
    Orchestrator,
    SamplerEndpoint,
    SwitchRecord,
)

log = logging.getLogger(__name__)


class SerializedActions:
    """Switch actions with one lock per group; bind ``inner`` before the first switch.

    The orchestrator server builds its gate hub itself, so the inner
    :class:`~llmd_timeslice.orchestrator.actions.GrpcSwitchActions` is bound after the server
    exists: ``wrapper.inner = GrpcSwitchActions(server.hub, ...)``.
    """

    def __init__(self, inner=None) -> None:
        self.inner = inner
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.after_resume = None  # callable(group_id), set by InventorySync

    def lock(self, group_id: str) -> asyncio.Lock:
        return self._locks[group_id]

    @property
    def sampler_states(self) -> dict[str, str]:
        return getattr(self.inner, "sampler_states", {})

    async def suspend_samplers(self, spec: GroupSpec, record: SwitchRecord) -> None:
        async with self._locks[spec.group_id]:
            await self.inner.suspend_samplers(spec, record)

    async def resume_samplers(self, spec: GroupSpec, record: SwitchRecord) -> None:
        try:
            async with self._locks[spec.group_id]:
                await self.inner.resume_samplers(spec, record)
        finally:
            if self.after_resume is not None:
                # Runs after the orchestrator marks the group IDLE (no await between the two).
                asyncio.get_running_loop().call_soon(self.after_resume, spec.group_id)

    async def read_engines(self, spec: GroupSpec) -> dict:
        """The engine audit's reading (empty where the inner actions cannot read engines)."""
        if not hasattr(self.inner, "read_engines"):
            return {}
        return await self.inner.read_engines(spec)

    async def take_out_of_service(self, spec: GroupSpec) -> None:
        async with self._locks[spec.group_id]:
            await self.inner.take_out_of_service(spec)

    async def reconcile(self, specs: list[GroupSpec], record_for) -> None:
        if hasattr(self.inner, "reconcile"):
            await self.inner.reconcile(specs, record_for)

    async def close(self) -> None:
        if hasattr(self.inner, "close"):
            await self.inner.close()


def _copy(spec: GroupSpec) -> GroupSpec:
    return dataclasses.replace(spec, samplers=list(spec.samplers))


class InventorySync:
    """Applies group snapshots to ``orchestrator`` through ``actions`` (see the module docstring)."""

    def __init__(self, orchestrator: Orchestrator, actions: SerializedActions) -> None:
        self.orch = orchestrator
        self.actions = actions
        self._desired: dict[str, GroupSpec] = {}
        self._pending: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._serial = asyncio.Lock()
        actions.after_resume = self._after_resume

    async def apply(self, specs: list[GroupSpec]) -> None:
        """Bring the orchestrator's groups to ``specs`` (as far as their states allow)."""
        async with self._serial:
            desired = {s.group_id: _copy(s) for s in specs}
            for gid, g in self.orch.groups.items():
                if gid not in desired and g.spec.samplers:
                    log.warning("group %s: no pods match any more; its samplers are removed, the group is kept", gid)
                    desired[gid] = GroupSpec(gid, [], g.spec.sleep_level, g.spec.drain_timeout_s)
            self._desired.update(desired)
            for gid in sorted(desired):
                await self._apply_group(gid)

    def _after_resume(self, group_id: str) -> None:
        if group_id in self._pending:
            t = asyncio.get_running_loop().create_task(self._retry(group_id))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _retry(self, group_id: str) -> None:
        async with self._serial:
            await self._apply_group(group_id)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()

    async def _apply_group(self, gid: str) -> None:
        want = self._desired[gid]
        g = self.orch.groups.get(gid)
        if g is not None and gid not in self._pending and (
                g.spec.samplers, g.spec.sleep_level, g.spec.drain_timeout_s) == (
                want.samplers, want.sleep_level, want.drain_timeout_s):
            return  # unchanged: do not wait for a switch of this group
        if g is None:
            g = Group(GroupSpec(gid, [], want.sleep_level, want.drain_timeout_s))
            self.orch.groups[gid] = g
            log.info("group %s: discovered", gid)
        async with self.actions.lock(gid):
            await self._apply_locked(g, want)

    @staticmethod
    def _quiet(g: Group) -> bool:
        return g.holder is None and not g.waiters and g.state is GroupState.IDLE

    async def _apply_locked(self, g: Group, want: GroupSpec) -> None:
        spec = g.spec
        have = {s.address: s for s in spec.samplers}
        wanted = {s.address: s for s in want.samplers}
        removed = [s for a, s in have.items() if wanted.get(a) != s]
        added = [s for a, s in wanted.items() if have.get(a) != s]
        gid = spec.group_id
        if removed:
            # In place: a switch that starts later sees the same GroupSpec object.
            spec.samplers = [s for s in spec.samplers if s not in removed]
            for s in removed:
                g.sampler_states.pop(s.address, None)
                self.actions.sampler_states.pop(s.address, None)
            await self._out_of_service(removed)
            log.info("group %s: samplers removed %s", gid, [s.address for s in removed])
        settings_differ = (spec.sleep_level, spec.drain_timeout_s) != (want.sleep_level, want.drain_timeout_s)
        had_samplers = bool(spec.samplers)
        serve_now = self._quiet(g) and (g.loaded_job == SAMPLERS or (g.loaded_job is None and not had_samplers))
        if settings_differ:
            if serve_now or not (spec.samplers or added):
                spec.sleep_level, spec.drain_timeout_s = want.sleep_level, want.drain_timeout_s
            else:
                log.warning("group %s is %s: sleep level / drain timeout change deferred until its samplers are "
                            "back and it is idle", gid, g.state.value)
        if added:
            spec.samplers = spec.samplers + added
            for s in added:
                g.sampler_states[s.address] = "RUNNING"
            if serve_now:
                g.loaded_job = SAMPLERS
                log.info("group %s: samplers added %s; waking/verifying them before they serve", gid,
                         [s.address for s in added])
                record = SwitchRecord(gid, "discovered", "", time.time())
                try:
                    await self.actions.inner.resume_samplers(
                        GroupSpec(gid, added, spec.sleep_level, spec.drain_timeout_s), record)
                except Exception as exc:
                    g.last_error = f"new samplers failed verification: {exc}; they stay out of service"
                    log.error("group %s: %s", gid, g.last_error)
            else:
                log.warning("group %s is %s (holder %r, %d waiting): samplers %s join now but serve only after the "
                            "group's next resume", gid, g.state.value, g.holder, len(g.waiters),
                            [s.address for s in added])
        done = (spec.sleep_level, spec.drain_timeout_s) == (want.sleep_level, want.drain_timeout_s)
        if done:
            self._pending.discard(gid)
        else:
            self._pending.add(gid)

    async def _out_of_service(self, samplers: list[SamplerEndpoint]) -> None:
        hub = getattr(self.actions.inner, "hub", None)
        if hub is None:
            return
        by_pool: dict[str, list[str]] = defaultdict(list)
        for s in samplers:
            by_pool[s.pool].append(s.address)
        for pool, addrs in by_pool.items():
            if any(a in hub.state.get(pool, {}) for a in addrs):
                await hub.publish(pool, [(a, gpb.ENDPOINT_STATE_ASLEEP, None) for a in addrs])


def inventory_from_specs(specs: list[GroupSpec]):
    """An :class:`~llmd_timeslice.discovery.static.Inventory` for the orchestrator server (may be empty)."""
    from llmd_timeslice.discovery.static import GroupEntry, Inventory, SamplerEntry

    groups = [
        GroupEntry(group_id=s.group_id, sleep_level=s.sleep_level, drain_timeout_s=s.drain_timeout_s,
                   samplers=[SamplerEntry(pool=e.pool, address=e.address, sidecar=e.sidecar, job_id=e.job_id)
                             for e in s.samplers])
        for s in specs
    ]
    if not groups:
        return Inventory.model_construct(groups=[])
    return Inventory(groups=groups)
