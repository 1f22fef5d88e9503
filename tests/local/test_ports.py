"""``up``'s check of the stack's ports before it starts anything (llmd_timeslice/local/ports.py)."""

from __future__ import annotations

import os
import socket

import psutil

from llmd_timeslice.local import ports
from llmd_timeslice.local.ports import free_ports, port_problems


def test_port_problems_names_each_taken_ports_holder_from_one_scan_of_the_systems_sockets(monkeypatch):
    """A refused `up` on a shared node names the holder of every taken port (a dozen, for a second stack on the
    first one's ports); the holders come from one scan of the system's sockets, not one per port (each scan reads
    every process's descriptors: seconds on a busy node)."""
    held = []
    for _ in range(3):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        held.append(s)
    (free,) = free_ports(1)
    scans: list[str] = []
    real = psutil.net_connections
    monkeypatch.setattr(ports.psutil, "net_connections", lambda kind: scans.append(kind) or real(kind=kind))
    try:
        taken = [s.getsockname()[1] for s in held]
        lines = port_problems(
            [*((f"stack.ports.p{i}", "127.0.0.1", p) for i, p in enumerate(taken)), ("free", "127.0.0.1", free)]
        )
    finally:
        for s in held:
            s.close()
    assert len(lines) == 3, lines
    for i, (line, port) in enumerate(zip(lines, taken, strict=True)):
        assert line.startswith(f"port {port} (stack.ports.p{i}) on 127.0.0.1 is in use by pid {os.getpid()} ("), line
    assert scans == ["tcp"], "one scan for every taken port"
