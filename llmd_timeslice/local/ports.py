"""Which process listens on a TCP port, and whether a port is free to bind.

``llmd-timeslice up`` uses these before it starts anything (every port of the stack must be free: on a
shared node another stack may hold them) and before it calls a component ready (a server answering on
the component's port may be somebody else's; the listening socket must belong to the process group
that ``up`` started). Listeners come from ``psutil.net_connections`` (on Linux: ``/proc/net/tcp{,6}``
matched to ``/proc/<pid>/fd``); a socket of a process this user may not inspect has no pid.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass

import psutil

COMMAND_CHARS = 160
"""Longest command line shown for a listener (longer ones end in '...')."""


@dataclass(frozen=True)
class Listener:
    """A process with a TCP socket in LISTEN state on a port (``pid`` None: a process this user cannot see)."""

    pid: int | None
    command: str = ""

    def describe(self) -> str:
        if self.pid is None:
            return "a process this user cannot inspect (another user's?)"
        return f"pid {self.pid} ({self.command})" if self.command else f"pid {self.pid}"


def _command(pid: int) -> str:
    try:
        argv = psutil.Process(pid).cmdline()
    except (psutil.Error, OSError):
        return ""
    cmd = " ".join(argv)
    return cmd if len(cmd) <= COMMAND_CHARS else cmd[: COMMAND_CHARS - 3] + "..."


def listeners_on(ports: list[int] | tuple[int, ...]) -> dict[int, list[Listener]]:
    """Per port, the processes listening on it on any local address (IPv4 or IPv6), one entry per process;
    one scan of the system's sockets for all ``ports``.

    Raises:
        psutil.AccessDenied: the platform hides sockets from this user (macOS without root).
    """
    found: dict[int, dict[int | None, None]] = {p: {} for p in ports}
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in found:
            found[c.laddr.port].setdefault(c.pid)
    return {p: [Listener(pid, _command(pid) if pid is not None else "") for pid in pids] for p, pids in found.items()}


def listeners(port: int) -> list[Listener]:
    """Processes listening on TCP ``port`` (see :func:`listeners_on`)."""
    return listeners_on([port])[port]


def in_process_group(pid: int | None, pgid: int) -> bool:
    """Whether ``pid`` runs in process group ``pgid`` (children of ``up`` lead their own group)."""
    if pid is None:
        return False
    try:
        return os.getpgid(pid) == pgid
    except (ProcessLookupError, PermissionError):
        return False


def bind_error(host: str, port: int) -> OSError | None:
    """None when ``host:port`` can be bound now; else the error (``errno.EADDRINUSE``: somebody listens there).

    The trial socket sets ``SO_REUSEADDR`` as servers do (a port with connections in TIME_WAIT counts as
    free) but not ``SO_REUSEPORT``, so a listener that set ``SO_REUSEPORT`` still counts as a holder.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        return exc
    return None


def host_problem(host: str) -> str | None:
    """None when this machine can bind ``host`` (one of its addresses, a wildcard, or a name that resolves to one);
    else one line saying it is not an address of this machine, tried with port 0 (no port is taken)."""
    exc = bind_error(host, 0)
    if exc is None:
        return None
    if exc.errno == errno.EADDRNOTAVAIL:
        why = "not an address of this machine"
    elif isinstance(exc, socket.gaierror):
        why = "a name that does not resolve"
    else:
        why = "not usable here"
    return (
        f"stack.host: {host} is {why} ({exc.strerror or exc}); every component binds it: use 127.0.0.1, "
        "0.0.0.0 or an address of this machine's interfaces"
    )


def port_problems(ports: list[tuple[str, str, int]]) -> list[str]:
    """One line per port that cannot be bound: ``(where, host, port)`` in, e.g.
    ``port 8080 (stack.ports.router) on 127.0.0.1 is in use by pid 4242 (envoy -c ...)`` out. The holders of every
    port in use come from one scan of the system's sockets (:func:`listeners_on`), not one scan per port."""
    errors = [(where, host, port, bind_error(host, port)) for where, host, port in ports]
    in_use = [port for _, _, port, exc in errors if exc is not None and exc.errno == errno.EADDRINUSE]
    holders = listeners_on(in_use) if in_use else {}
    out = []
    for where, host, port, exc in errors:
        if exc is None:
            continue
        if exc.errno == errno.EADDRINUSE:
            who = ", ".join(h.describe() for h in holders[port]) or "a socket of no visible process (closing?)"
            out.append(f"port {port} ({where}) on {host} is in use by {who}")
        else:
            out.append(f"port {port} ({where}) on {host} cannot be bound: {exc.strerror or exc}")
    return out


def split_listeners(ports: list[int] | tuple[int, ...], pgid: int) -> tuple[set[int], dict[int, list[Listener]]]:
    """``(ports with a listener in process group pgid, {port: listeners outside that group})``."""
    ours: set[int] = set()
    foreign: dict[int, list[Listener]] = {}
    for port, found in listeners_on(ports).items():
        for h in found:
            if in_process_group(h.pid, pgid):
                ours.add(port)
            else:
                foreign.setdefault(port, []).append(h)
    return ours, foreign


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on this machine now (``port_for.select_random``), for a stack of free ports
    (the demo's); free when chosen, not reserved: another process may take one before the stack binds it."""
    import port_for

    picked: list[int] = []
    while len(picked) < n:
        port = port_for.select_random()
        if port not in picked:
            picked.append(port)
    return picked
