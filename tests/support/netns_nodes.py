"""Nodes as hosts on this machine: network namespaces on one switch, each with its own address and hostname.

:class:`NamespaceNodes` makes ``n`` namespaces joined by a bridge that lives in a namespace of its own (the "switch"),
so the nodes reach each other and nothing else: not this machine's network, not another test's nodes (each set has
its own switch). Node ``i`` is ``10.204.T.(i + 1)`` with the hostname ``lts<T>n<i>``; every node resolves every
node's hostname through ``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts`` (only
inside that namespace). Everything else is shared, as on an allocation with a shared filesystem.

Faults, as a node meets them:

* :meth:`cut` / :meth:`restore` -- the node's cable out and back: its port on the switch goes down, so packets to
  it are lost (no refusal: a connection attempt waits for its timeout, an open connection's data is never
  acknowledged);
* :meth:`kill` -- every process of the node SIGKILLed (its kernel stays: new connections are refused, open ones
  reset), as when a node's job step is killed;
* :meth:`freeze` / :meth:`thaw` -- every process stopped and continued.

Needs root and iproute2's ``ip`` (:func:`skip_reason` says why not).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "llmd_timeslice.cli"]


def skip_reason() -> str | None:
    """Why namespace nodes cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root: not root here"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip`: not installed here"
    probe = f"ltsprobe{os.getpid()}"
    try:  # root without CAP_NET_ADMIN (a container), or no veth/bridge support: say so instead of failing
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
        _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create network namespaces with a bridge and veth pairs here: {getattr(exc, 'stderr', b'') or exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


def env() -> dict[str, str]:
    """The environment of a process on a node: this checkout first on the import path."""
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


class NamespaceNodes:
    """``n`` nodes on one switch (module docstring); :meth:`close` removes them and every process in them."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = self._claim_tag()
        self.switch = f"lts{self.tag}sw"
        self.namespaces = [f"lts{self.tag}n{i}" for i in range(n)]
        self.hostnames = list(self.namespaces)
        self.addresses = [f"10.204.{self.tag}.{i + 1}" for i in range(n)]
        try:
            _ip("-n", self.switch, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(self.addresses, self.hostnames, strict=True))
            for i, ns in enumerate(self.namespaces):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"port{i}", "netns", self.switch)
                _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0")
                _ip("-n", self.switch, "link", "set", f"port{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                etc = Path("/etc/netns") / ns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _claim_tag() -> int:
        """A switch namespace no other set uses (``ip netns add`` fails on an existing name: the claim is atomic)."""
        start = os.getpid() % 200
        for k in range(200):
            tag = (start + k) % 200 + 20
            if subprocess.run(["ip", "netns", "add", f"lts{tag}sw"], capture_output=True, check=False).returncode == 0:
                return tag
        raise RuntimeError("no free namespace tag (200 sets of namespace nodes exist?)")

    # ------------------------------------------------------------------ processes on a node
    def argv(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` on node ``i`` (cwd: this checkout)."""
        return subprocess.Popen(self.argv(i, argv), env=kw.pop("env", env()), cwd=kw.pop("cwd", REPO), **kw)

    def run(self, i: int, argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` on node ``i``, its output captured as text."""
        return subprocess.run(
            self.argv(i, argv), env=kw.pop("env", env()), cwd=REPO, capture_output=True, text=True, timeout=timeout, **kw
        )

    def pids(self, i: int) -> list[int]:
        """Every process on node ``i``."""
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[i]], capture_output=True, text=True, check=False)
        return [int(p) for p in out.stdout.split()]

    def described(self, i: int) -> list[str]:
        """``pid: command line`` of every process on node ``i`` (for an assertion's message)."""
        out = []
        for pid in self.pids(i):
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()[:160].replace(b"\0", b" ").decode()
                out.append(f"{pid}: {cmdline}")
        return out

    def _signal(self, i: int, sig: int) -> None:
        for pid in self.pids(i):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    # ------------------------------------------------------------------ faults
    def kill(self, i: int) -> None:
        """SIGKILL every process on node ``i``."""
        self._signal(i, signal.SIGKILL)

    def freeze(self, i: int) -> None:
        self._signal(i, signal.SIGSTOP)

    def thaw(self, i: int) -> None:
        self._signal(i, signal.SIGCONT)

    def cut(self, i: int) -> None:
        """Node ``i``'s port on the switch down: the others' packets to it are lost, and its to them."""
        _ip("-n", self.switch, "link", "set", f"port{i}", "down")

    def restore(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"port{i}", "up")

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Kill every process on every node, remove the namespaces and their hosts files."""
        for ns in [*getattr(self, "namespaces", []), getattr(self, "switch", "")]:
            if not ns:
                continue
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGCONT)
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
