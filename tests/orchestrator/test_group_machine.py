"""The group state machine (orchestrator/phases.py, groups.py) with scripted switch actions and a manual clock:
every edge of the transition table is walked (the scenarios: group_edges.py, group_fault_edges.py,
group_yield_edges.py; the harness: group_machine_support.py), illegal commands are refused naming phase and command.
The timers: test_group_timers.py; persistence: test_group_persistence.py; the group's tasks: test_group_tasks.py."""

from __future__ import annotations

import asyncio
import logging

import pytest

from llmd_timeslice.orchestrator.errors import GroupFault, NotHolder
from llmd_timeslice.orchestrator.groups import Command
from llmd_timeslice.orchestrator.phases import (
    IGNORED,
    TRANSITIONS,
    WIRE_STATE,
    GroupPhase,
    GroupState,
    IllegalTransition,
)
from tests.orchestrator import group_edges, group_fault_edges, group_yield_edges
from tests.orchestrator.group_machine_support import (
    Bug,
    C,
    Env,
    P,
)

SCENARIOS = [
    v
    for k, v in sorted({k: v for m in (group_edges, group_fault_edges, group_yield_edges) for k, v in vars(m).items()}.items())
    if k.startswith("_")
    and k[1:2].islower()
    and callable(v)
    and getattr(v, "__code__", None) is not None
    and v.__code__.co_varnames[:1] == ("e",)
]


async def test_every_edge_of_the_transition_table_is_walked():
    """Each scenario runs on a fresh orchestrator; together they take every (phase, command, next phase) edge of
    phases.TRANSITIONS, and no move outside it."""
    walked: set = set()
    for scenario in SCENARIOS:
        env = Env()
        try:
            await asyncio.wait_for(scenario(env), 10)
        except Exception as exc:
            raise AssertionError(f"scenario {scenario.__name__} failed: {exc!r}") from exc
        finally:
            await env.close()
        walked |= env.edges
    table = {(p, c, to) for (p, c), tos in TRANSITIONS.items() for to in tos}
    assert walked <= table
    missing = sorted((p.name, c.name, to.name) for p, c, to in table - walked)
    assert not missing, f"edges never walked: {missing}"


async def test_a_command_out_of_turn_is_refused_naming_phase_and_command():
    e = Env()
    try:
        with pytest.raises(IllegalTransition, match=r"command DRAINED is not accepted in phase SERVING"):
            await e.g().ask(Command(C.DRAINED))
        with pytest.raises(NotHolder, match="does not hold group 't'"):  # a job command out of turn: no holder
            await e.orch.yield_("A", "t")
        assert (P.SERVING, C.REPAIR_TICK) in IGNORED
        e.g().post(Command(C.REPAIR_TICK))  # a late tick: dropped, not an error
        await e.held()  # the group works on
        assert e.g().holder == "A"
    finally:
        await e.close()


async def test_an_internal_error_is_logged_at_error_naming_group_command_and_phase(caplog):
    e = Env()
    try:
        await e.held()
        e.boom[("s", P.HELD, C.YIELD, P.RESUMING)] = Bug("boom")
        with caplog.at_level(logging.ERROR, logger="llmd_timeslice.orchestrator.group"), pytest.raises(GroupFault):
            await e.orch.yield_("A", "s")
        rec = next(r for r in caplog.records if "internal error" in r.getMessage())
        assert rec.levelno == logging.ERROR and rec.exc_info is not None
        assert "group=s internal error in YIELD during phase HELD: Bug('boom')" in rec.getMessage()
        assert e.g().last_error.endswith("the group went to OUT_OF_SERVICE")
    finally:
        await e.close()


def test_every_phase_has_a_wire_state_and_the_table_names_only_known_phases():
    assert set(WIRE_STATE) == set(GroupPhase)
    assert {WIRE_STATE[p] for p in GroupPhase} == set(GroupState)
    for (p, c), tos in TRANSITIONS.items():
        assert tos and (p, c) not in IGNORED
