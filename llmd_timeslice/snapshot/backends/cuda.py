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

All or nothing (issue 38 §3; NVIDIA/cuda-checkpoint#30, #45): the upstream README (NVIDIA/cuda-checkpoint at
6ec728a, ``README.md``, "Functionality") says the tool "does not attempt to keep the process in a good state if an
error ... is encountered during checkpoint or restore". So a suspend that fails at any step (a lock, a checkpoint, a
state read) brings back every pid it already touched, in reverse order (``restore`` then ``unlock``; ``--toggle``
on the older CLI), so the workload runs again, and fails with the tool's own words and what the rollback did. A
resume that finds a pid ``locked`` (a suspend cut short) unlocks it. Each ``--get-state`` has its own deadline
(``state_timeout_s``, a hang while another pid is locked: cuda-checkpoint#45), named in the reason.

Refused at start (:func:`unsupported_reason`, same README): a machine that is not x86-64 ("is x64 only"), and a
process with NCCL mapped (``libnccl`` in ``/proc/PID/maps``, read with psutil): NCCL shares device memory between
processes through CUDA IPC, which the README lists as unsupported ("does not support UVM or IPC memory"). UVM
allocations cannot be seen from outside the process: a checkpoint that meets one fails and is rolled back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import shutil

import psutil

from llmd_timeslice.snapshot.backends.base import (
    BackendError,
    SnapshotBackend,
    SuspendMode,
    SuspendResult,
)

log = logging.getLogger(__name__)

BINARY_ENV_VAR = "LLMD_TIMESLICE_CUDA_CHECKPOINT"
UNSUPPORTED_LIBRARIES = ("libnccl",)
"""Shared libraries whose presence in a process cuda-checkpoint cannot handle (module doc)."""


class UnsupportedWorkload(ValueError):
    """A configuration cuda-checkpoint cannot checkpoint (module doc); refused when the backend is built."""


def unsupported_reason(pids: list[int], machine: str | None = None) -> str | None:
    """Why cuda-checkpoint cannot serve ``pids`` on this machine (module doc), or None. A pid whose maps cannot be
    read (gone, no permission) is left to the tool, which names it."""
    machine = machine or platform.machine()
    if machine not in ("x86_64", "AMD64"):
        return f"cuda-checkpoint is x64 only (NVIDIA/cuda-checkpoint README, 'Functionality'); this node is {machine}"
    for pid in pids:
        try:
            paths = {m.path for m in psutil.Process(pid).memory_maps(grouped=True)}
        except (psutil.Error, OSError):
            continue
        for lib in UNSUPPORTED_LIBRARIES:
            hit = next((p for p in sorted(paths) if os.path.basename(p).startswith(lib)), None)
            if hit:
                return (
                    f"pid {pid} has {hit} mapped: NCCL shares device memory across processes through CUDA IPC, which "
                    "cuda-checkpoint does not support (NVIDIA/cuda-checkpoint README, 'Functionality': 'does not "
                    "support UVM or IPC memory'; a checkpoint locks, then fails or hangs: cuda-checkpoint#30, #45). "
                    "Use the engine's own sleep (backend vllm or sglang) for this workload"
                )
    return None


class CudaCheckpointBackend(SnapshotBackend):
    """Checkpoint/restore the CUDA state of ``pids`` with ``cuda-checkpoint``.

    Args:
        pids: the processes that hold the accelerator.
        binary: path or name of ``cuda-checkpoint`` (default ``$LLMD_TIMESLICE_CUDA_CHECKPOINT`` or
            ``cuda-checkpoint`` on PATH).
        timeout_s: most seconds one CLI call may take (it is killed then).
        api: ``auto`` (ask ``--help``), ``toggle`` or ``action``.
        lock_timeout_ms: ``--timeout`` of ``--action lock`` (waits for in-flight CUDA work).
        state_timeout_s: most seconds one ``--get-state`` may take (module doc).
        check_workload: refuse what cuda-checkpoint cannot do (:func:`unsupported_reason`) when built.

    Raises:
        ValueError: no pid, an unknown api; :class:`UnsupportedWorkload` (a ValueError) with the reason.
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
        state_timeout_s: float = 10.0,
        check_workload: bool = True,
        **_ignored,
    ) -> None:
        if not pids:
            raise ValueError("the cuda backend needs at least one pid")
        if api not in ("auto", "toggle", "action"):
            raise ValueError(f"api must be auto, toggle or action, not {api!r}")
        if check_workload and (why := unsupported_reason([int(p) for p in pids])):
            raise UnsupportedWorkload(f"the cuda backend refuses pids {list(pids)}: {why}")
        self.state_timeout_s = state_timeout_s
        self.pids = [int(p) for p in pids]
        self.binary = binary or os.environ.get(BINARY_ENV_VAR) or "cuda-checkpoint"
        self.timeout_s = timeout_s
        self.api = api
        self.lock_timeout_ms = lock_timeout_ms

    async def _cli(self, *args: str, timeout_s: float | None = None) -> str:
        exe = shutil.which(self.binary)
        if exe is None:
            raise BackendError(
                f"{self.binary!r} not found (PATH or ${BINARY_ENV_VAR}); install NVIDIA's "
                "cuda-checkpoint (github.com/NVIDIA/cuda-checkpoint, driver 550 or newer) in the sidecar "
                "image, or choose another snapshot backend"
            )
        proc = await asyncio.create_subprocess_exec(exe, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s or self.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise BackendError(
                f"cuda-checkpoint {' '.join(args)} took more than {timeout_s or self.timeout_s:g} s and was killed "
                "(a state read hangs while another process is locked: NVIDIA/cuda-checkpoint#45); check the driver "
                "(nvidia-smi) and retry"
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
        """``--get-state`` of ``pid`` within ``state_timeout_s`` (BackendError naming the hang past it)."""
        out = (await self._cli("--get-state", "--pid", str(pid), timeout_s=self.state_timeout_s)).split()
        return out[-1].lower() if out else ""

    async def _expect(self, pid: int, want: str, step: str) -> None:
        got = await self.state(pid)
        if got != want:
            raise BackendError(
                f"cuda-checkpoint {step} of pid {pid} returned 0 but its state is {got!r} "
                f"(expected {want!r}); the process is left out of service"
            )

    async def suspend(self, mode: SuspendMode, tags: list[str]) -> SuspendResult:
        """Checkpoint every pid, all or nothing (module doc). Raises BackendError with the tool's words and what the
        rollback did."""
        if mode is not SuspendMode.OFFLOAD:
            raise BackendError("the cuda backend only offloads (SUSPEND_MODE_OFFLOAD)")
        api = await self._resolve_api()
        touched: list[int] = []
        try:
            for pid in self.pids:
                state = await self.state(pid)
                if state == "checkpointed":
                    continue
                touched.append(pid)
                if api == "action":
                    if state != "locked":  # locked: a suspend cut short; the lock is already held
                        await self._cli("--action", "lock", "--pid", str(pid), "--timeout", str(self.lock_timeout_ms))
                    await self._cli("--action", "checkpoint", "--pid", str(pid))
                else:
                    await self._cli("--toggle", "--pid", str(pid))
                await self._expect(pid, "checkpointed", "checkpoint")
        except BackendError as exc:
            raise BackendError(f"{exc}; {await self._roll_back(touched, api)}") from None
        return SuspendResult()

    async def _roll_back(self, touched: list[int], api: str) -> str:
        """Bring each pid of ``touched`` back to ``running``, last first; what happened, in words."""
        back, failed = [], []
        for pid in reversed(touched):
            try:
                await self._bring_back(pid, api)
                back.append(pid)
            except BackendError as exc:
                failed.append(f"pid {pid}: {exc}")
        done = f"rolled back: pid(s) {sorted(back)} running again" if back else "nothing to roll back"
        if failed:
            log.error("cuda-checkpoint rollback failed: %s", "; ".join(failed))
            return f"{done}; NOT rolled back ({'; '.join(failed)}): the workload may hang on its next CUDA call"
        return done + "; the workload runs, the snapshot failed"

    async def _bring_back(self, pid: int, api: str) -> None:
        """``pid`` from whatever state to ``running`` (restore, unlock), verified."""
        state = await self.state(pid)
        if state == "running":
            return
        if api == "action":
            if state == "checkpointed":
                await self._cli("--action", "restore", "--pid", str(pid))
                state = "locked"
            if state == "locked":
                await self._cli("--action", "unlock", "--pid", str(pid))
        elif state == "checkpointed":
            await self._cli("--toggle", "--pid", str(pid))
        await self._expect(pid, "running", "restore")

    async def resume(self, tags: list[str]) -> None:
        """Every pid back to ``running`` (a ``locked`` one is unlocked), verified."""
        api = await self._resolve_api()
        for pid in self.pids:
            await self._bring_back(pid, api)

    async def is_suspended(self) -> bool:
        return all([await self.state(p) == "checkpointed" for p in self.pids])
