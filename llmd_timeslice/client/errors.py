"""The TimeSlice client's exceptions, and the one place a failed gRPC call becomes one of them: by status code
and the orchestrator's ``google.rpc.ErrorInfo`` reason (``llmd_timeslice/error_info.py``), never by message text.
A reason's exception has the name of the orchestrator's error (``llmd_timeslice/orchestrator/errors.py``)."""

from __future__ import annotations

import grpc

from llmd_timeslice import error_info


class TimeSliceError(Exception):
    """Base of the client's errors. ``code``: the gRPC status code name of the failed call (e.g.
    ``"UNIMPLEMENTED"``; empty for a local error); ``reason``: the orchestrator's ``ErrorInfo`` reason (empty
    when it sent none)."""

    code: str = ""
    reason: str = ""


class AcquireTimeout(TimeSliceError):
    """Timed out waiting for the group (the lock was not granted)."""


class OrchestratorUnavailable(TimeSliceError):
    """The orchestrator could not be reached (address, network, or it is down)."""


class LeaseError(TimeSliceError):
    """The orchestrator refused the call (unknown group, not the holder, failed switch...)."""


class AuthError(LeaseError):
    """The orchestrator refused the client's credentials: no bearer token or a wrong one (gRPC
    UNAUTHENTICATED), or a token that may not act for this job (PERMISSION_DENIED, with per-job tokens).

    ``token_source`` (also in the message) says where the client took its token from: the ``token=`` or
    ``token_file=`` argument, ``$LLMD_TIMESLICE_TOKEN_FILE`` (and which file) or ``$LLMD_TIMESLICE_TOKEN``;
    or, when it sent none, everywhere it looked. A subclass of :class:`LeaseError`, which it was before.
    """

    def __init__(self, message: str, token_source: str = "") -> None:
        super().__init__(message)
        self.token_source = token_source


class LeaseLost(LeaseError):
    """This job's lease was reclaimed (heartbeats stopped or a newer grant exists): stop using the
    accelerators, restart from the last checkpoint and acquire again."""


class UnknownGroup(LeaseError):
    """The group id is not in the orchestrator's inventory (reason ``UNKNOWN_GROUP``, NOT_FOUND)."""


class InvalidArgument(LeaseError):
    """A request field is missing or malformed (reason ``INVALID_ARGUMENT``)."""


class NotHolder(LeaseError):
    """This job yields a group it does not hold, or acquires one it already holds (reason ``NOT_HOLDER``)."""


class SwitchFailed(LeaseError):
    """A phase switch step failed (reasons ``SWITCH_FAILED``, ``STATE_NOT_SAVED``, ``GROUP_FAULT``; ABORTED)."""


class LockOrderViolation(LeaseError, RuntimeError):
    """A job holding (or waiting for) a sampler group asks for a trainer group: refused by the orchestrator
    (reason ``LOCK_ORDER_VIOLATION``) or, before any call, by the role locks (``integrations.phase_callback``)."""


class StaleFencingToken(LeaseError):
    """The call's fencing token is not the group's current one (reason ``STALE_FENCING_TOKEN``)."""


class StaleWeightVersion(LeaseError):
    """A published weight version is not newer than the group's latest (reason ``STALE_WEIGHT_VERSION``)."""


_BY_REASON: dict[str, type[LeaseError]] = {
    "UNKNOWN_GROUP": UnknownGroup,
    "INVALID_ARGUMENT": InvalidArgument,
    "NOT_HOLDER": NotHolder,
    "SWITCH_FAILED": SwitchFailed,
    "STATE_NOT_SAVED": SwitchFailed,
    "GROUP_FAULT": SwitchFailed,
    "LOCK_ORDER_VIOLATION": LockOrderViolation,
    "STALE_FENCING_TOKEN": StaleFencingToken,
    "STALE_WEIGHT_VERSION": StaleWeightVersion,
}
"""``google.rpc.ErrorInfo.reason`` (orchestrator ``errors.py`` class names, ``llmd_timeslice/error_info.py``) ->
client exception; an unknown reason is a plain :class:`LeaseError`."""


def translate(exc: grpc.RpcError, what: str, token_source: str = "") -> TimeSliceError:
    """The client exception for a failed call, chosen by status code and the orchestrator's ``ErrorInfo`` reason
    (never by message text): UNAUTHENTICATED/PERMISSION_DENIED -> :class:`AuthError`; DEADLINE_EXCEEDED ->
    :class:`AcquireTimeout`; a reason -> its exception of the same name; UNAVAILABLE with no reason (the call
    never reached an orchestrator that answered) -> :class:`OrchestratorUnavailable`; else :class:`LeaseError`."""
    err = _choose(exc, what, token_source)
    err.code = exc.code().name
    info = error_info.error_info(_trailing(exc))
    err.reason = info.reason if info is not None else ""
    return err


def _trailing(exc: grpc.RpcError):
    return exc.trailing_metadata() if callable(getattr(exc, "trailing_metadata", None)) else None


def _choose(exc: grpc.RpcError, what: str, token_source: str) -> TimeSliceError:
    code = exc.code()
    text = exc.details()
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return AuthError(f"{what}: {code.name}: {text}" + (f"; {token_source}" if token_source else ""), token_source)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return AcquireTimeout(f"{what}: timed out waiting ({text})")
    info = error_info.error_info(_trailing(exc))
    if info is not None:
        return _BY_REASON.get(info.reason, LeaseError)(f"{what}: {code.name}: {text}")
    if code == grpc.StatusCode.UNAVAILABLE:
        return OrchestratorUnavailable(f"{what}: orchestrator unreachable: {text}")
    return LeaseError(f"{what}: {code.name}: {text}")
