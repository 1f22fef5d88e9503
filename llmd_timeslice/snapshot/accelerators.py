"""Accelerator memory for the sidecar's ``Status`` (upstream ``AcceleratorStatus``), through NVML.

``nvml_accelerators()`` returns a reader, or None when ``nvidia-ml-py`` is missing or NVML cannot
start (no driver, no GPU: this machine); ``Status`` then lists no accelerators. Tests inject a reader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Accelerator:
    """One device: ``id`` (NVML UUID), memory in bytes."""

    id: str
    memory_used_bytes: int
    memory_total_bytes: int


AcceleratorReader = Callable[[], list[Accelerator]]


def nvml_accelerators() -> AcceleratorReader | None:
    """A reader of every visible device's memory through NVML, or None where NVML is unavailable."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception as exc:  # pynvml.NVMLError: no driver / no device
        log.info("NVML unavailable (%r); Status lists no accelerators", exc)
        return None

    def read() -> list[Accelerator]:
        out = []
        for h in handles:
            uuid = pynvml.nvmlDeviceGetUUID(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append(Accelerator(uuid.decode() if isinstance(uuid, bytes) else str(uuid), int(mem.used), int(mem.total)))
        return out

    return read
