"""The phases of one accelerator group and the table of legal moves between them (pure; no I/O).

Each group is run by one task (:class:`~llmd_timeslice.orchestrator.group.Group`) that takes
commands from a queue, one at a time; every change of phase is checked against
:data:`TRANSITIONS` and an illegal one raises :class:`IllegalTransition`, naming the phase and the
command. A reader answers "what can happen next" from that table; ``tests/orchestrator/test_group_machine.py``
walks every edge of it.

Phases (field terms; the wire keeps the upstream ``GroupStatus.State`` values, see :data:`WIRE_STATE`):

=================  =====================================================================  ============
phase              meaning                                                                wire state
=================  =====================================================================  ============
``FREE``           no samplers, nobody holds, no job's context loaded                     IDLE
``SERVING``        the samplers hold the accelerators and every one is in service         IDLE
``OUT_OF_SERVICE`` the samplers hold the accelerators, at least one is out of service     IDLE
                   (failed wake, rejected load, audit fault); a repair tick re-wakes it
``DRAINING``       the gates stop steering to the samplers; drain barrier                 SWITCHING
``SUSPENDING``     the sidecars put the engines to sleep, verified                        SWITCHING
``HELD``           a job holds the lease (samplers asleep)                                LOCKED
``DEFERRED``       no samplers; the last holder's context stays loaded (deferred          IDLE_YIELDED
                   snapshot) and its next acquire returns at once
``RESUMING``       the samplers wake (loading a weight version), verified, and are        SWITCHING
                   published SERVING one by one
``REPAIRING``      the out-of-service samplers are woken again                            SWITCHING
=================  =====================================================================  ============

Legal sequences (the table below is the complete list):

* a sampler group: ``SERVING -acquire-> DRAINING -drained-> SUSPENDING -suspended-> HELD``;
  ``HELD -yield|lease expired-> HELD`` (the next waiter gets it, samplers stay asleep) or
  ``-> RESUMING -resumed-> SERVING | OUT_OF_SERVICE | DRAINING`` (someone queued meanwhile);
* a failed drain or sleep: ``DRAINING|SUSPENDING -failed-> RESUMING`` (the acquire fails, the samplers
  are woken again: a rollback);
* repair: ``OUT_OF_SERVICE -repair tick | probed (engine back)-> REPAIRING -repaired-> SERVING |
  OUT_OF_SERVICE | DRAINING``; the engine audit: ``SERVING -audited (fault)-> REPAIRING``;
* a group without samplers: ``FREE|DEFERRED -acquire-> HELD -yield-> HELD | DEFERRED``;
* a sampler whose engine was down at the sleep (it holds no accelerator memory) is left out of it and the grant
  goes on; while ``HELD`` the audit probes it (``-audit tick-> -probed->``) and puts it to sleep once it answers
  (``-returned-> HELD``), so it never serves, nor keeps memory, while the job holds the accelerators;
* discovery: ``-spec update->`` applies at once in ``FREE, SERVING, OUT_OF_SERVICE, HELD, DEFERRED``
  (new samplers of an idle group are woken: ``-> RESUMING``; a group left without samplers becomes
  ``FREE``) and waits for the next of those phases otherwise;
* a yield request (``-yield request->``, the gates' hold pressure or ``RequestYield``) is taken in any phase
  and stays put; in ``HELD`` it may mark the holder's lease, ``-yield deadline->`` (its timer) counts it ignored;
* a waiter that gives up (``-abandon->``) leaves the queue in any phase; if it was the one a switch was
  for, the switch grants the next waiter, or wakes the samplers again when nobody waits any more;
* start-up: ``SERVING -start-> RESUMING`` (reconcile: wake and verify), ``HELD -start-> HELD`` (a
  restored holder: samplers stay asleep);
* a grant whose state could not be saved is taken back: ``HELD -grant not saved-> HELD | RESUMING |
  FREE`` (the waiter gets the error; the next waiter is granted, or the samplers are woken again);
* an unexpected exception in a handler (a bug): ``-internal error-> OUT_OF_SERVICE`` from every phase
  where the samplers' state may be half-changed (the repair timer wakes and verifies them), ``HELD`` stays
  ``HELD`` while its holder's lease is intact, a half-granted or half-released lease is reclaimed
  (``-> OUT_OF_SERVICE | FREE``), ``FREE|DEFERRED`` stay put unless samplers were being added. Except
  for a kept lease, every waiter and the switch in flight get the error
  (:class:`~llmd_timeslice.orchestrator.errors.GroupFault`).

Commands that a phase does not list are refused (:class:`IllegalTransition`), except the ones in
:data:`IGNORED`: late timer ticks and results of advisory reads, which a phase change made stale.
"""

