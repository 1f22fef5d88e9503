"""A stand-in for the ``pynvml`` module (nvidia-ml-py), for tests: no GPU or driver here.

It has the functions :class:`llmd_timeslice.snapshot.backends.device_memory.NvmlMemory` and the sidecar's ``Status``
call, with the shapes of nvidia-ml-py 13: ``nvmlInit``, ``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``,
``nvmlDeviceGetMemoryInfo`` (``.used``, ``.total``, ``.free`` bytes), ``nvmlDeviceGetComputeRunningProcesses``
(entries with ``.pid`` and ``.usedGpuMemory``, None where the driver cannot tell), ``nvmlDeviceGetUUID``, and
``NVMLError``. One device. The memory each process holds is scripted: :meth:`FakeNvml.script` gives a pid the
readings it will show, one per call (the last one stays), so a test plays "the memory is freed a few readings after
the engine's 200" without timing anything. ``other_bytes``: memory of processes that are not the engine's.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace


class NVMLError(Exception):
    pass


class FakeNvml:
    def __init__(self, total: int = 80 * 1024**3, other_bytes: int = 0, fail_init: str | None = None) -> None:
        self.total, self.other_bytes, self.fail_init = total, other_bytes, fail_init
        self.NVMLError = NVMLError
        self._scripts: dict[int, deque[int | None]] = {}
        self.calls = 0

    def script(self, pid: int, *readings: int | None) -> None:
        """The next readings of ``pid``'s memory (bytes; None: not listed), one per read; the last one stays."""
        self._scripts[pid] = deque(readings)

    def _process_bytes(self) -> dict[int, int]:
        self.calls += 1
        out = {}
        for pid, q in self._scripts.items():
            value = q.popleft() if len(q) > 1 else q[0]
            if value is not None:
                out[pid] = value
        return out

    # ---- the pynvml functions
    def nvmlInit(self) -> None:  # noqa: N802
        if self.fail_init:
            raise NVMLError(self.fail_init)

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        if i != 0:
            raise NVMLError("Invalid Argument")
        return 0

    def nvmlDeviceGetUUID(self, h: int) -> str:  # noqa: N802
        return "GPU-00000000-fake"

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[SimpleNamespace]:  # noqa: N802
        return [SimpleNamespace(pid=pid, usedGpuMemory=b) for pid, b in self._process_bytes().items()]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:  # noqa: N802
        used = sum(self._process_bytes().values()) + self.other_bytes
        return SimpleNamespace(used=used, total=self.total, free=self.total - used)
