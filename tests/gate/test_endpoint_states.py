"""The gate's endpoint-state table, edge by edge: every listed move is applied without a flag; every other one, on
an update, is flagged (counted per edge, logged naming both states) and still applied, because the orchestrator's
state stream is the one writer; a full snapshot (resync) is not checked."""

from __future__ import annotations

import logging

import pytest

from epp_plugin.gate.endpoints import TRANSITIONS, EndpointState
from epp_plugin.gate.pool_state import PoolState

EDGES = [(a, b) for a, targets in TRANSITIONS.items() for b in sorted(targets, key=lambda s: s.value)]
MISSING = [(a, b) for a in EndpointState for b in EndpointState if b not in TRANSITIONS[a]]
A = "10.0.0.1:8000"


def _pool_at(state: EndpointState) -> PoolState:
    pool = PoolState("p")
    pool.replace_states([(A, state, 1)])
    return pool


@pytest.mark.parametrize(("current", "target"), EDGES, ids=[f"{a.value}->{b.value}" for a, b in EDGES])
def test_every_listed_move_is_applied_without_a_flag(current, target):
    pool = _pool_at(current)
    pool.set_states([(A, target, 2)])
    assert pool.endpoints[A].state is target and pool.endpoints[A].weight_version == 2
    assert pool.table.unexpected_transitions == {}


@pytest.mark.parametrize(("current", "target"), MISSING, ids=[f"{a.value}->{b.value}" for a, b in MISSING])
def test_every_move_not_listed_is_flagged_and_applied(current, target, caplog):
    pool = _pool_at(current)
    with caplog.at_level(logging.WARNING, logger="epp_plugin.gate.endpoints"):
        pool.set_states([(A, target, None)])
    assert pool.table.unexpected_transitions == {(current, target): 1}
    assert f"update from {current.value} to {target.value} is not a move" in caplog.text
    assert pool.endpoints[A].state is target, "the orchestrator's state governs: the gate follows its one writer"


def test_the_missing_edges_are_the_ones_into_service_without_a_verified_wake():
    S = EndpointState  # noqa: N806
    assert set(MISSING) == {(S.ASLEEP, S.SERVING), (S.DRAINING, S.SERVING), (S.SERVING, S.WAKING)}
    assert set(TRANSITIONS) == set(EndpointState)


@pytest.mark.parametrize(("current", "target"), MISSING, ids=[f"{a.value}->{b.value}" for a, b in MISSING])
def test_a_full_snapshot_is_a_resync_and_not_checked(current, target):
    pool = _pool_at(current)
    pool.replace_states([(A, target, None)])
    assert pool.endpoints[A].state is target and pool.table.unexpected_transitions == {}


def test_the_switch_cycle_walks_the_table():
    S = EndpointState  # noqa: N806
    pool = _pool_at(S.SERVING)
    for state in (S.DRAINING, S.ASLEEP, S.WAKING, S.SERVING):
        pool.set_states([(A, state, None)])
    assert pool.serving() == (A,) and pool.table.unexpected_transitions == {}
