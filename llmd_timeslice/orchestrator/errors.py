"""Typed errors of the orchestrator's core; the gRPC edge (``service.py``) maps each to one status code."""

from __future__ import annotations


class OrchestratorError(Exception):
    """Base of typed errors; the gRPC edge maps each subclass to one status code."""


class UnknownGroup(OrchestratorError):
    """The group id is not in the inventory (NOT_FOUND)."""


class InvalidArgument(OrchestratorError):
    """A request field is missing or malformed (INVALID_ARGUMENT)."""


class NotHolder(OrchestratorError):
    """The job yields a group it does not hold, or acquires one it already holds (FAILED_PRECONDITION)."""


class AcquireTimedOut(OrchestratorError):
    """The caller's deadline passed while it waited in the queue (DEADLINE_EXCEEDED)."""


class SwitchFailed(OrchestratorError):
    """A phase switch step failed; the message says which and what state the group is in (ABORTED)."""


class StateNotSaved(SwitchFailed):
    """A grant could not be written to the state store, so it was taken back (ABORTED): a grant that would not
    survive a restart must not be handed out (the restarted orchestrator would wake samplers onto accelerators
    the job uses)."""


class GroupFault(SwitchFailed):
    """An unexpected exception (a bug) while the group handled a command; the group was put in a safe phase
    (its samplers out of service until the repair path woke and verified them) and the message names the
    command, the phase and the error (ABORTED: retry)."""


class LockOrderViolation(OrchestratorError):
    """A job holding (or waiting for) a sampler group asks for a trainer group (FAILED_PRECONDITION)."""


class StaleWeightVersion(OrchestratorError):
    """A published weight version is not newer than the group's latest one (FAILED_PRECONDITION)."""


class StaleFencingToken(OrchestratorError):
    """A call carries a fencing token that is not the group's current one (FAILED_PRECONDITION)."""


class StateConflict(RuntimeError):
    """The stored state changed since this orchestrator last read or wrote it: another orchestrator writes the
    same ConfigMap. Nothing was overwritten; the message names the object and what to check."""
