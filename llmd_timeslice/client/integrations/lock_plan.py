"""The role locks' plan and inputs, without I/O: phases and roles, the errors, the checked ``TIMESLICE_*``
configuration, which groups a role takes (:class:`_LockPlan`) and the weight version a phase hands over. Used by
:mod:`~llmd_timeslice.client.integrations.phase_callback` (its docstring says what each means upstream)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmd_timeslice.addresses import check_host_port
from llmd_timeslice.client import LeaseLost, LockOrderViolation, TimeSliceError
from llmd_timeslice.weights.update import SOURCE_FILES, WeightUpdate

log = logging.getLogger("llmd_timeslice.client.integrations.phase_callback")

ENV_JOB_ID = "TIMESLICE_JOB_ID"
ENV_ORCH_ADDR = "TIMESLICE_ORCH_ADDR"
ENV_TRAINER_GROUP = "TIMESLICE_TRAINER_GROUP"
ENV_SAMPLER_GROUP = "TIMESLICE_SAMPLER_GROUP"
ENV_WEIGHTS_DIR = "LLMD_TIMESLICE_WEIGHTS_DIR"
"""Project variable: where ``context["model"]`` weight versions are written (``<dir>/v<N>``)."""

TRAINER = "trainer"
SAMPLER = "sampler"
BOTH = "both"
ROLES = (TRAINER, SAMPLER, BOTH)

PHASES: dict[str, str] = {
    "init": BOTH,
    "generate": SAMPLER,
    "train": TRAINER,
    "weight_sync": BOTH,
    "save": TRAINER,
    "offload": SAMPLER,
    "onload": SAMPLER,
    "eval": SAMPLER,
    "create": TRAINER,
}
"""Phase -> the role upstream's drivers pass with it (guide table + slime callback docstring). Any role may be
passed with any known phase, as upstream allows; the phase name is checked, the role decides the locks."""

DEFAULT_ACQUIRE_TIMEOUT_S = 600.0
"""Seconds an acquire may wait for its group before :class:`~llmd_timeslice.client.AcquireTimeout` (upstream's
``DEFAULT_ACQUIRE_TIMEOUT_SEC``)."""


class TimeSliceConfigError(TimeSliceError):
    """The time-slicing environment is incomplete or names groups the orchestrator does not know."""


TimesliceConfigError = TimeSliceConfigError
"""Deprecated alias of :class:`TimeSliceConfigError` (its old spelling, public in ``integrations``)."""
LockOrderError = LockOrderViolation
"""Deprecated alias of :class:`~llmd_timeslice.client.LockOrderViolation` (the role locks' old name for it; the
trainer group was asked for while only the sampler group is held: the global order is trainer first)."""


class UnknownPhase(TimeSliceError, ValueError):
    """A phase name outside :data:`PHASES`."""


class UnknownRole(TimeSliceError, ValueError):
    """A role outside :data:`ROLES`."""


def check_phase(phase: str, role: str) -> None:
    """Raise :class:`UnknownPhase` / :class:`UnknownRole` naming the known ones."""
    if phase not in PHASES:
        raise UnknownPhase(f"unknown phase {phase!r}; known phases: {', '.join(PHASES)}")
    if role not in ROLES:
        raise UnknownRole(f"unknown role {role!r} (phase {phase!r}); known roles: {', '.join(ROLES)}")


class _LockPlan:
    """Which groups a role takes and gives back: no I/O, shared by the sync and asyncio lock helpers.

    ``groups``: role -> group id; ``served_sampler``: the sampler group has samplers behind the gate (router mode).
    A group is yielded when the last role holding it gives it back (trainer and sampler may name one group).
    """

    def __init__(self, groups: dict[str, str], served_sampler: bool) -> None:
        self.groups = groups
        self.served_sampler = served_sampler
        self.held: dict[str, set[str]] = {}  # group -> roles holding it

    def roles_for(self, role: str) -> list[str]:
        """Lock roles a phase role takes, in acquire order (release goes in reverse)."""
        if role == TRAINER:
            return [TRAINER]
        if role == SAMPLER:
            return [] if self.served_sampler else [SAMPLER]
        return [TRAINER, SAMPLER]

    def role_held(self, role: str) -> bool:
        return role in self.held.get(self.groups[role], set())

    def before_acquire(self, role: str) -> str | None:
        """The group to acquire for ``role`` (None: already held by this job). Raises LockOrderViolation."""
        group = self.groups[role]
        if role == TRAINER and not self.role_held(TRAINER) and self.role_held(SAMPLER) and self.groups[SAMPLER] != group:
            raise LockOrderViolation(
                f"lock order: the trainer group {group!r} was requested while the sampler group "
                f"{self.groups[SAMPLER]!r} is held; the global order is trainer first, then sampler "
                "(end the sampler phase first)"
            )
        return None if group in self.held else group

    def acquired(self, role: str) -> None:
        self.held.setdefault(self.groups[role], set()).add(role)

    def before_release(self, role: str) -> str | None:
        """The group to yield when ``role`` gives it back (None: not held, or another role still holds it)."""
        group = self.groups[role]
        roles = self.held.get(group)
        if not roles or role not in roles:
            return None
        roles.discard(role)
        if roles:
            return None
        del self.held[group]
        return group

    def held_groups(self) -> list[str]:
        return list(self.held)


class _Config:
    """What :meth:`RoleLocks.from_env` reads, checked: the job id switches time-slicing on."""

    def __init__(self, job_id: str | None, orch_addr: str | None, trainer_group: str | None, sampler_group: str | None) -> None:
        self.job_id, self.orch_addr = job_id or None, orch_addr or None
        self.trainer_group, self.sampler_group = trainer_group or None, sampler_group or None
        self.enabled = self.job_id is not None
        if not self.enabled:
            return
        missing = [
            name
            for name, value in (
                (ENV_ORCH_ADDR, self.orch_addr),
                (ENV_TRAINER_GROUP, self.trainer_group),
                (ENV_SAMPLER_GROUP, self.sampler_group),
            )
            if not value
        ]
        if missing:
            raise TimeSliceConfigError(
                f"{ENV_JOB_ID}={self.job_id!r} turns time-slicing on, but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set: set {' and '.join(missing)} "
                f"(e.g. {ENV_ORCH_ADDR}=orchestrator:50051), or unset {ENV_JOB_ID} to run without time-slicing"
            )
        try:
            check_host_port(self.orch_addr or "", f"{ENV_ORCH_ADDR} as host:port")
        except ValueError as exc:
            raise TimeSliceConfigError(str(exc)) from None

    def groups(self) -> dict[str, str]:
        """Role -> group; both are set whenever time-slicing is on (checked above)."""
        if self.trainer_group is None or self.sampler_group is None:
            raise TimeSliceConfigError(f"time-slicing is off ({ENV_JOB_ID} unset): no groups")
        return {TRAINER: self.trainer_group, SAMPLER: self.sampler_group}

    @classmethod
    def from_env(cls) -> _Config:
        e = os.environ
        return cls(e.get(ENV_JOB_ID), e.get(ENV_ORCH_ADDR), e.get(ENV_TRAINER_GROUP), e.get(ENV_SAMPLER_GROUP))


def _yield_failed(job_id: str | None, role: str, group: str, exc: TimeSliceError) -> None:
    """A yield that failed: when the orchestrator says this job no longer holds the group (its lease expired or
    was reclaimed), the phase ran without the lock, so raise :class:`LeaseLost`; otherwise (orchestrator
    unreachable) log, as upstream does: the lease expires on the orchestrator's side."""
    if isinstance(exc, LeaseLost) or exc.code == "FAILED_PRECONDITION":
        raise LeaseLost(f"job {job_id!r} no longer held {group!r} ({role}) when the phase ended: {exc}") from None
    log.error("job=%s RELEASE role=%s group=%s FAILED: %s", job_id, role, group, exc)


