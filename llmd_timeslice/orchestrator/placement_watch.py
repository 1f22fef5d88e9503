"""The orchestrator's side of placement (issue 40; docs/placement.md): it records every job's phase profile from the
lease events of its groups, persists them with its state, serves them (``ListProfiles``, metrics), and checks the
placement plan in force against what it measures.

* Lease events: each group calls :meth:`PlacementWatch.acquired` / :meth:`granted` / :meth:`released` /
  :meth:`abandoned`, and :meth:`switched` with each finished switch; the
  :class:`~llmd_timeslice.placement.recorder.ProfileRecorder` turns them into profiles.
* The check (:meth:`check_now`, every ``interval_s`` by :meth:`run`): the measured duty cycle of the plan's groups
  over the interval (their busy accelerator-seconds, counted by the recorder) against the plan's prediction;
  :func:`llmd_timeslice.placement.replan.check` decides whether a re-plan is advised. Advised: a metric
  (``llmd_timeslice_placement_replan_advised``), ``status --profiles``, and an event (a warning log line
  ``event=ReplanAdvised``). A group whose ``replan_apply`` setting is on gets the re-plan's policy and job
  priorities applied by the orchestrator (``apply_settings``); moving jobs between groups stays ``plan --apply``.

The check runs the planner in a worker thread (its simulations are CPU work) and never more than one at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmd_timeslice.api.llmd_timeslice.v1alpha1 import orchestrator_info_pb2 as info_pb
from llmd_timeslice.placement.profile import ACCELERATOR_PHASES, DEFAULT_GAIN, DEFAULT_GAP, PhaseKind
from llmd_timeslice.placement.recorder import Hints, ProfileRecorder
from llmd_timeslice.placement.wire import costs_to_proto, profile_to_proto

if TYPE_CHECKING:  # the planner (numpy, its search) is imported by the first check of a plan: most stacks have none
    from llmd_timeslice.placement import replan
    from llmd_timeslice.placement.plan_file import Plan

log = logging.getLogger(__name__)

PHASE_METADATA = "x-llmd-timeslice-phase"
"""Acquire metadata: the phase the client acquires for (``rollout`` or ``train``)."""
ACCELERATORS_METADATA = "x-llmd-timeslice-accelerators"
"""Acquire metadata: the accelerators that phase needs."""
STATE_BYTES_METADATA = "x-llmd-timeslice-state-bytes"
"""Acquire metadata: the host bytes of that phase's worker while put aside."""
BUDGET_METADATA = "x-llmd-timeslice-slowdown-budget"
"""Acquire metadata: the job's slowdown budget (0.05 = 5 %)."""


def hints_from_metadata(metadata: Any) -> Hints:
    """The client's hints in an acquire's invocation metadata (malformed values are ignored)."""
    md = {k: v for k, v in (metadata or ())}

    def num(key: str, kind: type) -> Any:
        try:
            return kind(md[key]) if key in md else None
        except (TypeError, ValueError):
            return None

    phase = str(md.get(PHASE_METADATA))
    return Hints(
        phase=PhaseKind(phase) if phase in {str(k) for k in ACCELERATOR_PHASES} else None,
        accelerators=num(ACCELERATORS_METADATA, int),
        state_bytes=num(STATE_BYTES_METADATA, int),
        slowdown_budget=num(BUDGET_METADATA, float),
    )


@dataclass(frozen=True)
class CheckSettings:
    """The plan file to check (None: no check), seconds between checks, the gap and gain thresholds (fractions)."""

    plan_file: Path | None = None
    interval_s: float = 300.0
    gap: float = DEFAULT_GAP
    gain: float = DEFAULT_GAIN


