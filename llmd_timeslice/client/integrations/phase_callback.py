"""Phase callbacks for RL frameworks, compatible with the upstream llm-d time-slicing integration.

Upstream (llm-d-incubation/llm-d-rl-time-slicing @ 6cf8e9b, ``guides/rl-frameworks/README.md`` and
``pkg/integrations/slime/timeslice_slime/{callback,locks}.py``) defines the interface a framework's driver
calls around each accelerator phase::

    class PhaseCallback:
        def on_phase_begin(self, phase, role, context=None): ...
        def on_phase_end(self, phase, role, context=None): ...
        def close(self): ...

and ``TimesliceCallback``, which takes a lock per role: ``trainer`` -> ``$TIMESLICE_TRAINER_GROUP``,
``sampler`` -> ``$TIMESLICE_SAMPLER_GROUP``, ``both`` -> trainer then sampler (released in reverse order),
configured only from ``TIMESLICE_JOB_ID``, ``TIMESLICE_ORCH_ADDR``, ``TIMESLICE_TRAINER_GROUP`` and
``TIMESLICE_SAMPLER_GROUP``, and a no-op when the job id is unset. Switching is one import::

    - from timeslice_slime.callback import TimesliceCallback
    + from llmd_timeslice.client.integrations import TimesliceCallback

Differences from upstream, each deliberate:

* **Served sampler groups (router mode).** When ``$TIMESLICE_SAMPLER_GROUP`` names a group whose samplers are
  vLLM servers behind this project's gate (the orchestrator lists samplers for it), rollouts go through the
  router, which holds them while the samplers sleep. Holding that group would *put its samplers to sleep*, so
  ``sampler``-only phases (``generate``, ``eval``, ``offload``, ``onload``) take no lock there; ``both`` phases
  (``init``, ``weight_sync``) still take the trainer group, then the sampler group: the samplers drain and sleep
  while the weights change, and wake with them. A sampler group without samplers keeps upstream's meaning exactly
  (the job's own sampler processes are snapshotted by the agents). The trainer group may be the served sampler
  group itself (trainer co-located on the samplers' accelerators, this project's main topology); upstream
  refuses equal groups, and so does this class for groups without samplers.
* **Weight versions.** Releasing a served sampler group with a ``context`` that hands over weights publishes
  them as the next weight version first (``context["weights"]``: a
  :class:`~llmd_timeslice.weights.update.WeightUpdate`; ``context["model"]``: a ``transformers`` model or state
  dict, saved under ``weights_dir``; ``context["checkpoint_dir"]``: a safetensors directory, given a manifest),
  so the samplers wake serving it. ``context["weight_version"]`` picks the number (default: last + 1).
  :attr:`RoleLocks.weight_version` is what rollouts should ask the gate for.
* **Errors surface.** Bad configuration fails in the constructor (a job id without an orchestrator address or
  without groups, an unknown group); an unknown phase or role raises naming the known ones; a refused or timed
  out acquire raises (as upstream); a lease lost while a phase ran raises :class:`LeaseLost` at the next phase
  boundary and at release, where upstream only logs release errors. Other yield errors are logged, as upstream
  (the lease then expires on the orchestrator).
* **Yield requests (issue 26).** When held traffic of a priority band nears its hold deadline the orchestrator
  asks the holder to yield (``Lease.yield_requested``, learned from the lease heartbeats). A driver that calls
  ``at_step_boundary(phase, role)`` between its steps honours it there: the phase's groups are yielded (no
  weights published) and acquired again, as between phases, so the held requests are served meanwhile. A
  driver that never calls it keeps upstream's behaviour: the group is kept until the phase ends.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from llmd_timeslice.client import (
    AsyncTimeSliceOrchestratorClient,
    LeaseLost,
    OrchestratorUnavailable,
    TimeSliceError,
    TimeSliceOrchestratorClient,
    UnknownGroup,
    YieldRequested,
    loop_thread,
)
from llmd_timeslice.client.integrations.lock_plan import (
    BOTH,
    DEFAULT_ACQUIRE_TIMEOUT_S,
    ENV_JOB_ID,
    ENV_ORCH_ADDR,
    ENV_SAMPLER_GROUP,
    ENV_TRAINER_GROUP,
    ENV_WEIGHTS_DIR,
    PHASES,
    ROLES,
    SAMPLER,
    TRAINER,
    LockOrderError,
    LockOrderViolation,
    TimeSliceConfigError,
    TimesliceConfigError,
    UnknownPhase,
    UnknownRole,
    _check_groups,
    _Config,
    _hands_weights,
    _LockPlan,
    _served,
    _WeightPublisher,
    _yield_failed,
    check_phase,
)
from llmd_timeslice.weights.update import WeightUpdate

log = logging.getLogger(__name__)

__all__ = [
    "BOTH",
    "ENV_JOB_ID",
    "ENV_ORCH_ADDR",
    "ENV_SAMPLER_GROUP",
    "ENV_TRAINER_GROUP",
    "ENV_WEIGHTS_DIR",
    "PHASES",
    "ROLES",
    "SAMPLER",
    "TRAINER",
    "AsyncRoleLocks",
    "AsyncTimesliceCallback",
    "LockOrderError",
    "LockOrderViolation",
    "PhaseCallback",
    "RoleLocks",
    "TimeSliceConfigError",
    "TimesliceCallback",
    "TimesliceConfigError",
    "UnknownPhase",
    "UnknownRole",
    "phase",
]


class PhaseCallback:
    """The framework-facing interface (upstream's, same method names); every method a no-op."""

    def on_phase_begin(self, phase: str, role: str, context: Mapping[str, Any] | None = None) -> None:
        pass

    def on_phase_end(self, phase: str, role: str, context: Mapping[str, Any] | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class _Locks:
    """The role locks' local state and checks: the configuration, the lock plan, the weight publisher and the
    client's lease state (the core, :class:`AsyncRoleLocks`; :class:`RoleLocks` is its blocking face)."""

    config: _Config
    job_id: str | None
    enabled: bool
    plan: _LockPlan
    _weights: _WeightPublisher
    _client: TimeSliceOrchestratorClient | AsyncTimeSliceOrchestratorClient | None

    @property
    def router_mode(self) -> bool:
        """True when the sampler group is served behind the gate (sampler-only phases take no lock)."""
        return self.plan.served_sampler

    @property
    def weight_version(self) -> int:
        """The newest weight version of the sampler group this job knows of (published here or seen at start):
        the minimum weight version rollouts should ask the gate for."""
        return self._weights.version

    def held(self, role: str) -> bool:
        return self.enabled and role in (TRAINER, SAMPLER) and self.plan.role_held(role)

    def yield_requested(self, role: str) -> YieldRequested | None:
        """The yield request the orchestrator made for a group that phase role ``role`` (trainer, sampler, both)
        holds now, or None. Raises :class:`UnknownRole`."""
        if role not in ROLES:
            raise UnknownRole(f"unknown role {role!r}; known roles: {', '.join(ROLES)}")
        if not self.enabled or self._client is None:
            return None
        for r in self._held_roles(role):
            req = self._client.yield_requested(self.job_id, self.plan.groups[r])
            if req is not None:
                return req
        return None

    def _held_roles(self, role: str) -> list[str]:
        return [r for r in self.plan.roles_for(role) if self.plan.role_held(r)]

    def _log_yield(self, role: str, req: YieldRequested) -> None:
        log.warning(
            "job=%s STEP BOUNDARY role=%s: yielding group %s on request (%s), then acquiring it again",
            self.job_id,
            role,
            req.group_id,
            req.reason,
        )

    def _check_lease(self, role: str) -> None:
        group = self.plan.groups[role]
        lost = self._client.lease_lost(self.job_id, group) if self._client is not None else None
        if lost:
            raise LeaseLost(
                f"job {self.job_id!r} lost its lease on {group!r} ({role}) while a phase ran: {lost}; "
                "stop, restart from the last checkpoint and acquire again"
            )

    def _publishes_on(self, group: str) -> bool:
        return self.router_mode and group == self.plan.groups[SAMPLER]

    def _warn_unpublished(self, group: str, update: WeightUpdate | None, context: Mapping[str, Any] | None) -> None:
        """Weights handed to the callback on a sampler group without samplers behind the gate are not published:
        say so once per release (the framework must sync them itself)."""
        if update is None and group == self.plan.groups[SAMPLER] and not self.router_mode and _hands_weights(context):
            log.warning(
                "sampler group %r has no samplers behind the gate: weights handed to the callback are not "
                "published (the framework syncs them itself)",
                group,
            )


class TimesliceCallback(PhaseCallback):
    """Upstream-compatible phase callback (same name, methods, phases, roles, env contract and lock order).

    ``on_phase_begin(phase, role)``: ``trainer`` -> acquire the trainer group; ``sampler`` -> the sampler group
    (none in router mode); ``both`` -> trainer, then sampler. ``on_phase_end``: the reverse. Sync RL (whole-step
    turns) and async RL (generation N+1 dispatched while training N holds the trainer group; per-job sampler
    groups) both work as in upstream's drivers.

    Args:
        locks: lock helper (default :meth:`RoleLocks.from_env`); other keyword arguments go to it.
    """

    def __init__(self, locks: RoleLocks | None = None, **kw) -> None:
        self.locks = locks or RoleLocks.from_env(**kw)

    @property
    def weight_version(self) -> int:
        return self.locks.weight_version

    def on_phase_begin(self, phase: str, role: str, context: Mapping[str, Any] | None = None) -> None:
        loop_thread.run(AsyncTimesliceCallback(self.locks._core).on_phase_begin(phase, role, context))

    def on_phase_end(self, phase: str, role: str, context: Mapping[str, Any] | None = None) -> None:
        loop_thread.run(AsyncTimesliceCallback(self.locks._core).on_phase_end(phase, role, context))

    def at_step_boundary(self, phase: str, role: str, context: Mapping[str, Any] | None = None) -> bool:
        """Between two steps of ``phase`` (e.g. each optimizer step of ``train``): honour a yield request for a
        group the phase holds (:meth:`RoleLocks.step_boundary`: yield, then acquire again, as between phases).
        Returns whether it yielded; a no-op (False) without a request. Project extension (not upstream's
        interface). Raises UnknownPhase / UnknownRole, and as :meth:`RoleLocks.acquire`."""
        check_phase(phase, role)
        return self.locks.step_boundary(role)

    def close(self) -> None:
        self.locks.close()


class AsyncRoleLocks(_Locks):
    """:class:`RoleLocks` for asyncio drivers (verifiers-based trainers and other async rollout loops): the same
    plan and errors over :class:`~llmd_timeslice.client.AsyncTimeSliceOrchestratorClient`; create it with
    ``await AsyncRoleLocks.create(...)`` (the start-up check is a call)."""

    DEFAULT_ACQUIRE_TIMEOUT_SEC = DEFAULT_ACQUIRE_TIMEOUT_S

    def __init__(self) -> None:  # use create()/from_env()
        self.enabled = False
        self.job_id: str | None = None
        self.plan = _LockPlan({TRAINER: "", SAMPLER: ""}, served_sampler=False)
        self._weights = _WeightPublisher(None)
        self._client: AsyncTimeSliceOrchestratorClient | None = None
        self._own_client = True
        self._closed = False

    @classmethod
    async def create(
        cls,
        job_id: str | None,
        orch_addr: str | None,
        trainer_group: str | None,
        sampler_group: str | None,
        *,
        weights_dir: str | os.PathLike | None = None,
        client: AsyncTimeSliceOrchestratorClient | TimeSliceOrchestratorClient | None = None,
        timeout_s: float = 30.0,
    ) -> AsyncRoleLocks:
        """Check the configuration and the groups with the orchestrator (the start-up check), then the locks.

        Args:
            job_id, orch_addr, trainer_group, sampler_group: as the ``TIMESLICE_*`` variables. ``job_id`` None: no-op.
            weights_dir: where ``context["model"]`` weight versions are written (default
                ``$LLMD_TIMESLICE_WEIGHTS_DIR``).
            client: a client to use, either face (default: one built for ``orch_addr``; closed by :meth:`close` only
                if built here).
            timeout_s: seconds the start-up check may take (it asks the orchestrator about the groups).

        Raises:
            TimeSliceConfigError: job id set without address or groups; an unknown group; equal groups without
                samplers.
            OrchestratorUnavailable: the orchestrator did not answer the start-up check.
        """
        if isinstance(client, TimeSliceOrchestratorClient):
            client = client._core  # a blocking face: its asyncio core, on this loop
        self = cls()
        cfg = _Config(job_id, orch_addr, trainer_group, sampler_group)
        self.config, self.job_id, self.enabled = cfg, cfg.job_id, cfg.enabled
        self._weights = _WeightPublisher(weights_dir)
        if not self.enabled:
            log.warning("time-slicing off (%s unset): phase callbacks are no-ops", ENV_JOB_ID)
            return self
        self._own_client = client is None
        self._client = client or AsyncTimeSliceOrchestratorClient(
            cfg.orch_addr, job_id=cfg.job_id, sampler_group_id=cfg.sampler_group
        )
        try:
            status, served = await asyncio.wait_for(self._check_groups(cfg), timeout_s)
        except TimeoutError:
            if self._own_client:
                await self._client.close()
            raise OrchestratorUnavailable(
                f"the orchestrator at {cfg.orch_addr} did not answer the start-up check within {timeout_s:g} s"
            ) from None
        except BaseException:
            if self._own_client:
                await self._client.close()
            raise
        self.plan = _LockPlan(cfg.groups(), served_sampler=served)
        if status is not None:
            self._weights.version = max(status.serving_version, status.pending.version if status.HasField("pending") else 0)
        log.info(
            "job=%s orchestrator=%s trainer_group=%s sampler_group=%s%s",
            cfg.job_id,
            cfg.orch_addr,
            cfg.trainer_group,
            cfg.sampler_group,
            " (served: router mode)" if served else "",
        )
        return self

    async def _check_groups(self, cfg: _Config) -> tuple[Any, bool]:
        """The start-up check: the sampler group's weight status (None from an upstream orchestrator) and whether it
        is served; the trainer group must exist. Raises TimeSliceConfigError naming the variable."""
        client = self._live()
        try:
            status = await client.weight_status(cfg.sampler_group)
        except UnknownGroup as exc:
            raise TimeSliceConfigError(f"{ENV_SAMPLER_GROUP}={cfg.sampler_group!r}: {exc}") from None
        except TimeSliceError as exc:
            if exc.code != "UNIMPLEMENTED":  # an upstream orchestrator: no served groups there
                raise
            status = None
        served = status is not None and _served(status)
        _check_groups(cfg, served)
        if cfg.trainer_group != cfg.sampler_group:
            try:
                await client.group_status(cfg.trainer_group)  # unknown trainer group: fail now, not at a phase
            except TimeSliceError as exc:
                raise TimeSliceConfigError(f"{ENV_TRAINER_GROUP}={cfg.trainer_group!r}: {exc}") from None
        return status, served

    @classmethod
    async def from_env(cls, **kw) -> AsyncRoleLocks:
        c = _Config.from_env()
        return await cls.create(c.job_id, c.orch_addr, c.trainer_group, c.sampler_group, **kw)

    _client: AsyncTimeSliceOrchestratorClient | None

    @property
    def client(self) -> AsyncTimeSliceOrchestratorClient | None:
        return self._client

    def _live(self) -> AsyncTimeSliceOrchestratorClient:
        if self._client is None:
            raise TimeSliceError("the phase locks are closed")
        return self._client

    def _locks_apply(self, role: str) -> bool:
        """Whether ``role`` takes locks: False while time-slicing is off. Raises UnknownRole."""
        if role not in (TRAINER, SAMPLER):
            raise UnknownRole(f"unknown lock role {role!r}; known: {TRAINER}, {SAMPLER}")
        return self.enabled

    async def acquire(self, role: str, timeout_sec: float | None = None) -> None:
        """Until this job holds ``role``'s group (idempotent). Raises LockOrderViolation, UnknownRole,
        AcquireTimeout, LeaseError, LeaseLost (an earlier grant of that group was lost), OrchestratorUnavailable."""
        if not self._locks_apply(role):
            return
        group = self.plan.before_acquire(role)
        if group is None:
            self._check_lease(role)
            self.plan.acquired(role)
            return
        phase = "rollout" if role == SAMPLER else "train"  # the job's phase profile (docs/placement.md)
        r = await self._live().acquire(self.job_id, group, timeout_sec or self.DEFAULT_ACQUIRE_TIMEOUT_SEC, phase=phase)
        self.plan.acquired(role)
        log.info(
            "job=%s ACQUIRE role=%s group=%s waited=%dms context_restored=%s",
            self.job_id,
            role,
            group,
            r.waited_ms,
            r.context_restored,
        )

    async def release(self, role: str, context: Mapping[str, Any] | None = None) -> None:
        """Give ``role``'s group back (idempotent); the group is yielded when no role holds it any more. Yielding
        a served sampler group first publishes the weights ``context`` hands over.

        Raises:
            LeaseLost: the lease was lost while the phase ran (the group is no longer held either way).
            LeaseError / OrchestratorUnavailable: publishing the weights failed (the group is still yielded).
        """
        if not self._locks_apply(role):
            return
        group = self.plan.before_release(role)
        if group is None:
            return
        update = None
        if self._publishes_on(group):
            update = await asyncio.to_thread(self._weights.update_from, context)  # writes files: off the loop
        self._warn_unpublished(group, update, context)
        publish_error: Exception | None = None
        if update is not None:
            try:
                await self._live().publish_weights(update, self.job_id, group)
                self._weights.published(update)
            except TimeSliceError as exc:
                publish_error = exc
        try:
            r = await self._live().release(self.job_id, group)
            log.info(
                "job=%s RELEASE role=%s group=%s pending_waiters=%d snapshot_deferred=%s%s",
                self.job_id,
                role,
                group,
                r.pending_waiters,
                r.snapshot_deferred,
                f" weight_version={update.version}" if update is not None and publish_error is None else "",
            )
        except TimeSliceError as exc:
            _yield_failed(self.job_id, role, group, exc)
        if publish_error is not None:
            raise publish_error

    async def release_all(self) -> None:
        """Release everything, sampler role first."""
        for role in (SAMPLER, TRAINER):
            await self.release(role)

    async def step_boundary(self, role: str, timeout_sec: float | None = None) -> bool:
        """At a step boundary of a phase of role ``role``: when the orchestrator asks this job to yield a group
        the role holds (:meth:`yield_requested`), yield the role's groups (reverse order, no weights published) and
        acquire them again (trainer first, waiting up to ``timeout_sec`` as :meth:`acquire`). Returns whether it
        yielded. Raises as :meth:`release` and :meth:`acquire` (a lost lease: :class:`LeaseLost`)."""
        req = self.yield_requested(role)
        if req is None:
            return False
        self._log_yield(role, req)
        roles = self._held_roles(role)
        for r in reversed(roles):
            await self.release(r)
        for r in roles:
            await self.acquire(r, timeout_sec)
        return True

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.enabled:
                await self.release_all()
        finally:
            if self._client is not None and self._own_client:
                await self._client.close()


class RoleLocks:
    """Idempotent per-role locks with the trainer-first order (upstream's ``RoleLocks``), over this project's
    :class:`~llmd_timeslice.client.TimeSliceOrchestratorClient`; a blocking face over :class:`AsyncRoleLocks`, run on
    the client loop (:mod:`~llmd_timeslice.client.loop_thread`) (bearer token and TLS from the environment, lease
    heartbeats, fencing tokens). Built with the arguments of :meth:`AsyncRoleLocks.create` (``client``: a blocking
    face, or its asyncio core), which says what each is and what it raises.
    """

    DEFAULT_ACQUIRE_TIMEOUT_SEC = DEFAULT_ACQUIRE_TIMEOUT_S

    @loop_thread.built_like(AsyncRoleLocks.create)
    def __init__(self, *args, **kwargs) -> None:
        self._core = loop_thread.run(AsyncRoleLocks.create(*args, **kwargs))
        client = kwargs.get("client")
        core_client = self._core.client
        if isinstance(client, TimeSliceOrchestratorClient) or core_client is None:
            self._client = client if isinstance(client, TimeSliceOrchestratorClient) else None
        else:
            self._client = TimeSliceOrchestratorClient._over(core_client)
        if self._core.enabled:
            atexit.register(self._atexit_cleanup)

    def __getattr__(self, name: str):
        """The plan, configuration and state live on the core (one copy): ``plan``, ``config``, ``job_id``,
        ``enabled``."""
        if name == "_core":
            raise AttributeError(name)
        return getattr(self._core, name)

    def __setattr__(self, name: str, value) -> None:
        if name == "DEFAULT_ACQUIRE_TIMEOUT_SEC":  # a per-instance setting: the core is what acquires
            setattr(self._core, name, value)
        else:
            super().__setattr__(name, value)

    @classmethod
    def from_env(cls, **kw) -> RoleLocks:
        """From ``TIMESLICE_JOB_ID``, ``TIMESLICE_ORCH_ADDR``, ``TIMESLICE_TRAINER_GROUP``, ``TIMESLICE_SAMPLER_GROUP``."""
        c = _Config.from_env()
        return cls(c.job_id, c.orch_addr, c.trainer_group, c.sampler_group, **kw)

    @property
    def client(self) -> TimeSliceOrchestratorClient | None:
        return self._client

    @property
    def router_mode(self) -> bool:
        """True when the sampler group is served behind the gate (sampler-only phases take no lock)."""
        return self._core.router_mode

    @property
    def weight_version(self) -> int:
        """See :attr:`AsyncRoleLocks.weight_version`."""
        return self._core.weight_version

    def held(self, role: str) -> bool:
        return self._core.held(role)

    def yield_requested(self, role: str) -> YieldRequested | None:
        """See :meth:`AsyncRoleLocks.yield_requested` (local state: no call)."""
        return self._core.yield_requested(role)

    # Each call blocks the calling thread until the core's ends (the core's docstrings say what each does).
    acquire = loop_thread.blocking(AsyncRoleLocks.acquire)
    release = loop_thread.blocking(AsyncRoleLocks.release)
    release_all = loop_thread.blocking(AsyncRoleLocks.release_all)
    step_boundary = loop_thread.blocking(AsyncRoleLocks.step_boundary)

    def close(self) -> None:
        loop_thread.run(self._core.close())

    def _atexit_cleanup(self) -> None:
        if self._core._closed or not self._core.plan.held:
            return
        log.warning("job=%s atexit: releasing held groups %s", self._core.job_id, sorted(self._core.plan.held))
        try:
            self.close()
        except Exception as exc:  # the process is exiting: say so, do not raise
            log.error("job=%s atexit cleanup failed: %s", self._core.job_id, exc)


class AsyncTimesliceCallback:
    """:class:`TimesliceCallback` with awaitable methods, for asyncio drivers: ``cb = await
    AsyncTimesliceCallback.from_env()``, then ``await cb.on_phase_begin(phase, role, context)``."""

    def __init__(self, locks: AsyncRoleLocks) -> None:
        self.locks = locks

    @classmethod
    async def from_env(cls, **kw) -> AsyncTimesliceCallback:
        return cls(await AsyncRoleLocks.from_env(**kw))

    @property
    def weight_version(self) -> int:
        return self.locks.weight_version

    async def on_phase_begin(self, phase: str, role: str, context: Mapping[str, Any] | None = None) -> None:
        check_phase(phase, role)
        for r in self.locks.plan.roles_for(role) if self.locks.enabled else ():
            await self.locks.acquire(r)

    async def on_phase_end(self, phase: str, role: str, context: Mapping[str, Any] | None = None) -> None:
        check_phase(phase, role)
        for r in reversed(self.locks.plan.roles_for(role)) if self.locks.enabled else ():
            await self.locks.release(r, context)

    async def at_step_boundary(self, phase: str, role: str, context: Mapping[str, Any] | None = None) -> bool:
        """See :meth:`TimesliceCallback.at_step_boundary`."""
        check_phase(phase, role)
        return await self.locks.step_boundary(role)

    async def close(self) -> None:
        await self.locks.close()


def phase(callback: TimesliceCallback, name: str, role: str | None = None, context: Mapping[str, Any] | None = None) -> Callable:
    """``with phase(cb, "train"):`` -- ``on_phase_begin`` / ``on_phase_end`` around a block (role from
    :data:`PHASES` when omitted). The end runs even when the block raises, so the locks are given back."""
    import contextlib

    role = role or PHASES.get(name, "")

    @contextlib.contextmanager
    def _cm():
        callback.on_phase_begin(name, role, context)
        try:
            yield callback
        except BaseException:
            callback.on_phase_end(name, role, None)  # give the locks back; publish nothing from a failed phase
            raise
        callback.on_phase_end(name, role, context)

    return _cm()
