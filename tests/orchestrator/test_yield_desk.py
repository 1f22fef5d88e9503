"""The yield desk on its own (orchestrator/yield_desk.py): asks, policy refusals, the hold-deadline timer, honoured
yields, withdrawn gate asks. No group, no event loop: a ManualClock and a lease."""

from __future__ import annotations

from llmd_timeslice.domain.group_settings import GroupSpec
from llmd_timeslice.orchestrator.clock import ManualClock
from llmd_timeslice.orchestrator.lease import Lease
from llmd_timeslice.orchestrator.yield_desk import YieldDesk
from llmd_timeslice.orchestrator.yield_requests import YieldAsk


def _desk(**settings: object) -> tuple[YieldDesk, ManualClock, Lease, GroupSpec, list[int]]:
    clock = ManualClock()
    lease = Lease("A", token=7, ttl_s=30.0, granted_at=clock.now())
    return YieldDesk("g", clock), clock, lease, GroupSpec("g", **settings), []  # type: ignore[arg-type]


def test_an_operator_ask_sets_the_request_once_and_its_deadline_counts_ignored() -> None:
    desk, clock, lease, spec, fired = _desk(min_training_s=0)
    a = desk.ask(lease, "A", spec, YieldAsk("rollout", 10, 5.0), fired.append)
    assert a.requested and lease.yield_request is not None and desk.stats.sent == 1
    again = desk.ask(lease, "A", spec, YieldAsk("rollout", 10, 5.0), fired.append)
    assert again.requested and "already requested" in again.detail and desk.stats.sent == 1
    clock.advance(5.0)
    assert fired == [7], "the timer posts the deadline with the lease's token"
    desk.deadline(lease, 7, "A")
    desk.deadline(lease, 7, "A")
    assert lease.yield_request.ignored and desk.stats.ignored == 1, "ignored counts once"


def test_a_deadline_of_another_grant_counts_nothing() -> None:
    desk, _, lease, spec, fired = _desk(min_training_s=0)
    desk.ask(lease, "A", spec, YieldAsk("rollout", 10, 5.0), fired.append)
    desk.deadline(lease, 6, "A")
    assert desk.stats.ignored == 0 and not lease.yield_request.ignored


def test_a_policy_refusal_counts_suppressed_once_per_grant_for_gate_asks() -> None:
    desk, _, lease, spec, fired = _desk(min_training_s=10)
    gate = YieldAsk("held", 10, 4.0, pool="p", oldest_held_s=4.0, held=2, source="gate")
    a = desk.ask(lease, "A", spec, gate, fired.append)
    assert not a.requested and "min_training_s (10 s)" in a.detail and desk.stats.suppressed == 1
    desk.ask(lease, "A", spec, gate, fired.append)
    assert desk.stats.suppressed == 1, "the same grant, band and knob count once"
    desk.new_grant()
    desk.ask(lease, "A", spec, gate, fired.append)
    assert desk.stats.suppressed == 2 and lease.yield_request is None


def test_a_gate_ask_below_its_fraction_is_not_yet_due() -> None:
    desk, _, lease, spec, fired = _desk(min_training_s=0, yield_request_fraction=0.5)
    a = desk.ask(lease, "A", spec, YieldAsk("held", 10, 4.0, pool="p", oldest_held_s=1.0, source="gate"), fired.append)
    assert not a.requested and a.detail.startswith("not yet") and desk.stats.sent == 0


def test_a_gate_ask_whose_band_holds_nothing_withdraws_the_request_and_its_timer() -> None:
    desk, clock, lease, spec, fired = _desk(min_training_s=0)
    desk.ask(lease, "A", spec, YieldAsk("held", 10, 4.0, pool="p", oldest_held_s=4.0, source="gate"), fired.append)
    assert lease.yield_request is not None
    a = desk.ask(lease, "A", spec, YieldAsk("empty", 10, 4.0, pool="p", held=0, source="gate"), fired.append)
    assert not a.requested and lease.yield_request is None
    clock.advance(10.0)
    assert fired == [], "the withdrawn request's deadline timer was cancelled"


def test_an_honoured_yield_counts_and_restarts_min_training_from_it() -> None:
    desk, clock, lease, spec, fired = _desk(min_training_s=10)
    clock.advance(20.0)
    assert desk.ask(lease, "A", spec, YieldAsk("rollout", 10, 100.0), fired.append).requested
    clock.advance(1.0)
    desk.end(lease, "A", honoured=True)
    assert desk.stats.honoured == 1 and desk.last_honoured["A"] == clock.now()
    later = Lease("A", token=8, ttl_s=30.0, granted_at=clock.now() - 100)
    a = desk.ask(later, "A", spec, YieldAsk("again", 10, 100.0), fired.append)
    assert not a.requested and "min_training_s (10 s)" in a.detail, "counted from the honoured yield, not the grant"


def test_a_release_that_is_not_a_yield_counts_nothing() -> None:
    desk, _, lease, spec, fired = _desk(min_training_s=0)
    desk.ask(lease, "A", spec, YieldAsk("rollout", 10, 100.0), fired.append)
    desk.end(lease, "A", honoured=False)
    assert desk.stats.honoured == 0 and "A" not in desk.last_honoured