class PlacementWatch:
    """Profiles, their persistence and service, and the plan check (module docstring).

    Args:
        settings: what to check and when.
        clock: unix seconds (default ``time.time``).
        apply_settings: called with ``(group_id, policy, job_priorities)`` for a group whose settings let the
            orchestrator apply a re-plan itself; returns whether it did (None: never applied).
    """

    def __init__(
        self,
        settings: CheckSettings | None = None,
        clock: Callable[[], float] = time.time,
        apply_settings: Callable[[str, str, dict[str, int]], bool] | None = None,
    ) -> None:
        self.settings = settings or CheckSettings()
        self.clock = clock
        self.recorder = ProfileRecorder(clock)
        self.apply_settings = apply_settings
        self.last: replan.Check | None = None
        self._plan: Plan | None = None
        self._window: tuple[float, dict[str, float]] | None = None  # start time, busy counters then
        self._checking = False

    # ------------------------------------------------------------------ lease events (the groups call these)
    def acquired(self, job: str, group: str, hints: Hints | None = None) -> None:
        self.recorder.acquired(job, group, hints)

    def granted(self, job: str, group: str) -> None:
        self.recorder.granted(job, group)

    def released(self, job: str, group: str, waiters: bool) -> None:
        self.recorder.released(job, group, waiters)

    def abandoned(self, job: str, group: str) -> None:
        self.recorder.abandoned(job, group)

    def switched(self, kind: str, seconds: float, served: bool) -> None:
        self.recorder.switched(kind, seconds, served)

    # ------------------------------------------------------------------ persistence
    def snapshot(self) -> dict[str, Any]:
        return self.recorder.snapshot()

    def restore(self, data: dict[str, Any] | None) -> int:
        return self.recorder.restore(data)

    # ------------------------------------------------------------------ the check
    def plan(self) -> Plan | None:
        """The plan in force (read again when its file changed; None: none configured or unreadable, logged once)."""
        path = self.settings.plan_file
        if path is None:
            return None
        from llmd_timeslice.placement.plan_file import PlanFileError, load_plan

        try:
            stamp = path.stat().st_mtime
            if self._plan is None or getattr(self, "_stamp", None) != stamp:
                self._plan, self._stamp = load_plan(path), stamp
                self._window = None
        except (OSError, PlanFileError) as exc:
            if self._plan is not None or not getattr(self, "_warned", False):
                log.warning("placement plan %s cannot be read: %s", path, exc)
                self._warned = True
            self._plan = None
        return self._plan

    def measured_duty_cycle(self, plan: Plan) -> float | None:
        """The plan's groups' duty cycle since the last call (None on the first: the window starts now)."""
        now = self.clock()
        busy = {g.group_id: self.recorder.busy_accelerator_s.get(g.group_id, 0.0) for g in plan.groups}
        prev, self._window = self._window, (now, busy)
        if prev is None or now <= prev[0]:
            return None
        acc = sum(g.accelerators for g in plan.groups)
        used = sum(busy[g] - prev[1].get(g, 0.0) for g in busy)
        return used / (acc * (now - prev[0])) if acc else None

    def check_now(self) -> replan.Check | None:
        """One check (blocking: the planner runs here). None: no plan, or the first window just started."""
        plan = self.plan()
        if plan is None:
            return None
        measured = self.measured_duty_cycle(plan)
        if measured is None:
            return None
        from llmd_timeslice.placement import replan

        res = replan.check(
            plan, str(self.settings.plan_file), self.recorder.profiles(), measured, self.settings.gap, self.settings.gain
        )
        self.last = res
        if res.replan_advised:
            log.warning(
                "event=ReplanAdvised plan=%s gain=%.3f changes=%s: %s", res.plan, res.replan_gain, res.changes, res.detail
            )
            self._apply(res)
        return res

    def _apply(self, res: replan.Check) -> None:
        if self.apply_settings is None or res.new_plan is None:
            return
        kept = {frozenset(g.jobs): g for g in self._plan.groups} if self._plan else {}
        for g in res.new_plan.groups:
            old = kept.get(frozenset(g.jobs))
            changed = old is not None and (old.policy != g.policy or old.job_priorities != g.job_priorities)
            if old is not None and changed and self.apply_settings(old.group_id, g.policy, dict(g.job_priorities)):
                log.warning("event=ReplanApplied group=%s policy=%s priorities=%s", old.group_id, g.policy, g.job_priorities)

    async def run(self) -> None:
        """Check every ``interval_s`` until cancelled (the planner in a worker thread)."""
        if self.settings.plan_file is None:
            return
        while True:
            await asyncio.sleep(self.settings.interval_s)
            if self._checking:
                continue
            self._checking = True
            try:
                await asyncio.to_thread(self.check_now)
            except Exception:
                log.exception("placement check failed")
            finally:
                self._checking = False

    # ------------------------------------------------------------------ serving
    def list_profiles(self, job_id: str = "") -> info_pb.ListProfilesResponse:
        profiles = [p for p in self.recorder.profiles() if not job_id or p.job_id == job_id]
        resp = info_pb.ListProfilesResponse(
            profiles=[profile_to_proto(p) for p in profiles], switch_costs=costs_to_proto(self.recorder.costs)
        )
        c = self.last
        if c is not None:
            resp.placement.CopyFrom(
                info_pb.PlacementCheck(
                    plan=c.plan,
                    checked_unix_s=c.checked_unix_s,
                    predicted_duty_cycle=c.predicted_duty_cycle,
                    measured_duty_cycle=c.measured_duty_cycle,
                    duty_cycle_gap=c.duty_cycle_gap,
                    replan_duty_cycle=c.replan_duty_cycle,
                    replan_gain=c.replan_gain,
                    replan_advised=c.replan_advised,
                    changes=c.changes,
                    detail=c.detail,
                    measured_slowdowns=c.measured_slowdowns,
                    predicted_slowdowns=c.predicted_slowdowns,
                )
            )
        elif self.settings.plan_file is not None:
            resp.placement.CopyFrom(info_pb.PlacementCheck(plan=str(self.settings.plan_file), detail="not checked yet"))
        return resp


