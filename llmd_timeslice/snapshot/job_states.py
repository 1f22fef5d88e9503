"""The states of a sidecar's job and the table of legal moves between them (pure; no I/O).

Names are the Snapshot Agent's (``snapshot_agent.proto`` ``JobState``): the sidecar reports them in
``GetStatus``. The sidecar owns these states (nothing outside writes them), so a move outside :data:`TRANSITIONS`
is a bug of the sidecar: :func:`move` raises :class:`IllegalJobTransition` naming both states (the operation in
progress then ends FAILED with that error, like any other crash of an operation). ``tests/snapshot/test_job_states.py``
walks every edge.

=================  ====================================================================================
state              meaning
=================  ====================================================================================
``IDLE``           upstream's state of a job without a workload; the sidecar never enters it (listed so
                   that every wire value has a name)
``RUNNING``        the engine serves (the job's start, a wake that ended, a workload that registered)
``TRANSITIONING``  an operation (snapshot: sleep; restore: wake) runs on it; one at a time per job
``SAVED``          asleep: its accelerator memory is released
``FAULTED``        the last operation failed (or a wake was refused: its engine is marked failed)
=================  ====================================================================================

Legal moves (the complete list):

* an operation: ``RUNNING|SAVED|FAULTED -start-> TRANSITIONING -> SAVED`` (a snapshot), ``RUNNING`` (a restore)
  or ``FAULTED`` (failed, timed out, cancelled); ``FAULTED -start->`` is a retry;
* a restore refused at once because the job's engine is marked failed: ``RUNNING|SAVED|FAULTED -> FAULTED``;
* a workload that registers on ``WorkloadChannel`` runs: ``IDLE|FAULTED -> RUNNING`` (``RUNNING`` and ``SAVED`` are
  kept, and so is ``TRANSITIONING``: the operation in progress sets the outcome).
"""

from __future__ import annotations

import enum
from types import MappingProxyType


class JobState(enum.StrEnum):
    """State of one job of the sidecar (the Snapshot Agent's ``JobState`` names; see the module docstring)."""

    IDLE = "IDLE"
    RUNNING = "RUNNING"
    TRANSITIONING = "TRANSITIONING"
    SAVED = "SAVED"
    FAULTED = "FAULTED"


J = JobState
TRANSITIONS: MappingProxyType[JobState, frozenset[JobState]] = MappingProxyType(
    {
        J.IDLE: frozenset({J.RUNNING}),
        J.RUNNING: frozenset({J.TRANSITIONING, J.FAULTED}),
        J.SAVED: frozenset({J.TRANSITIONING, J.FAULTED}),
        J.FAULTED: frozenset({J.TRANSITIONING, J.FAULTED, J.RUNNING}),
        J.TRANSITIONING: frozenset({J.SAVED, J.RUNNING, J.FAULTED}),
    }
)
"""From each state, the states a job may move to (see the module docstring)."""
del J


class IllegalJobTransition(RuntimeError):
    """A move of a job's state that :data:`TRANSITIONS` does not list (a bug of the sidecar)."""

    def __init__(self, job_id: str, current: JobState, target: JobState) -> None:
        allowed = ", ".join(sorted(TRANSITIONS[current])) or "none"
        super().__init__(f"job {job_id!r}: no move from {current} to {target} (from {current}: {allowed})")
        self.job_id, self.current, self.target = job_id, current, target


def move(states: dict[str, JobState], job_id: str, target: JobState) -> None:
    """Set ``states[job_id]`` to ``target`` if :data:`TRANSITIONS` allows it from its current state (a job not in
    ``states`` yet starts as ``IDLE``).

    Raises:
        IllegalJobTransition: the table has no such move; ``states`` is unchanged.
    """
    current = states.get(job_id, JobState.IDLE)
    if target not in TRANSITIONS[current]:
        raise IllegalJobTransition(job_id, current, target)
    states[job_id] = target
