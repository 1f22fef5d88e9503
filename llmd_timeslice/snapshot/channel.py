"""The sidecar side of upstream ``WorkloadChannel``: in-process workloads (trainers) register over a
bidirectional stream and the sidecar commands them (snapshot = offload, restore).

Semantics (upstream): the first message must be ``RegisterWorkload``; re-registering a ``job_id``
replaces the earlier stream (which is ended, and its unanswered commands fail); each
``AgentCommand`` is sent at most once (never re-sent, not even to a replacement stream) and is
answered by a ``CommandResult`` with the same ``command_id``; the mode on the wire is always
resolved (never ``SUSPEND_MODE_UNSPECIFIED``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from llmd_timeslice.snapshot.backends.base import (
    BackendError,
    SnapshotBackend,
    SuspendMode,
    SuspendResult,
)

log = logging.getLogger(__name__)

MODE_TO_PB = {SuspendMode.OFFLOAD: pb.SUSPEND_MODE_OFFLOAD, SuspendMode.DISCARD: pb.SUSPEND_MODE_DISCARD}
PB_TO_MODE = {v: k for k, v in MODE_TO_PB.items()}


@dataclass(eq=False)
class WorkloadChannel:
    """One registered workload stream: an outbox of commands and the commands awaiting a result."""

    job_id: str
    group: str
    supported_modes: tuple[SuspendMode, ...]
    default_mode: SuspendMode
    tags: tuple[str, ...]
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    pending: dict[str, asyncio.Future] = field(default_factory=dict)
    closed: str | None = None  # why, once closed

    @classmethod
    def from_register(cls, reg: pb.RegisterWorkload) -> WorkloadChannel:
        modes = tuple(PB_TO_MODE[m] for m in reg.capabilities.supported_modes if m in PB_TO_MODE) or (SuspendMode.OFFLOAD,)
        default = PB_TO_MODE.get(reg.capabilities.default_mode, modes[0])
        return cls(reg.job_id, reg.group, modes, default, tuple(reg.capabilities.tags))

    async def call(self, cmd: pb.AgentCommand, timeout_s: float) -> None:
        """Send ``cmd`` once and wait for its result; raises :class:`BackendError` unless ``ok``."""
        if self.closed:
            raise BackendError(f"workload {self.job_id!r} is not connected ({self.closed}); restart or re-register it")
        fut = asyncio.get_running_loop().create_future()
        self.pending[cmd.command_id] = fut
        self.outbox.put_nowait(cmd)
        kind = cmd.WhichOneof("command")
        try:
            res: pb.CommandResult = await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise BackendError(
                f"workload {self.job_id!r} did not answer {kind} command {cmd.command_id} within "
                f"{timeout_s:g} s; it is left out of service: check the trainer process"
            ) from None
        finally:
            self.pending.pop(cmd.command_id, None)
        if not res.ok:
            raise BackendError(
                f"workload {self.job_id!r} failed {kind} command {cmd.command_id}: {res.error or 'no error given'}"
            )

    def on_result(self, res: pb.CommandResult) -> None:
        fut = self.pending.get(res.command_id)
        if fut is None or fut.done():
            log.warning("job %s: result for unknown or finished command %r ignored", self.job_id, res.command_id)
            return
        fut.set_result(res)

    def close(self, reason: str) -> None:
        """End the stream; every command still waiting fails with ``reason``."""
        if self.closed:
            return
        self.closed = reason
        for cid, fut in list(self.pending.items()):
            if not fut.done():
                fut.set_exception(
                    BackendError(
                        f"workload {self.job_id!r}: command {cid} got no result: {reason}; the workload is left out of service"
                    )
                )
        self.outbox.put_nowait(None)


class WorkloadRegistry:
    """Registered workload channels by job id (the newest registration wins)."""

    def __init__(self) -> None:
        self.channels: dict[str, WorkloadChannel] = {}

    def register(self, reg: pb.RegisterWorkload) -> WorkloadChannel:
        ch = WorkloadChannel.from_register(reg)
        old = self.channels.get(reg.job_id)
        self.channels[reg.job_id] = ch
        if old is not None:
            old.close(f"replaced by a newer registration of job {reg.job_id!r}")
        log.info("workload registered job=%s group=%s modes=%s", reg.job_id, reg.group, [m.name for m in ch.supported_modes])
        return ch

    def unregister(self, ch: WorkloadChannel) -> None:
        if self.channels.get(ch.job_id) is ch:
            del self.channels[ch.job_id]

    def get(self, job_id: str) -> WorkloadChannel | None:
        return self.channels.get(job_id)


class WorkloadChannelBackend(SnapshotBackend):
    """Snapshot/restore of a workload registered on WorkloadChannel: send a command, wait for its result.

    The channel is looked up at each call, so a workload that re-registered between a snapshot and
    its restore gets the restore on its new stream.
    """

    name = "workload_channel"
    target = "channel"
    supported_modes = (SuspendMode.OFFLOAD, SuspendMode.DISCARD)

    def __init__(self, registry: WorkloadRegistry, job_id: str, command_timeout_s: float = 300.0, **_ignored) -> None:
        self.registry, self.job_id, self.command_timeout_s = registry, job_id, command_timeout_s
        self._suspended = False

    def _channel(self) -> WorkloadChannel:
        ch = self.registry.get(self.job_id)
        if ch is None:
            raise BackendError(
                f"no workload registered on WorkloadChannel for job {self.job_id!r}; start the trainer's "
                "workload client (llmd_timeslice.client.workload) before snapshot/restore"
            )
        return ch

    async def suspend(self, mode: SuspendMode, tags: list[str]) -> SuspendResult:
        ch = self._channel()
        if mode not in ch.supported_modes:
            raise BackendError(
                f"workload {self.job_id!r} does not support mode {mode.name} "
                f"(it registered {[m.name for m in ch.supported_modes]})"
            )
        cmd = pb.AgentCommand(command_id=uuid.uuid4().hex, snapshot=pb.SnapshotCommand(mode=MODE_TO_PB[mode], tags=tags))
        await ch.call(cmd, self.command_timeout_s)
        self._suspended = True
        return SuspendResult()

    async def resume(self, tags: list[str]) -> None:
        cmd = pb.AgentCommand(command_id=uuid.uuid4().hex, restore=pb.RestoreCommand(tags=tags))
        await self._channel().call(cmd, self.command_timeout_s)
        self._suspended = False

    async def is_suspended(self) -> bool:
        return self._suspended
