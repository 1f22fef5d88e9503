"""Shared by the benchmarks: the plain-text summary beside the JSON, and a process's resident memory."""

from __future__ import annotations

from pathlib import Path


def write_summary(out: Path, lines: list[str]) -> None:
    """Write ``lines`` to ``out`` with the suffix ``.txt``, print them, then the paths written beside ``out`` (its
    JSON, PNG and text summary)."""
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}, {out.with_suffix('.png')}, {out.with_suffix('.txt')}")


def rss_kib(pid: int | None) -> int | None:
    """Resident memory of ``pid`` in KiB (``/proc/PID/status`` VmRSS), None if unknown."""
    if not pid:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None