class _Metrics:
    """Prometheus families of every registered watch (one per orchestrator in the process)."""

    def __init__(self) -> None:
        self.watches: list[PlacementWatch] = []

    def collect(self):
        phase = GaugeMetricFamily(
            "llmd_timeslice_job_phase_seconds",
            "Recorded duration of a job's phase (mean, p95 of the recent samples), seconds.",
            labels=["job", "phase", "stat"],
        )
        period = GaugeMetricFamily(
            "llmd_timeslice_job_period_seconds", "A job's recent mean iteration period, seconds.", labels=["job"]
        )
        busy = CounterMetricFamily(
            "llmd_timeslice_group_busy_accelerator_seconds",
            "Useful accelerator-seconds of a group's holders (each hold times its phase's accelerators).",
            labels=["group"],
        )
        duty = GaugeMetricFamily(
            "llmd_timeslice_placement_duty_cycle",
            "The placement plan's duty cycle: predicted, measured at the last check, and a re-plan's prediction.",
            labels=["source"],
        )
        advised = GaugeMetricFamily("llmd_timeslice_placement_replan_advised", "1 when the last check advised a re-plan.")
        gain = GaugeMetricFamily(
            "llmd_timeslice_placement_replan_gain", "A re-plan's predicted gain at the last check (relative)."
        )
        slowdown = GaugeMetricFamily(
            "llmd_timeslice_job_slowdown", "A job's measured period over its period alone, minus 1 (last check).", labels=["job"]
        )
        for w in self.watches:
            for p in w.recorder.profiles():
                for k in PhaseKind:
                    s = p.phase(k)
                    if s.samples_s:
                        phase.add_metric([p.job_id, str(k), "mean"], s.mean_s)
                        phase.add_metric([p.job_id, str(k), "p95"], s.quantile_s(0.95))
                if p.periods.samples_s:
                    period.add_metric([p.job_id], p.periods.mean_s)
            for g, v in sorted(w.recorder.busy_accelerator_s.items()):
                busy.add_metric([g], v)
            c = w.last
            if c is not None:
                duty.add_metric(["predicted"], c.predicted_duty_cycle)
                duty.add_metric(["measured"], c.measured_duty_cycle)
                if c.replan_duty_cycle:
                    duty.add_metric(["replan"], c.replan_duty_cycle)
                advised.add_metric([], 1.0 if c.replan_advised else 0.0)
                gain.add_metric([], c.replan_gain)
                for j, s in sorted(c.measured_slowdowns.items()):
                    slowdown.add_metric([j], s)
        yield from (phase, period, busy, duty, advised, gain, slowdown)


METRICS = _Metrics()
REGISTRY.register(METRICS)