from __future__ import annotations

import enum
from types import MappingProxyType

from llmd_timeslice.orchestrator.errors import OrchestratorError


class GroupPhase(enum.Enum):
    """Phase of one group (see the module docstring)."""

    FREE = "free"
    SERVING = "serving"
    OUT_OF_SERVICE = "out_of_service"
    DRAINING = "draining"
    SUSPENDING = "suspending"
    HELD = "held"
    DEFERRED = "deferred"
    RESUMING = "resuming"
    REPAIRING = "repairing"


class GroupState(enum.Enum):
    """The wire projection of a phase, in the llm-d orchestrator's vocabulary (``GroupStatus.State``)."""

    IDLE = "IDLE"
    IDLE_YIELDED = "IDLE_YIELDED"
    LOCKED = "LOCKED"
    SWITCHING = "SWITCHING"


WIRE_STATE: MappingProxyType[GroupPhase, GroupState] = MappingProxyType(
    {
        GroupPhase.FREE: GroupState.IDLE,
        GroupPhase.SERVING: GroupState.IDLE,
        GroupPhase.OUT_OF_SERVICE: GroupState.IDLE,
        GroupPhase.DRAINING: GroupState.SWITCHING,
        GroupPhase.SUSPENDING: GroupState.SWITCHING,
        GroupPhase.HELD: GroupState.LOCKED,
        GroupPhase.DEFERRED: GroupState.IDLE_YIELDED,
        GroupPhase.RESUMING: GroupState.SWITCHING,
        GroupPhase.REPAIRING: GroupState.SWITCHING,
    }
)

STABLE_PHASES = frozenset({GroupPhase.FREE, GroupPhase.SERVING, GroupPhase.OUT_OF_SERVICE, GroupPhase.HELD, GroupPhase.DEFERRED})
"""Phases with no phase switch in flight: a spec update applies at once in them."""

SAMPLERS_LOADED = frozenset(
    {GroupPhase.SERVING, GroupPhase.OUT_OF_SERVICE, GroupPhase.RESUMING, GroupPhase.REPAIRING, GroupPhase.DRAINING}
)
"""Phases in which the samplers hold the accelerators (awake, or some of them being woken)."""


class GroupCommand(enum.Enum):
    """What a group's task consumes. The first group comes from outside (servicers, timers, discovery);
    the second are the results of the group's own steps (drain, sleep, wake, reads)."""

    ACQUIRE = "acquire"
    ABANDON = "abandon"
    YIELD = "yield"
    HEARTBEAT = "heartbeat"
    PUBLISH_WEIGHTS = "publish_weights"
    LEASE_EXPIRED = "lease_expired"
    SPEC_UPDATE = "spec_update"
    AUDIT_TICK = "audit_tick"
    REPAIR_TICK = "repair_tick"
    START = "start"
    DRAINED = "drained"
    DRAIN_FAILED = "drain_failed"
    SUSPENDED = "suspended"
    SUSPEND_FAILED = "suspend_failed"
    RESUMED = "resumed"
    REPAIRED = "repaired"
    AUDITED = "audited"
    PROBED = "probed"
    GRANT_NOT_SAVED = "grant_not_saved"
    RETURNED = "returned"
    """While a job holds the group: a sampler whose engine was down at the sleep answered again and was put to
    sleep (or that sleep failed); issue 38 §5."""
    YIELD_REQUEST = "yield_request"
    """Ask the holder to yield at its next safe point (the gates' hold pressure, ``RequestYield``); taken in every
    phase (stays put): only ``HELD`` has a holder to ask, the others answer so."""
    YIELD_DEADLINE = "yield_deadline"
    """Timer: the hold deadline of a yield request's band passed (the request counts ``ignored`` if still set)."""
    INTERNAL_ERROR = "internal_error"
    """Not queued: the group's task takes this move itself when a handler raised an unexpected exception (a
    bug), to leave the group in a safe phase (see :data:`TRANSITIONS` and docs/architecture.md)."""


