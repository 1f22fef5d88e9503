"""Every component's command line, built in one place from typed settings.

Two layers:

* one frozen dataclass per ``llmd-timeslice`` component (:class:`GateCommand`, :class:`PickerCommand`,
  :class:`OrchestratorCommand`, :class:`SidecarCommand`): its fields are the CLI's flags, ``None`` (or an empty
  sequence) leaves a flag out so the component's own default applies; ``args()`` is what follows
  ``llmd-timeslice``, ``argv()`` the whole command (``python -m llmd_timeslice.cli ...``). Tests and benchmarks
  that start one component alone build it with these;
* :class:`StackCommands`: every command line of one stack file (:class:`~llmd_timeslice.local.stack_file.StackFile`)
  from its settings: the gate, the picker, the orchestrator, one sidecar and one vLLM server per engine, the Envoy
  bootstrap (:class:`~llmd_timeslice.router.envoy_config.EnvoyRouterConfig`) and Envoy's own command line.
  ``llmd-timeslice up``, the demo and the benchmarks start a stack through it (:mod:`llmd_timeslice.local.up`), so
  the sizes that belong together, the route timeout (hold + longest generation + 60 s), the gate's
  lost-completion age above it and the default pool, are computed once (docs/decisions/one-stack-launcher.md).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llmd_timeslice.engines.vllm_server import VllmServer
from llmd_timeslice.local.stack_file import EngineEntry, StackFile
from llmd_timeslice.router.envoy_config import EnvoyRouterConfig, lost_completion_after_s, route_timeout_s

CLI_MODULE = "llmd_timeslice.cli"
"""The module every component runs from (``python -m llmd_timeslice.cli <component> ...``)."""


def cli_argv(args: Sequence[str], python: str | None = None) -> list[str]:
    """``[python, "-m", "llmd_timeslice.cli", *args]``; ``python`` defaults to this interpreter."""
    return [python or sys.executable, "-m", CLI_MODULE, *args]


def _flag(name: str, value: object) -> list[str]:
    """``[name, str(value)]``, ``[]`` for None; a whole float without its ``.0`` (``120.0`` -> ``120``)."""
    if value is None:
        return []
    if isinstance(value, float) and value.is_integer():
        return [name, str(int(value))]
    return [name, str(value)]


@dataclass(frozen=True)
class _Command:
    log_level: str | None = None
    """``--log-level`` (debug, info, warning, error); None: the component's default."""

    COMPONENT = ""

    def flags(self) -> list[str]:  # pragma: no cover - every component overrides it
        raise NotImplementedError

    def args(self) -> list[str]:
        """What follows ``llmd-timeslice``: the component, its flags, then ``--log-level``."""
        return [self.COMPONENT, *self.flags(), *_flag("--log-level", self.log_level)]

    def argv(self, python: str | None = None) -> list[str]:
        """The whole command line (:func:`cli_argv`)."""
        return cli_argv(self.args(), python)


@dataclass(frozen=True)
class GateCommand(_Command):
    """``llmd-timeslice gate``: ports, hold limit (seconds), orchestrator ``host:port``, pools, token file."""

    COMPONENT = "gate"
    ext_proc_port: int | None = None
    authz_port: int | None = None
    control_port: int | None = None
    metrics_port: int | None = None
    host: str | None = None
    max_hold_s: float | None = None
    max_held: int | None = None
    orchestrator: str | None = None
    gate_id: str | None = None
    default_pool: str | None = None
    pools: Sequence[str] = ()
    lost_completion_after_s: float | None = None
    objectives: Path | None = None
    token_file: Path | None = None

    def flags(self) -> list[str]:
        return [
            *_flag("--host", self.host),
            *_flag("--ext-proc-port", self.ext_proc_port),
            *_flag("--authz-port", self.authz_port),
            *_flag("--control-port", self.control_port),
            *_flag("--metrics-port", self.metrics_port),
            *_flag("--max-hold-s", self.max_hold_s),
            *_flag("--max-held", self.max_held),
            *_flag("--orchestrator", self.orchestrator),
            *_flag("--gate-id", self.gate_id),
            *_flag("--default-pool", self.default_pool),
            *_flag("--lost-completion-after-s", self.lost_completion_after_s),
            *(a for p in self.pools for a in ("--pool", p)),
            *_flag("--objectives", self.objectives),
            *_flag("--token-file", self.token_file),
        ]


