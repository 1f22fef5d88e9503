"""A Slurm cluster over namespace nodes (tests/support/netns_nodes.py): slurmctld on node 0, a slurmd on every node,
so ``srun`` starts one task per node in that node's network namespace, with the environment Slurm gives a task.

Debian's Slurm 22.05, unpacked by ``make slurm`` into ``.slurm/root`` (not installed). What running it here takes,
each a fact of this machine or of the package:

* ``AuthType=auth/none``, ``CredType=cred/none`` (both shipped by the package): no munge daemon.
* A daemon enters its node's namespace with ``nsenter --net`` rather than ``ip netns exec``, which remounts ``/sys``
  and so hides ``/sys/fs/cgroup``, where slurmd's cgroup plugin must find a mounted hierarchy or refuses to start; it
  then mounts the node's ``/etc/netns/<ns>/hosts`` over ``/etc/hosts`` itself, in a mount namespace of its own.
* slurmd runs ``/usr/sbin/slurmstepd`` (a path compiled in): an overlay puts a link to the unpacked
  ``slurmstepd-wlm`` there, in that private mount namespace only.
* slurmctld accepts to be the controller only on a host whose short name is ``SlurmctldHost``: this machine's
  hostname, at node 0's address.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.support.netns_nodes import REPO, NamespaceNodes

SLURM_ROOT = REPO / ".slurm" / "root"
LIB = SLURM_ROOT / "usr" / "lib" / "x86_64-linux-gnu"
PLUGINS = LIB / "slurm-wlm"


def skip_reason() -> str | None:
    """Why Slurm cannot run here (None: it can)."""
    if not (SLURM_ROOT / "usr" / "sbin" / "slurmd-wlm").exists():
        return "Slurm is not unpacked in .slurm (`make slurm`, as root: Debian's slurmctld/slurmd packages)"
    for tool in ("nsenter", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"running slurmd in a namespace needs util-linux's {tool}: not installed here"
    return None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class SlurmCluster:
    """slurmctld + one slurmd per node of ``nodes`` (module docstring); :meth:`close` stops them."""

    def __init__(self, nodes: NamespaceNodes, workdir: Path, kill_wait_s: int = 10) -> None:
        self.nodes = nodes
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.conf = self.dir / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []
        extra = self.dir / "sbin-extra"
        extra.mkdir(exist_ok=True)
        (extra / "slurmstepd").symlink_to(SLURM_ROOT / "usr" / "sbin" / "slurmstepd-wlm")
        self._sbin_overlay = extra
        cpus = os.cpu_count() or 1
        lines = [
            "ClusterName=lts",
            f"SlurmctldHost={socket.gethostname().split('.')[0]}({nodes.addresses[0]})",
            "AuthType=auth/none",
            "CredType=cred/none",
            f"PluginDir={PLUGINS}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.dir / 'state'}",
            f"SlurmdSpoolDir={self.dir / 'spool' / '%n'}",
            f"SlurmctldPidFile={self.dir / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.dir / 'spool' / '%n.pid'}",
            f"SlurmctldLogFile={self.dir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.dir / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "SelectType=select/linear",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SwitchType=switch/none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            f"KillWait={kill_wait_s}",
            *(
                f"NodeName={h} NodeAddr={a} CPUs={cpus} State=UNKNOWN"
                for h, a in zip(nodes.hostnames, nodes.addresses, strict=True)
            ),
            "PartitionName=p Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        (self.dir / "state").mkdir(exist_ok=True)
        for h in nodes.hostnames:
            (self.dir / "spool" / h).mkdir(parents=True, exist_ok=True)
        try:
            self._daemon(0, [str(SLURM_ROOT / "usr" / "sbin" / "slurmctld-wlm"), "-D", "-i"], "slurmctld")
            for i, h in enumerate(nodes.hostnames):
                self._daemon(i, [str(SLURM_ROOT / "usr" / "sbin" / "slurmd-wlm"), "-D", "-N", h], f"slurmd-{h}")
            self._wait_idle()
        except BaseException:
            self.close()
            raise

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's) with Slurm's tools on ``PATH`` and this cluster's configuration."""
        base = dict(os.environ if base is None else base)
        return {
            **base,
            "SLURM_CONF": str(self.conf),
            "LD_LIBRARY_PATH": f"{LIB}{os.pathsep}{PLUGINS}",
            "PATH": f"{SLURM_ROOT / 'usr' / 'bin'}{os.pathsep}{base.get('PATH', '')}",
        }

    def on_node(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run on node ``i`` as a Slurm daemon runs there (module docstring)."""
        ns = self.nodes.namespaces[i]
        script = (
            f"mount --bind /etc/netns/{ns}/hosts /etc/hosts && "
            f'mount -t overlay overlay -o lowerdir={self._sbin_overlay}:/usr/sbin /usr/sbin && exec "$@"'
        )
        return [
            "nsenter",
            f"--net=/run/netns/{ns}",
            "--",
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            *argv,
        ]

    def _daemon(self, i: int, argv: list[str], name: str) -> None:
        log = open(self.dir / f"{name}.out", "w")  # noqa: SIM115  # the daemon's stderr; closed with it
        self.daemons.append(subprocess.Popen(self.on_node(i, argv), env=self.env(), stdout=log, stderr=subprocess.STDOUT))
        log.close()

    def run(self, i: int, argv: list[str], timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        """A Slurm client command (``sinfo``, ``scancel``...) on node ``i``."""
        return subprocess.run(
            self.on_node(i, argv), env=kw.pop("env", self.env()), capture_output=True, text=True, timeout=timeout, **kw
        )

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """A Slurm client command (``srun``) on node ``i``, left running."""
        return subprocess.Popen(self.on_node(i, argv), env=kw.pop("env", self.env()), **kw)

    def _wait_idle(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        out = ""
        while time.monotonic() < deadline:
            for d in self.daemons:
                if d.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({d.args[-3:]}): {self.logs()}")
            r = self.run(0, ["sinfo", "-h", "-o", "%T %D"])
            out = r.stdout.strip()
            if out == f"idle {self.nodes.n}":
                return
            time.sleep(0.1)
        raise RuntimeError(f"Slurm's nodes not idle within {timeout_s:g} s (sinfo: {out!r}): {self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted(self.dir.glob("*.log")))

    def daemon_pids(self) -> set[int]:
        """Pids of the Slurm daemons (each the process :meth:`_daemon` started: the wrappers exec it) and of their
        helpers (slurmctld's slurmscriptd)."""
        pids = {d.pid for d in self.daemons if d.poll() is None}
        for pid in list(pids):
            for task in Path(f"/proc/{pid}/task").glob("*/children"):
                with contextlib.suppress(OSError):
                    pids.update(int(c) for c in task.read_text().split() if "slurm" in _comm(int(c)))
        return pids

    def close(self) -> None:
        """SIGKILL to every daemon: the cluster's state is thrown away with the test (on SIGTERM slurmctld would save
        it first, seconds)."""
        for d in self.daemons:
            if d.poll() is None:
                d.kill()
        for d in self.daemons:
            d.wait(5)
