"""Profiles and switch costs on the wire (``OrchestratorInfoService.ListProfiles``, orchestrator_info.proto) and back
(no I/O)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ByteSize

from llmd_timeslice.api.llmd_timeslice.v1alpha1 import orchestrator_info_pb2 as info_pb
from llmd_timeslice.placement.profile import DEFAULT_SLOWDOWN_BUDGET, JobProfile, PhaseKind, PhaseStats
from llmd_timeslice.placement.recorder import SwitchCostStats

if TYPE_CHECKING:  # the planner (numpy) is imported where it is used: not by the orchestrator, which only serves
    from llmd_timeslice.placement.evaluate import SwitchCosts


def durations(kind: str, stats: PhaseStats) -> info_pb.PhaseDurations:
    return info_pb.PhaseDurations(kind=kind, count=stats.count, samples_s=stats.samples_s)


def stats_of(msg: info_pb.PhaseDurations) -> PhaseStats:
    return PhaseStats(count=msg.count, samples_s=list(msg.samples_s))


def profile_to_proto(p: JobProfile) -> info_pb.JobPhaseProfile:
    return info_pb.JobPhaseProfile(
        job_id=p.job_id,
        phases=[durations(str(k), s) for k, s in p.phases.items()],
        periods=durations("period", p.periods),
        accelerators={str(k): v for k, v in p.accelerators.items()},
        state_bytes={str(k): int(v) for k, v in p.state_bytes.items()},
        slowdown_budget=p.slowdown_budget if p.slowdown_budget != DEFAULT_SLOWDOWN_BUDGET else 0.0,
        groups=p.groups,
        updated_unix_s=p.updated_unix_s,
    )


def profile_of(msg: info_pb.JobPhaseProfile) -> JobProfile:
    """The profile a message carries (unknown phase kinds are skipped)."""
    kinds = PhaseKind._value2member_map_
    return JobProfile(
        job_id=msg.job_id,
        phases={PhaseKind(d.kind): stats_of(d) for d in msg.phases if d.kind in kinds},
        periods=stats_of(msg.periods),
        accelerators={PhaseKind(k): v for k, v in msg.accelerators.items() if k in kinds},
        state_bytes={PhaseKind(k): ByteSize(v) for k, v in msg.state_bytes.items() if k in kinds},
        slowdown_budget=msg.slowdown_budget or DEFAULT_SLOWDOWN_BUDGET,
        source="measured",
        groups=list(msg.groups),
        updated_unix_s=msg.updated_unix_s,
    )


def costs_to_proto(c: SwitchCostStats) -> info_pb.SwitchCosts:
    return info_pb.SwitchCosts(
        sleep=durations("sleep", c.sleep),
        wake=durations("wake", c.wake),
        handover=durations("handover", c.handover),
        served=c.served,
    )


def switch_costs_of(msg: info_pb.SwitchCosts) -> SwitchCosts | None:
    """The planner's switch costs from measured ones (medians; None when nothing was measured yet)."""
    sleep, wake, handover = stats_of(msg.sleep), stats_of(msg.wake), stats_of(msg.handover)
    if not (sleep.samples_s or wake.samples_s or handover.samples_s):
        return None
    from llmd_timeslice.placement.evaluate import SwitchCosts

    return SwitchCosts(
        grant_s=handover.quantile_s(0.5),
        served=msg.served,
        sleep_s=sleep.quantile_s(0.5),
        wake_s=wake.quantile_s(0.5),
    )
