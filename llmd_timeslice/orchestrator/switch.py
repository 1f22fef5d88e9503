"""What a phase switch does to the outside world, as the core sees it: the :class:`SwitchActions` ABC (no I/O
here; the record of a switch and the outcomes of its steps are :mod:`llmd_timeslice.domain.switches`).

The group machine (:mod:`llmd_timeslice.orchestrator.group`) calls, per switch:

* to a job: :meth:`SwitchActions.drain_samplers` (phase DRAINING), then
  :meth:`SwitchActions.suspend_samplers` (SUSPENDING);
* back to the samplers, a repair, a start-up reconcile or new samplers from discovery:
  :meth:`SwitchActions.resume_samplers` (RESUMING / REPAIRING);
* between switches (engine audit): :meth:`SwitchActions.read_engines`, and on a fault
  :meth:`SwitchActions.take_out_of_service` before the repair;
* samplers that left the group (discovery): :meth:`SwitchActions.retire_samplers`; groups still
  held at start-up: :meth:`SwitchActions.publish_asleep`.

Only ``suspend_samplers`` and ``resume_samplers`` are abstract; the rest are no-ops by default and
:attr:`SwitchActions.can_read_engines` says whether the engine audit can run (no ``hasattr`` probing).
The gRPC implementation is :class:`~llmd_timeslice.orchestrator.actions.GrpcSwitchActions`.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import ClassVar

from llmd_timeslice.domain.group_settings import GroupSpec, SamplerEndpoint
from llmd_timeslice.domain.switches import EngineReading, JobState, SwitchRecord


class SwitchActions(abc.ABC):
    """The outside world of a phase switch. Each method raises on failure (a :class:`SamplerStepFailed` where
    one sampler's step failed); the group machine decides what happens next."""

    can_read_engines: ClassVar[bool] = False
    """Whether :meth:`read_engines` reads the engines (the engine audit runs only then)."""

    async def drain_samplers(self, spec: GroupSpec, record: SwitchRecord) -> None:  # noqa: B027 (no-op default)
        """Stop the gates from steering new requests to ``spec.samplers`` and wait for the drain barrier
        (bounded by ``spec.drain_timeout_s``). Default: nothing to drain."""

    @abc.abstractmethod
    async def suspend_samplers(self, spec: GroupSpec, record: SwitchRecord) -> None:
        """Put every sampler's engine to sleep at ``record.sleep_level`` (0: ``spec.sleep_level``), verified."""

    @abc.abstractmethod
    async def resume_samplers(self, spec: GroupSpec, record: SwitchRecord) -> None:
        """Wake every sampler (loading ``record.weights`` if set), verify it and publish it SERVING; fill in
        ``record.sampler_versions`` / ``sampler_errors`` / ``weights_rejected``; raise if any failed."""

    async def read_engines(self, spec: GroupSpec) -> dict[str, EngineReading]:
        """Sampler address -> what its engine reports now (samplers that could not be read are left out)."""
        return {}

    async def take_out_of_service(self, spec: GroupSpec) -> None:  # noqa: B027
        """Stop the gates from steering new requests to ``spec.samplers`` (a fault found between switches)."""

    async def retire_samplers(self, samplers: list[SamplerEndpoint]) -> None:  # noqa: B027
        """``samplers`` left their group (discovery): out of service at the gates for good."""

    async def publish_asleep(self, spec: GroupSpec) -> None:  # noqa: B027
        """At start-up, for a group a job still holds: its samplers stay asleep and out of service."""

    def job_states(self) -> Mapping[str, JobState]:
        """Sampler address -> its job's last known state (for ``GetGroupStatus``)."""
        return {}

    async def close(self) -> None:  # noqa: B027
        """Release connections."""
