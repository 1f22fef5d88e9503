"""TimeSlice client used inside RL loops: ``acquire`` / ``release`` and ``on_accelerators``."""

from llmd_timeslice.client.client import (
    AcquireResult,
    AcquireTimeout,
    AsyncTimeSliceOrchestratorClient,
    AuthError,
    LeaseError,
    LeaseLost,
    OrchestratorUnavailable,
    TimeSliceError,
    TimeSliceOrchestratorClient,
    YieldRequested,
    YieldResult,
)

__all__ = [
    "AcquireResult",
    "AcquireTimeout",
    "AsyncTimeSliceOrchestratorClient",
    "AuthError",
    "LeaseError",
    "LeaseLost",
    "OrchestratorUnavailable",
    "TimeSliceError",
    "TimeSliceOrchestratorClient",
    "YieldRequested",
    "YieldResult",
]
