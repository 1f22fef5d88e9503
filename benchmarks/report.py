"""Shared by the benchmarks: their ``--out`` and number arguments checked before a run, the plain-text summary beside
the JSON, and a process's resident memory."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path


def prepare_out(ap: argparse.ArgumentParser, out: Path, example: str = "result.json") -> None:
    """Refuse an ``--out`` that cannot be written (``ap.error``: exit 2, naming it) and create its folder, before a
    benchmark spends its run: a directory, or a folder that cannot be created or written."""
    if out.is_dir():
        ap.error(f"--out {out} is a directory; give the JSON file to write, e.g. {out / example}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        ap.error(f"--out {out}: cannot create its folder {out.parent} ({exc.strerror})")
    if not os.access(out.parent, os.W_OK):
        ap.error(f"--out {out}: its folder {out.parent} is not writable")


def number(kind: type[int] | type[float], low: float, high: float = math.inf, what: str = "") -> Callable[[str], float]:
    """An argparse ``type``: ``kind(text)`` within ``[low, high]`` (NaN refused), else an error naming the bounds and
    ``what`` they are for."""
    noun = "a whole number" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
        if not low <= value <= high:  # NaN compares false
            bound = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"must be {bound}{what}, got {text}")
        return value

    return parse


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