P, C = GroupPhase, GroupCommand

TRANSITIONS: MappingProxyType[tuple[GroupPhase, GroupCommand], frozenset[GroupPhase]] = MappingProxyType(
    {
        key: frozenset(nexts)
        for key, nexts in {
            # no samplers, nothing loaded
            (P.FREE, C.ACQUIRE): {P.HELD},
            (P.FREE, C.SPEC_UPDATE): {P.FREE, P.RESUMING},
            (P.FREE, C.START): {P.FREE},
            # samplers serving
            (P.SERVING, C.ACQUIRE): {P.DRAINING},
            (P.SERVING, C.SPEC_UPDATE): {P.SERVING, P.RESUMING, P.FREE},
            (P.SERVING, C.AUDIT_TICK): {P.SERVING},
            (P.SERVING, C.AUDITED): {P.SERVING, P.REPAIRING},
            (P.SERVING, C.START): {P.SERVING, P.RESUMING},
            # samplers loaded, some out of service
            (P.OUT_OF_SERVICE, C.ACQUIRE): {P.DRAINING},
            (P.OUT_OF_SERVICE, C.SPEC_UPDATE): {P.OUT_OF_SERVICE, P.SERVING, P.RESUMING, P.FREE},
            (P.OUT_OF_SERVICE, C.REPAIR_TICK): {P.REPAIRING},
            (P.OUT_OF_SERVICE, C.AUDIT_TICK): {P.OUT_OF_SERVICE},
            (P.OUT_OF_SERVICE, C.PROBED): {P.OUT_OF_SERVICE, P.REPAIRING},
            # drain barrier
            (P.DRAINING, C.DRAINED): {P.SUSPENDING},
            (P.DRAINING, C.DRAIN_FAILED): {P.RESUMING},
            (P.DRAINING, C.ACQUIRE): {P.DRAINING},
            (P.DRAINING, C.SPEC_UPDATE): {P.DRAINING},
            # engines going to sleep
            (P.SUSPENDING, C.SUSPENDED): {P.HELD, P.RESUMING},
            (P.SUSPENDING, C.SUSPEND_FAILED): {P.RESUMING},
            (P.SUSPENDING, C.ACQUIRE): {P.SUSPENDING},
            (P.SUSPENDING, C.SPEC_UPDATE): {P.SUSPENDING},
            # a job holds the lease
            (P.HELD, C.YIELD): {P.HELD, P.RESUMING, P.DEFERRED},
            (P.HELD, C.LEASE_EXPIRED): {P.HELD, P.RESUMING, P.DEFERRED},
            (P.HELD, C.GRANT_NOT_SAVED): {P.HELD, P.RESUMING, P.FREE},
            (P.HELD, C.HEARTBEAT): {P.HELD},
            (P.HELD, C.PUBLISH_WEIGHTS): {P.HELD},
            (P.HELD, C.ACQUIRE): {P.HELD},
            (P.HELD, C.SPEC_UPDATE): {P.HELD},
            (P.HELD, C.START): {P.HELD},
            (P.HELD, C.YIELD_DEADLINE): {P.HELD},
            # a sampler left out of the sleep (engine down) is probed, and put to sleep once it answers again
            (P.HELD, C.AUDIT_TICK): {P.HELD},
            (P.HELD, C.PROBED): {P.HELD},
            (P.HELD, C.RETURNED): {P.HELD},
            # deferred snapshot (no samplers)
            (P.DEFERRED, C.ACQUIRE): {P.HELD},
            (P.DEFERRED, C.SPEC_UPDATE): {P.DEFERRED, P.RESUMING},
            (P.DEFERRED, C.START): {P.DEFERRED},
            # samplers waking
            (P.RESUMING, C.RESUMED): {P.SERVING, P.OUT_OF_SERVICE, P.DRAINING},
            (P.RESUMING, C.ACQUIRE): {P.RESUMING},
            (P.RESUMING, C.SPEC_UPDATE): {P.RESUMING},
            # out-of-service samplers waking
            (P.REPAIRING, C.REPAIRED): {P.SERVING, P.OUT_OF_SERVICE, P.DRAINING},
            (P.REPAIRING, C.ACQUIRE): {P.REPAIRING},
            (P.REPAIRING, C.SPEC_UPDATE): {P.REPAIRING},
            # a waiter gives up (deadline, disconnect): it leaves the queue, in any phase
            **{(p, C.ABANDON): {p} for p in GroupPhase},
            # a yield request (hold pressure from the gates, RequestYield): only HELD has a holder to mark
            **{(p, C.YIELD_REQUEST): {p} for p in GroupPhase},
            # an unexpected exception while handling a command (a bug): waiters and the switch in flight fail,
            # and the group goes where the repair path takes over. Samplers whose state is unknown are marked
            # out of service (OUT_OF_SERVICE; the repair timer wakes and verifies them); a job whose lease is
            # intact keeps it (HELD); a lease left half-granted or half-released is reclaimed with the reason
            # kept for the job's next call (OUT_OF_SERVICE, or FREE without samplers).
            (P.FREE, C.INTERNAL_ERROR): {P.FREE, P.OUT_OF_SERVICE},
            (P.SERVING, C.INTERNAL_ERROR): {P.OUT_OF_SERVICE},
            (P.OUT_OF_SERVICE, C.INTERNAL_ERROR): {P.OUT_OF_SERVICE},
            (P.DRAINING, C.INTERNAL_ERROR): {P.OUT_OF_SERVICE},
            (P.SUSPENDING, C.INTERNAL_ERROR): {P.OUT_OF_SERVICE},
            (P.HELD, C.INTERNAL_ERROR): {P.HELD, P.OUT_OF_SERVICE, P.FREE},
            (P.DEFERRED, C.INTERNAL_ERROR): {P.DEFERRED, P.OUT_OF_SERVICE},
            (P.RESUMING, C.INTERNAL_ERROR): {P.OUT_OF_SERVICE},
            (P.REPAIRING, C.INTERNAL_ERROR): {P.OUT_OF_SERVICE},
        }.items()
    }
)
"""(phase, command) -> the phases the command may lead to (the current one where it stays)."""

