"""Process-level CUDA backend (upstream ``BACKEND_CUDA``): NVIDIA's ``cuda-checkpoint`` utility.

``cuda-checkpoint`` (github.com/NVIDIA/cuda-checkpoint, driver 550+) moves a process's whole CUDA
state (device memory, contexts) into host memory and back, without the application's help. CLI
forms used here:

* ``--get-state --pid PID`` prints ``running``, ``locked``, ``checkpointed`` or ``failed``;
* older releases: ``--toggle --pid PID`` (running <-> checkpointed);
* newer releases (``--help`` mentions ``--action``): ``--action lock --pid PID [--timeout MS]``,
  ``--action checkpoint``, then ``--action restore`` and ``--action unlock``.

Every call has a timeout; a missing binary, a missing driver or a non-zero exit raises
:class:`BackendError` with the tool's own message and what to do. After each step the state is
read back (``--get-state``): ``checkpointed`` after suspend, ``running`` after resume.

Needs: the target PIDs visible to the sidecar (``shareProcessNamespace: true`` in the pod) and the
right to operate on them (``SYS_PTRACE``; same user or root). Offload only: device state is kept
in host memory, never discarded.
"""

from __future__ import annotations

import asyncio
import os
import shutil

from llmd_timeslice.snapshot.backends.base import (
    BackendError,
    SnapshotBackend,
    SuspendMode,
    SuspendResult,
)

BINARY_ENV_VAR = "LLMD_TIMESLICE_CUDA_CHECKPOINT"


class CudaCheckpointBackend(SnapshotBackend):
    """Checkpoint/restore the CUDA state of ``pids`` with ``cuda-checkpoint``.

    Args:
        pids: the processes that hold the accelerator.
        binary: path or name of ``cuda-checkpoint`` (default ``$LLMD_TIMESLICE_CUDA_CHECKPOINT`` or
            ``cuda-checkpoint`` on PATH).
        timeout_s: most seconds one CLI call may take (it is killed then).
        api: ``auto`` (ask ``--help``), ``toggle`` or ``action``.
        lock_timeout_ms: ``--timeout`` of ``--action lock`` (waits for in-flight CUDA work).
    """

    name = "cuda"
    target = "pids"
    supported_modes = (SuspendMode.OFFLOAD,)

    def __init__(
        self,
        pids: list[int],
        binary: str | None = None,
        timeout_s: float = 120.0,
        api: str = "auto",
        lock_timeout_ms: int = 10_000,
        **_ignored,
    ) -> None:
        if not pids:
            raise ValueError("the cuda backend needs at least one pid")
        if api not in ("auto", "toggle", "action"):
            raise ValueError(f"api must be auto, toggle or action, not {api!r}")
        self.pids = [int(p) for p in pids]
        self.binary = binary or os.environ.get(BINARY_ENV_VAR) or "cuda-checkpoint"
        self.timeout_s = timeout_s
        self.api = api
        self.lock_timeout_ms = lock_timeout_ms

    async def _cli(self, *args: str) -> str:
        exe = shutil.which(self.binary)
        if exe is None:
            raise BackendError(
                f"{self.binary!r} not found (PATH or ${BINARY_ENV_VAR}); install NVIDIA's "
                "cuda-checkpoint (github.com/NVIDIA/cuda-checkpoint, driver 550 or newer) in the sidecar "
                "image, or choose another snapshot backend"
            )
        proc = await asyncio.create_subprocess_exec(exe, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise BackendError(
                f"cuda-checkpoint {' '.join(args)} took more than {self.timeout_s:g} s and was killed; "
                "the process is left out of service: check the driver (nvidia-smi) and retry"
            ) from None
        text = (out.decode(errors="replace") + err.decode(errors="replace")).strip()
        if proc.returncode != 0:
            hint = ""
            low = text.lower()
            if "driver" in low or "nvml" in low or "libcuda" in low:
                hint = " (no usable NVIDIA driver: cuda-checkpoint needs driver 550 or newer on the node)"
            elif "permission" in low or "not permitted" in low:
                hint = " (give the sidecar SYS_PTRACE and shareProcessNamespace: true, same user as the workload)"
            elif "pid" in low or "process" in low:
                hint = " (is the pid visible from the sidecar? shareProcessNamespace: true)"
            raise BackendError(f"cuda-checkpoint {' '.join(args)} exited {proc.returncode}: {text[:300]}{hint}")
        return text

    async def _resolve_api(self) -> str:
        if self.api == "auto":
            try:
                self.api = "action" if "--action" in await self._cli("--help") else "toggle"
            except BackendError as exc:
                if "not found" in str(exc):
                    raise
                self.api = "toggle"
        return self.api

    async def state(self, pid: int) -> str:
        out = (await self._cli("--get-state", "--pid", str(pid))).split()
        return out[-1].lower() if out else ""

    async def _expect(self, pid: int, want: str, step: str) -> None:
        got = await self.state(pid)
        if got != want:
            raise BackendError(
                f"cuda-checkpoint {step} of pid {pid} returned 0 but its state is {got!r} "
                f"(expected {want!r}); the process is left out of service"
            )

    async def suspend(self, mode: SuspendMode, tags: list[str]) -> SuspendResult:
        if mode is not SuspendMode.OFFLOAD:
            raise BackendError("the cuda backend only offloads (SUSPEND_MODE_OFFLOAD)")
        api = await self._resolve_api()
        for pid in self.pids:
            if await self.state(pid) == "checkpointed":
                continue
            if api == "action":
                await self._cli("--action", "lock", "--pid", str(pid), "--timeout", str(self.lock_timeout_ms))
                await self._cli("--action", "checkpoint", "--pid", str(pid))
            else:
                await self._cli("--toggle", "--pid", str(pid))
            await self._expect(pid, "checkpointed", "checkpoint")
        return SuspendResult()

    async def resume(self, tags: list[str]) -> None:
        api = await self._resolve_api()
        for pid in self.pids:
            if await self.state(pid) == "running":
                continue
            if api == "action":
                await self._cli("--action", "restore", "--pid", str(pid))
                await self._cli("--action", "unlock", "--pid", str(pid))
            else:
                await self._cli("--toggle", "--pid", str(pid))
            await self._expect(pid, "running", "restore")

    async def is_suspended(self) -> bool:
        return all([await self.state(p) == "checkpointed" for p in self.pids])