@dataclass(frozen=True)
class PickerCommand(_Command):
    """``llmd-timeslice picker``: port and ``(pool, ip:port)`` endpoints."""

    COMPONENT = "picker"
    port: int | None = None
    host: str | None = None
    default_pool: str | None = None
    endpoints: Sequence[tuple[str, str]] = ()

    def flags(self) -> list[str]:
        return [
            *_flag("--host", self.host),
            *_flag("--port", self.port),
            *_flag("--default-pool", self.default_pool),
            *(a for pool, addr in self.endpoints for a in ("--endpoint", f"{pool}={addr}")),
        ]


@dataclass(frozen=True)
class OrchestratorCommand(_Command):
    """``llmd-timeslice orchestrator`` on a static inventory file."""

    COMPONENT = "orchestrator"
    inventory: Path | None = None
    port: int | None = None
    host: str | None = None
    metrics_port: int | None = None
    state_file: Path | None = None
    token_file: Path | None = None
    upstream_compat_port: int | None = None
    upstream_compat_allowed_peers: tuple[str, ...] = ()
    engine_audit_interval_s: float | None = None
    state_configmap: str | None = None
    leader_election: bool = False
    kubeconfig: str | None = None
    namespace: str | None = None
    lease_duration_s: float | None = None
    renew_deadline_s: float | None = None
    retry_period_s: float | None = None

    def flags(self) -> list[str]:
        return [
            *_flag("--inventory", self.inventory),
            *_flag("--host", self.host),
            *_flag("--port", self.port),
            *_flag("--upstream-compat-port", self.upstream_compat_port),
            *(a for peer in self.upstream_compat_allowed_peers for a in ("--upstream-compat-allowed-peer", peer)),
            *_flag("--metrics-port", self.metrics_port),
            *_flag("--state-file", self.state_file),
            *_flag("--state-configmap", self.state_configmap),
            *(["--leader-election"] if self.leader_election else []),
            *_flag("--kubeconfig", self.kubeconfig),
            *_flag("--namespace", self.namespace),
            *_flag("--lease-duration-s", self.lease_duration_s),
            *_flag("--renew-deadline-s", self.renew_deadline_s),
            *_flag("--retry-period-s", self.retry_period_s),
            *_flag("--engine-audit-interval-s", self.engine_audit_interval_s),
            *_flag("--token-file", self.token_file),
        ]


@dataclass(frozen=True)
class SidecarCommand(_Command):
    """``llmd-timeslice sidecar`` for one engine (``engine_url``: ``http://host:port``)."""

    COMPONENT = "sidecar"
    job_id: str | None = None
    engine_url: str | None = None
    port: int | None = None
    host: str | None = None
    token_file: Path | None = None

    def flags(self) -> list[str]:
        return [
            *_flag("--job-id", self.job_id),
            *_flag("--engine-url", self.engine_url),
            *_flag("--host", self.host),
            *_flag("--port", self.port),
            *_flag("--token-file", self.token_file),
        ]


def envoy_argv(binary: Path | str, bootstrap: Path, concurrency: int = 2, log_level: str = "warn") -> list[str]:
    """Envoy on a rendered bootstrap: a dynamic base id and no hot restart, so several Envoys share a machine."""
    return [
        str(binary),
        "-c",
        str(bootstrap),
        "--concurrency",
        str(concurrency),
        "--log-level",
        log_level,
        "--use-dynamic-base-id",
        "--disable-hot-restart",
    ]


