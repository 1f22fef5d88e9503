"""The snapshot backend interface: suspend / resume / state, with capability flags and a factory.

Shaped like vLLM's sleep-mode backends: callers can ask what a backend supports (class-level
``supported_modes``) without building it. Backends are chosen by name through one explicit registry,
:data:`llmd_timeslice.snapshot.backends.registry.SNAPSHOT_BACKENDS`.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from llmd_timeslice.weights.update import WeightUpdate


class SuspendMode(enum.Enum):
    """What happens to device state (upstream ``SuspendMode``)."""

    OFFLOAD = 1  # kept in host memory (vLLM sleep level 1)
    DISCARD = 2  # dropped; the app re-provisions (vLLM sleep level 2, then weight reload/sync)


class BackendError(Exception):
    """A backend step failed or its verification did not hold; the message says what to do."""


class EngineUnreachable(BackendError):
    """The workload refused the connection: nothing listens at its address (down, or restarting)."""


class EngineDead(EngineUnreachable):
    """The workload's API server answers but the engine behind it is dead (vLLM: the engine core process exited,
    ``GET /health`` answers 503). Like :class:`EngineUnreachable` for the engine audit: nothing can serve there
    until the engine (its pod) restarts."""


class EnginePaused(BackendError):
    """The workload is awake but its scheduler is paused (a ``/pause`` without the matching ``/resume``):
    requests sent to it would wait. The endpoint stays out of service until the pause is lifted."""


class WeightVersionRejected(BackendError):
    """A weight version failed verification or loading (:meth:`SnapshotBackend.resume_with_weights`); the
    workload can still serve its last good version (a plain :meth:`SnapshotBackend.resume` reloads it)."""


@dataclass(frozen=True)
class SleepResidual:
    """What one sleep left on the device: ``bytes`` after it settled (or when time was up), ``before`` the sleep,
    the ``budget`` it was checked against (None: no budget yet, the first sleep at that level), its ``source``
    (``group`` absolute budget or ``first_sleep`` + margin), the ``scope`` of the readings and the sleep ``level``."""

    bytes: int
    before: int
    budget: int | None
    source: str
    scope: str
    level: int
    waited_s: float

    @property
    def freed(self) -> int:
        return self.before - self.bytes


@dataclass
class SuspendResult:
    """Bytes figures are optional: ``None`` where the backend cannot measure them. ``parked_requests``: requests
    found inside the workload after it was verified suspended, and ``parked_action`` what was done with them
    (``"aborted"`` or ``"kept"``; "" when none)."""

    storage_bytes: int | None = None
    device_bytes_freed: int | None = None
    parked_requests: int = 0
    parked_action: str = ""
    residual: SleepResidual | None = None
    """The device memory the workload still holds after the suspend, checked against its budget (None: not read)."""


class SnapshotBackend(abc.ABC):
    """One workload's suspend/resume. Every call verifies its effect before returning."""

    name: ClassVar[str]
    supported_modes: ClassVar[tuple[SuspendMode, ...]] = (SuspendMode.OFFLOAD,)
    target: ClassVar[str] = "endpoint"
    """What an instance is built for: ``endpoint`` (an engine's HTTP API: ``base_url``), ``pids`` (processes:
    ``pids``) or ``channel`` (a workload that registers itself over WorkloadChannel)."""
    checks_residual: ClassVar[bool] = False
    """Whether :meth:`suspend` checks the device memory left and takes ``residual_budget_bytes`` (vllm, sglang)."""
    supports_weight_sync: ClassVar[bool] = False
    """Whether :meth:`resume_with_weights` can load a new weight version between the wake-ups."""

    @abc.abstractmethod
    async def suspend(self, mode: SuspendMode, tags: list[str]) -> SuspendResult:
        """Free the accelerator; raise :class:`BackendError` unless verified suspended. Backends that check the
        memory left (``checks_residual``) also take ``residual_budget_bytes`` (the group's budget for the level)."""

    @abc.abstractmethod
    async def resume(self, tags: list[str]) -> None:
        """Bring the workload back; raise :class:`BackendError` unless verified serving."""

    async def resume_with_weights(self, tags: list[str], weights: WeightUpdate) -> None:
        """Wake, loading weight version ``weights`` before the workload serves again; raise
        :class:`BackendError` unless verified serving that version (only where ``supports_weight_sync``)."""
        raise BackendError(f"backend {self.name!r} cannot load weights; use a backend with weight sync (vllm)")

    async def served_weight_version(self) -> str | None:
        """The weight version label the workload reports now, read from the workload itself (None where it
        has none). Raises :class:`BackendError` when the workload does not answer."""
        return None

    @abc.abstractmethod
    async def is_suspended(self) -> bool:
        """Current state as read from the workload itself."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release clients and connections."""
