"""The trainer side of WorkloadChannel: register with the pod's sidecar and run its commands.

A trainer process (or any in-process workload) calls :meth:`WorkloadClient.run` (asyncio) or
:meth:`WorkloadClient.start_in_thread` (plain code); the sidecar then offloads/restores it on
Snapshot/Restore: each ``AgentCommand`` runs the ``offload`` / ``restore`` callback (in a worker
thread, so a long copy does not block the stream) and is answered with a ``CommandResult``
carrying the same ``command_id`` (``ok=False`` and the exception text if the callback raised).

    from llmd_timeslice.client.torch_offload import TorchStateOffloader
    from llmd_timeslice.client.workload import WorkloadClient

    client = WorkloadClient.for_offloader("127.0.0.1:9001", "trainer-0", TorchStateOffloader(model, opt))
    handle = client.start_in_thread()       # registered when this returns
    ...                                     # the sidecar may now offload / restore the trainer
    handle.stop()
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from grpc import aio

from llmd_timeslice import auth
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from llmd_timeslice.snapshot.backends.base import SuspendMode
from llmd_timeslice.snapshot.channel import MODE_TO_PB, PB_TO_MODE

log = logging.getLogger(__name__)

OffloadFn = Callable[[SuspendMode, list[str]], object]
RestoreFn = Callable[[list[str]], object]


class WorkloadClient:
    """One workload's registration on a sidecar's WorkloadChannel.

    Args:
        target: the sidecar, ``host:port``.
        job_id / group: what the workload registers as.
        offload: called with (mode, tags) on a snapshot command.
        restore: called with (tags) on a restore command.
        supported_modes / default_mode / tags: the capabilities registered.
        token: bearer token (default: ``LLMD_TIMESLICE_TOKEN`` / ``_FILE``).
    """

    def __init__(
        self,
        target: str,
        job_id: str,
        offload: OffloadFn,
        restore: RestoreFn,
        group: str = "",
        supported_modes: tuple[SuspendMode, ...] = (SuspendMode.OFFLOAD,),
        default_mode: SuspendMode = SuspendMode.OFFLOAD,
        tags: tuple[str, ...] = (),
        token: str | None = None,
    ) -> None:
        self.target, self.job_id, self.group = target, job_id, group
        self.offload, self.restore = offload, restore
        self.supported_modes, self.default_mode, self.tags = supported_modes, default_mode, tags
        self._md = auth.call_metadata(token if token is not None else auth.load_token())
        self.registered = asyncio.Event()
        self.commands_run = 0

    @classmethod
    def for_offloader(cls, target: str, job_id: str, offloader, **kw) -> WorkloadClient:
        """A client whose callbacks are a :class:`~llmd_timeslice.client.torch_offload.TorchStateOffloader`'s
        ``offload()`` / ``restore()`` (offload only: a trainer cannot re-provision discarded state)."""
        return cls(target, job_id, offload=lambda mode, tags: offloader.offload(), restore=lambda tags: offloader.restore(), **kw)

    def _register(self) -> pb.WorkloadMessage:
        return pb.WorkloadMessage(
            register=pb.RegisterWorkload(
                job_id=self.job_id,
                group=self.group,
                capabilities=pb.WorkloadCapabilities(
                    supported_modes=[MODE_TO_PB[m] for m in self.supported_modes],
                    default_mode=MODE_TO_PB[self.default_mode],
                    tags=list(self.tags),
                ),
            )
        )

    async def _execute(self, cmd: pb.AgentCommand) -> pb.CommandResult:
        kind = cmd.WhichOneof("command")
        try:
            if kind == "snapshot":
                mode = PB_TO_MODE.get(cmd.snapshot.mode, self.default_mode)
                await asyncio.to_thread(self.offload, mode, list(cmd.snapshot.tags))
            elif kind == "restore":
                await asyncio.to_thread(self.restore, list(cmd.restore.tags))
            else:
                return pb.CommandResult(command_id=cmd.command_id, ok=False, error=f"unknown command {kind!r}")
        except Exception as exc:
            log.exception("workload %s: %s command %s failed", self.job_id, kind, cmd.command_id)
            return pb.CommandResult(command_id=cmd.command_id, ok=False, error=f"{type(exc).__name__}: {exc}")
        self.commands_run += 1
        return pb.CommandResult(command_id=cmd.command_id, ok=True)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Register and serve commands until ``stop`` is set or the sidecar ends the stream."""
        stop = stop or asyncio.Event()
        async with aio.insecure_channel(self.target) as channel:
            call = pb_grpc.SnapshotAgentServiceStub(channel).WorkloadChannel(metadata=self._md)
            await call.write(self._register())
            await call.wait_for_connection()
            self.registered.set()
            stopper = asyncio.create_task(stop.wait())
            try:
                while True:
                    reader = asyncio.ensure_future(call.read())
                    done, _ = await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
                    if reader not in done:
                        reader.cancel()
                        break
                    cmd = reader.result()
                    if cmd is aio.EOF:
                        break
                    await call.write(pb.WorkloadMessage(result=await self._execute(cmd)))
            finally:
                stopper.cancel()
                call.cancel()
                self.registered.clear()

    def start_in_thread(self, timeout_s: float = 30.0) -> WorkloadHandle:
        """Run :meth:`run` in a background thread with its own loop; returns once registered."""
        return WorkloadHandle(self, timeout_s)


class WorkloadHandle:
    """A :class:`WorkloadClient` running in a background thread; :meth:`stop` ends it."""

    def __init__(self, client: WorkloadClient, timeout_s: float) -> None:
        self.client = client
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"workload-{client.job_id}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self.stop()
            raise TimeoutError(f"workload {client.job_id!r} did not register with {client.target} in {timeout_s:g} s")
        if self.error is not None:
            raise RuntimeError(f"workload {client.job_id!r} could not register with {client.target}: {self.error!r}")

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()

        async def main() -> None:
            watcher = asyncio.create_task(self.client.registered.wait())
            watcher.add_done_callback(lambda _: self._ready.set())
            try:
                await self.client.run(self._stop)
            except BaseException as exc:
                self.error = exc
                self._ready.set()
            finally:
                watcher.cancel()

        self.client.registered = asyncio.Event()
        self._loop.run_until_complete(main())
        self._loop.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