class StackCommands:
    """The command lines of one stack file's components, from its settings (no file written, nothing started).

    Args:
        sf: the stack file.
        base_dir: folder that relative paths of the file are resolved against.
        workdir: where the stack keeps its files: ``inventory.yaml``, ``orchestrator-state.json``, ``logs/``.
        token_file: the control-plane bearer token file every component reads.
    """

    def __init__(self, sf: StackFile, base_dir: Path, workdir: Path, token_file: Path) -> None:
        self.sf = sf
        self.base_dir = base_dir
        self.workdir = workdir
        self.logdir = workdir / "logs"
        self.token_file = token_file
        self.inventory = workdir / "inventory.yaml"
        self.state_file = workdir / "orchestrator-state.json"
        self.objectives = workdir / "objectives.yaml"
        """The stack file's ``objectives`` / ``priority_bands`` sections as the gate's file (written by
        :meth:`write_objectives`; no file and no flag when the stack declares none)."""

    @property
    def _host(self) -> str:
        return self.sf.stack.host

    @property
    def default_pool(self) -> str:
        """The first pool: requests without a path prefix go there."""
        return self.sf.pools[0].name

    @property
    def route_timeout_s(self) -> float:
        """Envoy's route timeout (seconds): a full hold, then the longest generation, fit (:func:`route_timeout_s`)."""
        return route_timeout_s(self.sf.stack.max_hold_s, self.sf.stack.generation_timeout_s)

    @property
    def lost_completion_after_s(self) -> float:
        """The gate's age rule for lost access-log entries, above the route timeout (docs/gate.md, "Completions")."""
        return lost_completion_after_s(self.route_timeout_s)

    def sidecar(self, e: EngineEntry) -> SidecarCommand:
        return SidecarCommand(
            job_id=e.name,
            engine_url=e.base_url,
            host=self._host,
            port=e.sidecar_port,
            token_file=self.token_file,
            log_level=self.sf.stack.log_level,
        )

    def orchestrator(self) -> OrchestratorCommand:
        p = self.sf.stack.ports
        return OrchestratorCommand(
            inventory=self.inventory,
            host=self._host,
            port=p.orchestrator,
            metrics_port=p.orchestrator_metrics,
            upstream_compat_port=p.orchestrator_upstream,
            upstream_compat_allowed_peers=tuple(self.sf.stack.upstream_compat_allowed_peers)
            if p.orchestrator_upstream is not None
            else (),
            state_file=self.state_file,
            token_file=self.token_file,
            log_level=self.sf.stack.log_level,
        )

    def gate(self) -> GateCommand:
        s, p, h = self.sf.stack, self.sf.stack.ports, self._host
        return GateCommand(
            host=h,
            ext_proc_port=p.gate_ext_proc,
            authz_port=p.gate_authz,
            control_port=p.gate_control,
            metrics_port=p.gate_metrics,
            max_hold_s=s.max_hold_s,
            orchestrator=f"{h}:{p.orchestrator}",
            gate_id=f"{s.name}-gate",
            default_pool=self.default_pool,
            lost_completion_after_s=self.lost_completion_after_s,
            pools=[pool.name for pool in self.sf.pools],
            objectives=self.objectives if self.sf.gate_objectives() is not None else None,
            token_file=self.token_file,
            log_level=s.log_level,
        )

    def write_objectives(self) -> Path | None:
        """Write the gate's objectives file (the stack file's sections); None when the stack declares none."""
        objectives = self.sf.gate_objectives()
        if objectives is None:
            return None
        import yaml

        self.objectives.write_text(yaml.safe_dump(objectives.model_dump(mode="json", exclude_none=True), sort_keys=False))
        return self.objectives

    def picker(self) -> PickerCommand | None:
        """The EPP-protocol picker; None on the ``ext_authz`` edge (the gate picks the endpoint)."""
        if self.sf.stack.gate_edge == "ext_authz":
            return None
        return PickerCommand(
            host=self._host,
            port=self.sf.stack.ports.picker,
            default_pool=self.default_pool,
            endpoints=[(e.pool, e.address) for e in self.sf.engines],
            log_level=self.sf.stack.log_level,
        )

    def router(self) -> EnvoyRouterConfig:
        """Envoy's bootstrap settings: listener, gate edge, pools by path prefix, the route timeout above."""
        s, p = self.sf.stack, self.sf.stack.ports
        return EnvoyRouterConfig(
            listen_port=p.router,
            admin_port=p.router_admin,
            gate_port=p.gate_ext_proc,
            epp_port=p.picker if s.gate_edge == "ext_proc" else None,
            gate_edge=s.gate_edge,
            authz_port=p.gate_authz,
            pool=self.default_pool,
            host=self._host,
            max_hold_s=s.max_hold_s,
            upstream_timeout_s=self.route_timeout_s,
            pools_by_prefix={pool.path_prefix: pool.name for pool in self.sf.pools[1:] if pool.path_prefix},
        )

    def vllm(self, e: EngineEntry, model_dir: Path) -> VllmServer:
        """The vLLM server an engine entry with ``vllm:`` asks for, on ``model_dir`` (the built or given model).

        Raises:
            ValueError: the engine is one already running (``url:``).
        """
        v = e.vllm
        if v is None:
            raise ValueError(f"engine {e.name!r} runs already at {e.url}: the stack starts no vLLM for it")
        return VllmServer(
            model_dir,
            v.port,
            self.logdir / f"vllm-{e.name}.log",
            python=v.python,
            extra_args=v.args,
            default_args=v.cpu_defaults,
            host=e._node_host or "127.0.0.1",
        )