def _hands_weights(context: Mapping[str, Any] | None) -> bool:
    return context is not None and any(context.get(k) is not None for k in ("model", "checkpoint_dir", "weights"))


def _served(status) -> bool:
    return len(status.samplers) > 0


def _check_groups(cfg: _Config, served_sampler: bool) -> None:
    if cfg.trainer_group == cfg.sampler_group and not served_sampler:
        raise TimeSliceConfigError(
            f"{ENV_TRAINER_GROUP} and {ENV_SAMPLER_GROUP} are both {cfg.trainer_group!r}, a group without samplers: "
            "the trainer and sampler pools must be distinct groups (equal groups are allowed only for a served "
            "sampler group, i.e. a trainer co-located on the samplers' accelerators)"
        )


class _WeightPublisher:
    """Turns a phase ``context`` into the next :class:`WeightUpdate` (None when it hands over no weights)."""

    def __init__(self, weights_dir: str | os.PathLike | None) -> None:
        self.weights_dir = weights_dir or os.environ.get(ENV_WEIGHTS_DIR) or None
        self.version = 0

    def update_from(self, context: Mapping[str, Any] | None) -> WeightUpdate | None:
        if not context:
            return None
        if context.get("weights") is not None:
            weights = context["weights"]
            if not isinstance(weights, WeightUpdate):
                raise TypeError(f"context['weights'] must be a WeightUpdate, got {type(weights).__name__}")
            return weights
        has_model, ckpt = context.get("model") is not None, context.get("checkpoint_dir")
        if not has_model and not ckpt:
            return None
        version = int(context.get("weight_version") or self.version + 1)
        if ckpt:
            from llmd_timeslice.weights.manifest import MANIFEST_NAME, write_manifest

            path = Path(ckpt)
            if not path.is_dir():
                raise FileNotFoundError(f"context['checkpoint_dir'] {str(path)!r} is not a directory")
            if not (path / MANIFEST_NAME).is_file():
                write_manifest(path, version)
            return WeightUpdate(version, SOURCE_FILES, str(path.resolve()))
        root = context.get("weights_dir") or self.weights_dir
        if not root:
            raise TimeSliceConfigError(
                f"context['model'] hands over weights but there is no weights directory: set {ENV_WEIGHTS_DIR} "
                "(a directory the samplers can read), pass weights_dir=, or context['weights_dir']"
            )
        from llmd_timeslice.weights.manifest import save_weight_version

        return save_weight_version(context["model"], root, version)

    def published(self, update: WeightUpdate) -> None:
        self.version = max(self.version, update.version)
