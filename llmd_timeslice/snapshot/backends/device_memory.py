"""Device memory an engine holds, through NVML (``nvidia-ml-py``): per process where NVML can tell, the device's
used memory otherwise.

:class:`NvmlMemory` is the adapter over the ``pynvml`` module (or any object with the same functions: tests pass
``tests/support/fake_nvml.py``, since no GPU runs here). NVML calls used (nvidia-ml-py 13, the Python binding of
``nvml.h``): ``nvmlInit``, ``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``, ``nvmlDeviceGetMemoryInfo``
(``.used`` bytes, the whole device, every process included) and ``nvmlDeviceGetComputeRunningProcesses`` (entries
with ``.pid`` and ``.usedGpuMemory`` in bytes, None where the driver cannot tell, e.g. under some vGPU/MIG setups).

Process ids: NVML reports the pids of the node's root pid namespace. A sidecar in the engine's pod
(``shareProcessNamespace: true``) sees the pod's own namespace, so the engine's pids match only where the pod shares
the host's (``hostPID``) or NVML is namespace-aware; where none of the engine's pids is listed, the reading is the
device's used memory (scope ``device``), which counts other processes too. Each reading says its scope.

:func:`open_nvml` returns None where ``nvidia-ml-py`` is missing or NVML does not start (no driver, no device), and
says so once per process, at WARNING: device memory is then not checked after a sleep.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import psutil

log = logging.getLogger(__name__)

Scope = Literal["process", "device"]


@dataclass(frozen=True)
class MemoryReading:
    """Device memory in bytes, and what it counts: ``process`` (the engine's own pids, NVML per-process) or
    ``device`` (every process on the engine's devices)."""

    bytes: int
    scope: Scope


MemorySource = Callable[["Scope | None"], "MemoryReading | None"]
"""Reads the engine's device memory now; ``scope`` None: the finest available, else that scope (None: unknown)."""

_said_unavailable = threading.Event()


def say_unchecked_once(why: str) -> None:
    """Log, once per process, that device memory after a sleep is not checked (``why``)."""
    if not _said_unavailable.is_set():
        _said_unavailable.set()
        log.warning(
            "device memory is NOT checked after a sleep on this node: %s; sleeps are verified by the engine's own "
            "state only (docs/snapshot.md, 'Device memory after a sleep')",
            why,
        )


class NvmlMemory:
    """An engine's device memory through ``nvml`` (the ``pynvml`` module or the same functions).

    Args:
        nvml: the ``pynvml`` module, initialised (:func:`open_nvml`).
        device_indices: the devices the engine uses (None: every visible device).
        pids: the engine's processes, or a callable giving them at each reading (they change when it restarts).
    """

    def __init__(
        self, nvml: Any, device_indices: Sequence[int] | None = None, pids: Sequence[int] | Callable[[], list[int]] = ()
    ) -> None:
        self.nvml = nvml
        indices = range(nvml.nvmlDeviceGetCount()) if device_indices is None else device_indices
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        self.pids = pids
        self._last_pids: set[int] = set()

    def _pids(self, fresh: bool) -> set[int]:
        """The engine's pids: looked up again when ``fresh`` (the reading before a sleep), else those of that
        reading (one lookup per sleep, not one per poll)."""
        if not fresh:
            return self._last_pids
        try:
            self._last_pids = set(self.pids() if callable(self.pids) else self.pids)
        except Exception as exc:  # psutil errors: the pids cannot be found now
            log.debug("engine pids unknown (%r); reading the device's used memory", exc)
            self._last_pids = set()
        return self._last_pids

    def device_used(self) -> int | None:
        """Used memory summed over the devices, bytes (None: NVML failed)."""
        try:
            return sum(int(self.nvml.nvmlDeviceGetMemoryInfo(h).used) for h in self.handles)
        except Exception as exc:  # pynvml.NVMLError: GPU lost, driver reset
            log.warning("NVML nvmlDeviceGetMemoryInfo failed: %r", exc)
            return None

    def process_used(self, pids: set[int]) -> int | None:
        """Memory of ``pids`` summed over the devices, bytes; None when none of them is listed with a figure."""
        total, listed = 0, False
        try:
            for h in self.handles:
                for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(h):
                    if int(p.pid) in pids and p.usedGpuMemory is not None:
                        total, listed = total + int(p.usedGpuMemory), True
        except Exception as exc:
            log.warning("NVML nvmlDeviceGetComputeRunningProcesses failed: %r", exc)
            return None
        return total if listed else None

    def __call__(self, scope: Scope | None = None) -> MemoryReading | None:
        """A reading: per process when the engine's pids are listed (``scope`` None or ``process``), else the
        device's. With ``scope="process"`` a process no longer listed holds 0 bytes (it freed its context)."""
        if scope != "device":
            pids = self._pids(fresh=scope is None)
            used = self.process_used(pids) if pids else None
            if used is not None:
                return MemoryReading(used, "process")
            if scope == "process":
                return MemoryReading(0, "process") if pids else None
        used = self.device_used()
        return None if used is None else MemoryReading(used, "device")


def open_nvml(nvml: Any | None = None) -> Any | None:
    """``nvml`` (default: ``import pynvml``) after ``nvmlInit``, or None where it is missing or does not start
    (said once: :func:`say_unchecked_once`)."""
    module: Any = nvml
    if module is None:
        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            say_unchecked_once("nvidia-ml-py is not installed")
            return None
        module = pynvml
    try:
        module.nvmlInit()
        module.nvmlDeviceGetCount()
    except Exception as exc:  # pynvml.NVMLError: no driver / no device
        say_unchecked_once(f"NVML did not start ({exc})")
        return None
    return module


def device_reader(read: Callable[[], int | None]) -> MemorySource:
    """A :data:`MemorySource` over a plain reader of device bytes (``memory_reader=`` of the backends)."""

    def source(scope: Scope | None = None) -> MemoryReading | None:
        value = read()
        return None if value is None else MemoryReading(int(value), "device")

    return source


def engine_pids(base_url: str) -> list[int]:
    """The processes of the engine listening at ``base_url`` when it is on this host: the listener and its
    descendants (vLLM's engine core and workers are children of the API server). Empty when the engine is
    elsewhere or its socket's owner cannot be read (another user's process without ``CAP_SYS_PTRACE``)."""
    parts = urlsplit(base_url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1") or parts.port is None:
        return []
    try:
        listeners = {
            c.pid
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == parts.port and c.pid
        }
        out: list[int] = []
        for pid in sorted(listeners):
            out.append(pid)
            out.extend(child.pid for child in psutil.Process(pid).children(recursive=True))
        return out
    except (psutil.Error, OSError):
        return []


def engine_memory(
    base_url: str,
    memory_reader: Callable[[], int | None] | None = None,
    nvml: Any | None = None,
    pids: Sequence[int] | None = None,
) -> MemorySource | None:
    """The memory source of the engine at ``base_url``: ``memory_reader`` (device bytes) when given, else NVML
    (``nvml``, default ``pynvml``) per process of ``pids`` (default: :func:`engine_pids` at each reading), else None
    (no NVML: said once)."""
    if memory_reader is not None:
        return device_reader(memory_reader)
    opened = open_nvml(nvml)
    if opened is None:
        return None
    return NvmlMemory(opened, pids=list(pids) if pids is not None else (lambda: engine_pids(base_url)))
