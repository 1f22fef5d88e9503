"""The local stack as real processes: gate, orchestrator, sidecars (via the CLI) and Envoy.

Envoy calls the gate on its fast path (HTTP ext_authz, completions over the gRPC access log) and the gate
picks the endpoint itself (least in flight among the SERVING samplers), so a request costs one Python hop;
``edge="ext_proc"`` runs the other edge, with the EPP-protocol picker as a second hop.

Each component is started with ``python -m llmd_timeslice.cli ...`` under ``mirakuru`` (which
waits until its port accepts connections and stops it with SIGTERM, then SIGKILL), logging to
``<logdir>/<name>.log``. vLLM servers are started separately
(:class:`llmd_timeslice.engines.vllm_server.VllmServer`).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import port_for
import yaml
from mirakuru import TCPExecutor

from epp_plugin.envoy_config import EnvoyRouterConfig
from epp_plugin.envoy_launcher import EnvoyProcess


@dataclass
class Ports:
    """Free loopback ports for every component (chosen at construction)."""

    gate_ext_proc: int = field(default_factory=port_for.select_random)
    gate_authz: int = field(default_factory=port_for.select_random)
    gate_control: int = field(default_factory=port_for.select_random)
    gate_metrics: int = field(default_factory=port_for.select_random)
    picker: int = field(default_factory=port_for.select_random)
    orchestrator: int = field(default_factory=port_for.select_random)
    orchestrator_metrics: int = field(default_factory=port_for.select_random)
    envoy: int = field(default_factory=port_for.select_random)
    envoy_admin: int = field(default_factory=port_for.select_random)


class ComponentProcess:
    """One ``llmd-timeslice`` component as a child process, ready once ``port`` accepts connections."""

    def __init__(self, name: str, args: list[str], port: int, logdir: Path) -> None:
        self.name = name
        self.port = port
        self.log_path = logdir / f"{name}.log"
        self._log: BinaryIO | None = None
        self._args = args
        self._exec: TCPExecutor | None = None

    def start(self, timeout_s: float = 60.0) -> ComponentProcess:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - kept open for the child's lifetime; one run per file
        cmd = [sys.executable, "-m", "llmd_timeslice.cli", *self._args]
        self._exec = TCPExecutor(
            cmd, host="127.0.0.1", port=self.port, timeout=timeout_s, stdout=self._log, stderr=subprocess.STDOUT
        )
        try:
            self._exec.start()
        except Exception as exc:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name} did not start: {exc}\n--- {self.log_path} ---\n{tail}") from exc
        return self

    @property
    def pid(self) -> int | None:
        return self._exec.process.pid if self._exec is not None and self._exec.process else None

    def stop(self) -> None:
        if self._exec is not None and self._exec.running():
            self._exec.stop()
        self._exec = None
        if self._log is not None:
            self._log.close()
            self._log = None


@dataclass
class Sampler:
    """A vLLM server and its sidecar, as the inventory names them."""

    job_id: str
    engine_port: int
    sidecar_port: int
    pool: str = "default"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.engine_port}"


class LocalStack:
    """Gate, picker, sidecars, orchestrator and Envoy for one group of samplers on this machine.

    Args:
        samplers: the vLLM servers (already running) with their sidecar ports.
        workdir: logs, inventory, Envoy bootstrap and token go here.
        group_id: the group holding every sampler.
        token_file: bearer token file for the control APIs.
        max_hold_s: the gate's hold limit (Envoy's timeouts are sized above it).
        edge: ``ext_authz`` (the fast path, the gate picks the endpoint) or ``ext_proc`` (gate, then the picker).
    """

    def __init__(
        self,
        samplers: list[Sampler],
        workdir: Path,
        group_id: str,
        token_file: Path,
        max_hold_s: float = 120.0,
        log_level: str = "info",
        edge: str = "ext_authz",
    ) -> None:
        self.samplers = samplers
        self.workdir = workdir
        self.logdir = workdir / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.group_id = group_id
        self.token_file = token_file
        self.max_hold_s = max_hold_s
        self.log_level = log_level
        self.edge = edge
        self.ports = Ports()
        self.components: list[ComponentProcess] = []
        self.envoy: EnvoyProcess | None = None

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.envoy}"

    @property
    def orchestrator_addr(self) -> str:
        return f"127.0.0.1:{self.ports.orchestrator}"

    @property
    def gate_control_addr(self) -> str:
        return f"127.0.0.1:{self.ports.gate_control}"

    def write_inventory(self) -> Path:
        inv = {
            "groups": [
                {
                    "group_id": self.group_id,
                    "sleep_level": 1,
                    "sleep_level_policy": "auto",  # the trainer publishes weights each step: its samplers discard them
                    "drain_timeout_s": 30,
                    "samplers": [
                        {"pool": s.pool, "address": s.address, "sidecar": f"127.0.0.1:{s.sidecar_port}", "job_id": s.job_id}
                        for s in self.samplers
                    ],
                }
            ],
        }
        path = self.workdir / "inventory.yaml"
        path.write_text(yaml.safe_dump(inv, sort_keys=False))
        return path

    def _start(self, name: str, args: list[str], port: int) -> None:
        proc = ComponentProcess(name, [*args, "--log-level", self.log_level], port, self.logdir)
        self.components.append(proc)
        proc.start()

    def start(self, progress=lambda msg: None) -> LocalStack:
        p, tok = self.ports, ["--token-file", str(self.token_file)]
        progress("gate")
        self._start(
            "gate",
            [
                "gate",
                "--ext-proc-port",
                str(p.gate_ext_proc),
                "--authz-port",
                str(p.gate_authz),
                "--control-port",
                str(p.gate_control),
                "--max-hold-s",
                str(self.max_hold_s),
                "--metrics-port",
                str(p.gate_metrics),
                "--orchestrator",
                self.orchestrator_addr,
                "--gate-id",
                "gate-0",
                *tok,
            ],
            p.gate_control,
        )
        if self.edge == "ext_proc":
            progress("picker")
            eps = [a for s in self.samplers for a in ("--endpoint", f"{s.pool}={s.address}")]
            self._start("picker", ["picker", "--port", str(p.picker), *eps], p.picker)
        for s in self.samplers:
            progress(f"sidecar {s.job_id}")
            self._start(
                f"sidecar-{s.job_id}",
                ["sidecar", "--job-id", s.job_id, "--engine-url", f"http://{s.address}", "--port", str(s.sidecar_port), *tok],
                s.sidecar_port,
            )
        progress("orchestrator (wakes and verifies the samplers)")
        state = self.workdir / "orchestrator-state.json"
        state.unlink(missing_ok=True)  # a fresh demo: no holder carried over from an earlier run
        self._start(
            "orchestrator",
            [
                "orchestrator",
                "--inventory",
                str(self.write_inventory()),
                "--port",
                str(p.orchestrator),
                "--metrics-port",
                str(p.orchestrator_metrics),
                "--state-file",
                str(state),
                *tok,
            ],
            p.orchestrator,
        )
        progress("envoy")
        self.envoy = EnvoyProcess(
            EnvoyRouterConfig(
                listen_port=p.envoy,
                admin_port=p.envoy_admin,
                gate_port=p.gate_ext_proc,
                epp_port=p.picker if self.edge == "ext_proc" else None,
                max_hold_s=self.max_hold_s,
                gate_edge=self.edge,
                authz_port=p.gate_authz,
            ),
            self.logdir,
        ).start()
        return self

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        for c in reversed(self.components):
            c.stop()
        self.components.clear()