IGNORED: frozenset[tuple[GroupPhase, GroupCommand]] = frozenset(
    {
        (p, c)
        for p in GroupPhase
        for c in (C.AUDIT_TICK, C.REPAIR_TICK, C.AUDITED, C.PROBED, C.LEASE_EXPIRED, C.YIELD_DEADLINE, C.RETURNED)
    }
    - set(TRANSITIONS)
)
"""Late timer ticks and stale advisory results: dropped without a transition (not an error)."""


class IllegalTransition(OrchestratorError):
    """A command arrived in a phase that does not accept it, or led to a phase the table does not list
    (a bug in the orchestrator, or a caller acting out of turn); the message names both (FAILED_PRECONDITION)."""

    def __init__(self, group_id: str, phase: GroupPhase, command: GroupCommand, to: GroupPhase | None = None) -> None:
        self.group_id, self.phase, self.command, self.to = group_id, phase, command, to
        allowed = sorted(p.name for p in TRANSITIONS.get((phase, command), ()))
        if to is None:
            accepted = sorted(c.name for (p, c) in TRANSITIONS if p is phase)
            msg = (
                f"group {group_id!r}: command {command.name} is not accepted in phase {phase.name} "
                f"(accepted there: {', '.join(accepted)})"
            )
        else:
            msg = (
                f"group {group_id!r}: {command.name} in phase {phase.name} cannot lead to {to.name} "
                f"(legal: {', '.join(allowed) or 'none'})"
            )
        super().__init__(msg)


def accepts(phase: GroupPhase, command: GroupCommand) -> bool:
    """Whether ``command`` is handled in ``phase`` (ignored ones are not)."""
    return (phase, command) in TRANSITIONS


def check(group_id: str, phase: GroupPhase, command: GroupCommand, to: GroupPhase) -> None:
    """Raise :class:`IllegalTransition` unless ``phase -command-> to`` is in :data:`TRANSITIONS`."""
    if to not in TRANSITIONS.get((phase, command), frozenset()):
        raise IllegalTransition(group_id, phase, command, to)
