"""The stack file of ``llmd-timeslice up``: components, ports, engines, pools, groups and jobs in one YAML.

Shape (every key documented in ``examples/cpu-stack.yaml``; unknown keys are refused)::

    stack:   {name, host, workdir, token_file, max_hold_s, generation_timeout_s, log_level, gate_edge, port_offset,
              placement_plan,
              ports: {router, router_admin, gate_ext_proc, gate_authz, gate_control, gate_metrics, picker,
                      orchestrator, orchestrator_metrics, orchestrator_upstream}, upstream_compat_allowed_peers}
    pools:   [{name, path_prefix}]                    # /v1/... -> the first pool; <path_prefix>v1/... -> that
                                                      # pool, the prefix stripped before the engine
    groups:  [{group_id, <any group setting: docs/group-settings.md>}]
    jobs:    [{job_id, groups, priority, sleep_level, yield_opt_out}]  # optional: per-job settings
    engines: [{name, pool, group, sidecar_port, url | vllm: {model, port, args, cpu_defaults, python, env}}]
    objectives:     [{name, pool, priority, max_hold_s}]          # optional: InferenceObjectives the gate knows
    priority_bands: [{priority, max_hold_s, hold_deadline_s}]     # optional: per band (docs/gate.md)

An engine is either **started** by the stack (``vllm:``; ``model`` a directory or ``builtin:tiny-llama``,
built locally) or **already running** at ``url``. Checks beyond the types: unique names, every reference
(pool, group) known, no port used twice, model directories present. Every check runs even when another failed, so
one pass names every problem of the file.

``stack.port_offset`` (or ``up --port-offset N``, which overrides it) is added to every port the stack binds, so a
second stack runs beside the first by one setting: the ports of ``stack.ports``, and each engine's ``sidecar_port``
and ``vllm.port`` (not the ``url`` of an engine it does not start). Its default workdir is then
``.llmd-timeslice/<name>+<offset>``.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlparse

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from llmd_timeslice import yaml_files
from llmd_timeslice.addresses import check_network
from llmd_timeslice.domain.group_settings import GroupSettings, SleepLevel
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.domain.objectives import ObjectiveEntry, Objectives, PriorityBandEntry
from llmd_timeslice.local.nodes import NodeError, Placement, allocation_nodes, place, port_clashes, resolve_node

BUILTIN_TINY = "builtin:tiny-llama"

Port = Field(ge=1, le=65535)


class StackError(Exception):
    """A stack file is unusable; ``errors`` holds one line per problem (``where: what``)."""

    def __init__(self, errors: list[str], path: Path | None = None) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors
        self.path = path


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StackPorts(_Strict):
    router: int = Field(8080, ge=1, le=65535, description="Envoy listener: OpenAI-style requests.")
    router_admin: int = Field(9901, ge=1, le=65535, description="Envoy admin (/ready, /stats/prometheus).")
    gate_ext_proc: int = Field(9002, ge=1, le=65535, description="Gate gRPC data-plane port (ext_proc, access log, health).")
    gate_authz: int = Field(9005, ge=1, le=65535, description="Gate HTTP data-plane port (ext_authz checks).")
    gate_control: int = Field(9003, ge=1, le=65535, description="Gate control API (authenticated).")
    gate_metrics: int = Field(9090, ge=1, le=65535, description="Gate Prometheus /metrics.")
    picker: int = Field(9004, ge=1, le=65535, description="EPP-protocol picker (ext_proc; with gate_edge ext_proc).")
    orchestrator: int = Field(50051, ge=1, le=65535, description="Orchestrator gRPC (TimeSlice clients connect here).")
    orchestrator_metrics: int = Field(9091, ge=1, le=65535, description="Orchestrator Prometheus /metrics.")
    orchestrator_upstream: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Orchestrator's upstream-compatible gRPC port: TimeSliceOrchestratorService only, no token, for "
        "upstream's client; admits only `stack.upstream_compat_allowed_peers` (null: not served).",
    )


class StackSettings(_Strict):
    name: str = Field("local", min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    host: str = Field("127.0.0.1", description="Bind address of every component.")
    workdir: Path | None = Field(
        None, description="Logs, state, token, rendered configs (default: <stack file folder>/.llmd-timeslice/<name>)."
    )
    token_file: Path | None = Field(
        None,
        description="Control-plane bearer token file (default: generated in workdir); one that does not exist is "
        "created, mode 0600, with a new token.",
    )
    max_hold_s: float = Field(600.0, gt=0, le=3600, description="Most seconds the gate holds a request.")
    generation_timeout_s: float = Field(
        3600.0,
        gt=0,
        le=7 * 86400,
        description="Longest generation (seconds) a client may wait for once admitted. Envoy's route timeout is "
        "max_hold_s + this + 60 s (a held request sends nothing, then the response may take this long), "
        "its stream idle timeout max_hold_s above that, and the gate's lost-completion age 300 s above it.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    gate_edge: Literal["ext_authz", "ext_proc"] = Field(
        "ext_authz",
        description="How Envoy calls the gate: ext_authz (the fast path; the gate also picks the "
        "endpoint, no picker runs) or ext_proc (then the EPP-protocol picker picks).",
    )
    port_offset: int = Field(
        0,
        ge=0,
        le=60000,
        description="Added to every port the stack binds (stack.ports, each engine's sidecar_port and vllm.port; "
        "not a running engine's url), so a second stack runs beside the first; `up --port-offset N` overrides it.",
    )
    ports: StackPorts = Field(default_factory=StackPorts)
    nodes: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="The nodes of a stack across nodes, by hostname (default: the Slurm allocation's, from "
        "SLURM_JOB_NODELIST); engines and head_node name one of them or an index into this list.",
    )
    head_node: str | int = Field(
        0, description="Node of the control plane (orchestrator, gate, Envoy): a hostname or an index (default: the first)."
    )
    node_stale_after_s: float = Field(
        10.0,
        ge=3,
        le=3600,
        description="Across nodes: a node whose `up` has not refreshed its state (every second) for this many seconds "
        "is shown as unreachable by `status -f` and `down -f`.",
    )
    upstream_compat_allowed_peers: list[Annotated[str, AfterValidator(check_network)]] = Field(
        ["127.0.0.1", "::1"],
        description="Source addresses or CIDRs admitted on `ports.orchestrator_upstream` (default: this machine only).",
    )
    placement_plan: Path | None = Field(
        None,
        description="A plan of `llmd-timeslice plan` (plan.json) the orchestrator checks against what it measures "
        "(`orchestrator --placement-plan`; `plan --apply` sets it; docs/placement.md).",
    )


class PoolEntry(_Strict):
    name: str = Field(min_length=1)
    path_prefix: str | None = Field(
        None,
        description="<path_prefix>v1/... goes to this pool, the prefix stripped "
        "before the engine (the first pool serves /v1/...).",
    )


class GroupEntry(GroupSettings):
    """A group of the stack: its id and any setting of docs/group-settings.md (the defaults are
    :class:`~llmd_timeslice.domain.group_settings.GroupSettings`'); its samplers are the engines naming it."""

    group_id: str = Field(min_length=1)


class JobEntry(_Strict):
    job_id: str = Field(min_length=1)
    groups: list[str] = Field(default_factory=list, description="Groups the settings below apply to (empty: all).")
    priority: int = 0
    sleep_level: SleepLevel | None = None
    yield_opt_out: bool = Field(False, description="Never ask this job to yield for held traffic (job_yield_opt_out).")


class VllmLaunch(_Strict):
    model: str = Field(description=f"Model directory, or {BUILTIN_TINY!r} (a tiny Llama built locally, CPU demo).")
    port: int = Field(ge=1, le=65535)
    args: list[str] = Field(default_factory=list, description="Extra vLLM CLI flags (e.g. --enable-sleep-mode on GPU).")
    cpu_defaults: bool = Field(
        True, description="Prepend the CPU-sized defaults of the demo (max-model-len 512, float32, enforce-eager); false on GPUs."
    )
    python: str | None = Field(
        None, description="Interpreter with vLLM (default: .venv-vllm/bin/python or $LLMD_TIMESLICE_VLLM_PYTHON)."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment (e.g. CUDA_VISIBLE_DEVICES).")
    startup_timeout_s: float = Field(600.0, gt=0)


class EngineEntry(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$", description="Also the sampler job id.")
    pool: str = "default"
    group: str
    sidecar_port: int = Field(ge=1, le=65535)
    url: str | None = Field(None, description="An engine already running (http://host:port); not started or stopped.")
    vllm: VllmLaunch | None = None
    node: str | int | None = Field(
        None,
        description="Node of this engine and its sidecar (hostname or index into the node list; default: the head node).",
    )

    _node_host: str | None = PrivateAttr(None)
    """Across nodes: the address of this engine's node (:meth:`StackFile.for_node`); None on one machine."""
    _url_address: str | None = PrivateAttr(None)
    """Across nodes: the address ``url``'s hostname resolves to (:meth:`StackFile.for_node`): the gate and Envoy
    route to addresses, not names. None: the url's host as written."""

    @model_validator(mode="after")
    def _one_source(self) -> EngineEntry:
        if (self.url is None) == (self.vllm is None):
            raise ValueError("give exactly one of 'url' (a running engine) or 'vllm' (started by the stack)")
        if self.url is not None:
            u = urlparse(self.url)
            if u.scheme != "http" or not u.hostname or not u.port:
                raise ValueError(f"url must be http://host:port, got {self.url!r}")
        return self

    @property
    def address(self) -> str:
        """``ip:port`` the picker routes to."""
        if self.url is not None:
            u = urlparse(self.url)
            return f"{self._url_address or u.hostname}:{u.port}"
        return f"{self._node_host or '127.0.0.1'}:{self.vllm.port}"  # type: ignore[union-attr]

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/") if self.url else f"http://{self.address}"


class StackFile(_Strict):
    stack: StackSettings = Field(default_factory=StackSettings)
    pools: list[PoolEntry] = Field(default_factory=lambda: [PoolEntry(name="default")], min_length=1)
    groups: list[GroupEntry] = Field(min_length=1)
    jobs: list[JobEntry] = Field(default_factory=list)
    engines: list[EngineEntry] = Field(min_length=1)
    objectives: list[ObjectiveEntry] = Field(
        default_factory=list,
        description="InferenceObjectives the gate knows (the `x-gateway-inference-objective` header names one); "
        "pool unset: the first pool.",
    )
    priority_bands: list[PriorityBandEntry] = Field(default_factory=list, description="Settings per priority band.")

    def with_port_offset(self, offset: int) -> StackFile:
        """This stack with ``offset`` added to every port it binds (module docstring) and ``stack.port_offset`` set to
        it; the file's own ports are the base (an offset replaces the file's ``port_offset``, it does not add to it).
        Not validated again: :meth:`problems` names a port the offset moves past 65535."""
        if offset == self.stack.port_offset == 0:
            return self
        ports = self.stack.ports.model_copy(
            update={k: v + offset for k, v in self.stack.ports.model_dump().items() if v is not None}
        )
        engines = [
            e.model_copy(
                update={
                    "sidecar_port": e.sidecar_port + offset,
                    **({"vllm": e.vllm.model_copy(update={"port": e.vllm.port + offset})} if e.vllm else {}),
                }
            )
            for e in self.engines
        ]
        stack = self.stack.model_copy(update={"ports": ports, "port_offset": offset})
        return self.model_copy(update={"stack": stack, "engines": engines})

    def gate_objectives(self) -> Objectives | None:
        """The gate's ``--objectives`` file content (None: neither section given, the header is ignored).

        Raises:
            pydantic.ValidationError: duplicate objectives or bands (:meth:`problems` reports them first).
        """
        if not self.objectives and not self.priority_bands:
            return None
        return Objectives(objectives=self.objectives, priority_bands=self.priority_bands)

    def problems(self, base_dir: Path) -> list[str]:
        """Cross-field checks: duplicates, unknown references, port clashes, missing model directories."""
        out: list[str] = []

        def dupes(kind: str, names: list[str]) -> None:
            for n in sorted({n for n in names if names.count(n) > 1}):
                out.append(f"{kind}: {n!r} is declared more than once")

        dupes("pools", [p.name for p in self.pools])
        dupes("groups", [g.group_id for g in self.groups])
        dupes("engines", [e.name for e in self.engines])
        dupes("jobs", [j.job_id for j in self.jobs])
        pools, groups = {p.name for p in self.pools}, {g.group_id for g in self.groups}
        for i, e in enumerate(self.engines):
            if e.pool not in pools:
                out.append(f"engines[{i}] ({e.name}).pool: unknown pool {e.pool!r}; declared: {sorted(pools)}")
            if e.group not in groups:
                out.append(f"engines[{i}] ({e.name}).group: unknown group {e.group!r}; declared: {sorted(groups)}")
            if e.vllm is not None and e.vllm.model != BUILTIN_TINY:
                model = self.resolve(base_dir, e.vllm.model)
                if not (model / "config.json").is_file():
                    out.append(f"engines[{i}] ({e.name}).vllm.model: no model directory (config.json) at {model}")
        for j, job in enumerate(self.jobs):
            for g in job.groups:
                if g not in groups:
                    out.append(f"jobs[{j}] ({job.job_id}).groups: unknown group {g!r}; declared: {sorted(groups)}")
        local = {"127.0.0.1", "localhost", "0.0.0.0", self.stack.host}
        head = self._node_key(self.stack.head_node, "stack.head_node", out)
        ports = [(head, f"stack.ports.{k}", v) for k, v in self.stack.ports.model_dump().items() if v is not None]
        for i, e in enumerate(self.engines):
            node = head if e.node is None else self._node_key(e.node, f"engines[{i}] ({e.name}).node", out)
            ports.append((node, f"engines[{i}] ({e.name}).sidecar_port", e.sidecar_port))
            if e.vllm is not None:
                ports.append((node, f"engines[{i}] ({e.name}).vllm.port", e.vllm.port))
            elif urlparse(e.url).hostname in local:
                ports.append((node, f"engines[{i}] ({e.name}).url", urlparse(e.url).port))
        for _, where, port in ports:
            if port > 65535:
                out.append(f"{where}: port {port} is above 65535 with stack.port_offset {self.stack.port_offset}")
        clashes = port_clashes([p for p in ports if p[2] <= 65535])
        out += [c.replace(" on node '-'", "") for c in clashes]
        prefixes = [p.path_prefix for p in self.pools[1:]]
        for i, p in enumerate(self.pools[1:], 1):
            if not p.path_prefix or not p.path_prefix.startswith("/") or not p.path_prefix.strip("/"):
                out.append(
                    f"pools[{i}] ({p.name}).path_prefix: pools after the first need a path prefix starting "
                    "with '/', other than '/' itself (the first pool serves '/v1/')"
                )
        dupes("pools.path_prefix", [p for p in prefixes if p])
        for i, o in enumerate(self.objectives):
            if o.pool is not None and o.pool not in pools:
                out.append(f"objectives[{i}] ({o.name}).pool: unknown pool {o.pool!r}; declared: {sorted(pools)}")
        try:
            objectives = self.gate_objectives()
        except ValidationError as exc:
            out += [line.removeprefix("(top level): ") for line in yaml_files.validation_lines(exc, Objectives)]
        else:
            if objectives is not None:
                out += [
                    f"{line} (stack.max_hold_s)" if "gate's max_hold_s" in line else line
                    for line in objectives.check(self.stack.max_hold_s, self.pools[0].name)
                ]
        return out

    def across_nodes(self) -> bool:
        """Whether the stack places components on nodes (``stack.nodes`` or an engine's ``node``)."""
        return bool(self.stack.nodes) or any(e.node is not None for e in self.engines)

    def for_node(self, host: str, engine_hosts: Mapping[str, str], url_addresses: Mapping[str, str] | None = None) -> StackFile:
        """This stack as the node at ``host`` runs it: every component here binds to ``host`` (``stack.host``), and
        each engine is reached at its node's address (``engine_hosts``: engine name -> address), which the head's
        inventory and routes name; an engine given by ``url`` is routed to at ``url_addresses[name]`` (its url's
        hostname resolved) when given."""
        engines = []
        for e in self.engines:
            e = e.model_copy()
            e._node_host = engine_hosts.get(e.name)
            e._url_address = (url_addresses or {}).get(e.name)
            engines.append(e)
        return self.model_copy(update={"stack": self.stack.model_copy(update={"host": host}), "engines": engines})

    def placement(self, env: Mapping[str, str] | None = None) -> Placement:
        """Where each engine and the control plane run (:func:`~llmd_timeslice.local.nodes.place`) on the node list
        of ``stack.nodes`` or the Slurm allocation; one machine (neither): everything on ``stack.host``.

        Raises:
            NodeError: a node not in the allocation, or none named in a stack that places engines on nodes.
        """
        nodes = allocation_nodes(self.stack.nodes, env)
        if nodes is None:
            if any(e.node is not None for e in self.engines):
                raise NodeError(["engines: they name nodes, but there is no node list (stack.nodes or a Slurm allocation)"])
            nodes = [self.stack.host]
        placement = place(nodes, self.stack.head_node, [(e.name, e.node) for e in self.engines])
        clashes = port_clashes(
            [
                (placement.engines[e.name], f"engines[{i}] ({e.name}).{k}", v)
                for i, e in enumerate(self.engines)
                for k, v in (("sidecar_port", e.sidecar_port), ("vllm.port", e.vllm.port if e.vllm else None))
                if v
            ]
            + [(placement.head, f"stack.ports.{k}", v) for k, v in self.stack.ports.model_dump().items() if v]
        )
        if clashes:
            raise NodeError(clashes)
        return placement

    def _node_key(self, ref: str | int, where: str, out: list[str]) -> str:
        """The node ``ref`` names, for the per-node port check: resolved in ``stack.nodes`` when declared (a name not
        in it appended to ``out``), else as written (the Slurm allocation is resolved at ``up``); ``-`` on one
        machine."""
        if not self.across_nodes():
            return "-"
        if not self.stack.nodes:
            return str(ref)
        try:
            return resolve_node(ref, self.stack.nodes, where)
        except NodeError as exc:
            out += exc.errors
            return str(ref)

    @staticmethod
    def resolve(base_dir: Path, path: str | os.PathLike) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else (base_dir / p).resolve()

    def workdir(self, base_dir: Path) -> Path:
        if self.stack.workdir is not None:
            return self.resolve(base_dir, self.stack.workdir)
        suffix = f"+{self.stack.port_offset}" if self.stack.port_offset else ""
        return base_dir / ".llmd-timeslice" / f"{self.stack.name}{suffix}"

    def summary_lines(self, base_dir: Path) -> list[str]:
        """A short human summary (``llmd-timeslice config check`` on a stack file)."""
        p = self.stack.ports
        started = [e for e in self.engines if e.vllm is not None]
        out = [
            f"stack {self.stack.name!r} on {self.stack.host}, workdir {self.workdir(base_dir)}",
            f"router http://{self.stack.host}:{p.router}, orchestrator {self.stack.host}:{p.orchestrator}, "
            + (
                f"gate ext_authz {p.gate_authz} (fast path, the gate picks) / access log {p.gate_ext_proc} / control "
                f"{p.gate_control}, no picker"
                if self.stack.gate_edge == "ext_authz"
                else f"gate ext_proc {p.gate_ext_proc} / control {p.gate_control}, picker {p.picker}"
            )
            + f", max hold {self.stack.max_hold_s:g} s",
            f"pools: {', '.join(pl.name + (f' ({pl.path_prefix})' if pl.path_prefix else ' (/)') for pl in self.pools)}",
            f"groups: {', '.join(f'{g.group_id} (sleep level {g.sleep_level}, {g.policy})' for g in self.groups)}",
        ]
        for e in self.engines:
            src = f"started: vllm {e.vllm.model} on port {e.vllm.port}" if e.vllm is not None else f"running at {e.url}"
            out.append(f"engine {e.name}: pool {e.pool}, group {e.group}, sidecar {e.sidecar_port}, {src}")
        out.append(f"{len(started)} of {len(self.engines)} engines started by the stack")
        if self.objectives or self.priority_bands:
            bands = ", ".join(
                f"{b.priority}" + (f" (deadline {b.hold_deadline_s:g} s)" if b.hold_deadline_s is not None else "")
                for b in sorted(self.priority_bands, key=lambda b: -b.priority)
            )
            out.append(
                f"objectives: {', '.join(f'{o.name} ({o.priority})' for o in self.objectives) or 'none'}; "
                f"priority bands: {bands or 'none declared'}"
            )
        return out

    def inventory(self) -> Inventory:
        """The orchestrator's static inventory: groups with their samplers and per-job settings."""
        groups = []
        sidecar_host = "127.0.0.1" if self.stack.host in ("0.0.0.0", "::") else self.stack.host
        for g in self.groups:
            jobs = [j for j in self.jobs if not j.groups or g.group_id in j.groups]
            groups.append(
                {
                    **g.model_dump(),
                    "job_priorities": {**g.job_priorities, **{j.job_id: j.priority for j in jobs if j.priority}},
                    "job_sleep_levels": {
                        **g.job_sleep_levels,
                        **{j.job_id: j.sleep_level for j in jobs if j.sleep_level is not None},
                    },
                    "job_yield_opt_out": sorted({*g.job_yield_opt_out, *(j.job_id for j in jobs if j.yield_opt_out)}),
                    "samplers": [
                        {
                            "pool": e.pool,
                            "address": e.address,
                            "sidecar": f"{e._node_host or sidecar_host}:{e.sidecar_port}",
                            "job_id": e.name,
                        }
                        for e in self.engines
                        if e.group == g.group_id
                    ],
                }
            )
        return Inventory.model_validate({"groups": groups})


STACK_KEYS = ("stack", "pools", "groups", "jobs", "engines", "objectives", "priority_bands")
"""Top-level keys of a stack file."""
EMPTY_FILE = "the file is empty: nothing to check or start (see examples/cpu-stack.yaml)"
"""What ``up -f`` and ``config check`` both answer for an empty file (or ``{}``)."""


def looks_like_stack_file(data: object) -> bool:
    """Whether parsed YAML is meant as a stack file: a mapping with ``stack`` or ``engines`` and no key outside
    :data:`STACK_KEYS` that a component configuration has (``gate``, ``orchestrator``, ...)."""
    if not isinstance(data, dict) or not ({"stack", "engines"} & set(data)):
        return False
    from llmd_timeslice.config import SECTIONS

    return not (set(SECTIONS) & set(data))


def load_stack_file(path: str | os.PathLike, port_offset: int | None = None) -> StackFile:
    """Parse and check a stack file; ``port_offset`` (``up --port-offset``), when given, replaces the file's
    ``stack.port_offset`` (:meth:`StackFile.with_port_offset`).

    Raises:
        StackError: one line per problem (YAML syntax, unknown keys, wrong types, duplicates, unknown
            pools or groups, port clashes, missing model directories).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    try:
        return _load(path, port_offset)
    except StackError as exc:
        exc.path = path
        raise


def _load(path: Path, port_offset: int | None) -> StackFile:
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise StackError([yaml_files.not_text(exc)]) from None
    try:
        data = yaml_files.load(text)
    except yaml.YAMLError as exc:
        raise StackError([yaml_files.error_text(exc)]) from None
    if data is None or data == {}:
        raise StackError([EMPTY_FILE])
    if not isinstance(data, dict):
        raise StackError([f"the file must be a mapping with {', '.join(STACK_KEYS)}"])
    try:
        sf = StackFile.model_validate(data)
    except ValidationError as exc:
        lines = yaml_files.validation_lines(exc, StackFile)
        raise StackError(lines + [ln for ln in _problems_despite(data, exc, path) if ln not in lines]) from None
    if port_offset is not None and not 0 <= port_offset <= 60000:
        raise StackError([f"--port-offset: {port_offset} is not in 0..60000"])
    sf = sf.with_port_offset(sf.stack.port_offset if port_offset is None else port_offset)
    problems = sf.problems(path.resolve().parent)
    if problems:
        raise StackError(problems)
    return sf


_ENTRY_LISTS = ("pools", "groups", "jobs", "engines", "objectives", "priority_bands")
_ENTRY_INDEX = re.compile(r"\b(" + "|".join(_ENTRY_LISTS) + r")\[(\d+)\]")


def _problems_despite(data: dict, exc: ValidationError, path: Path) -> list[str]:
    """The cross-field problems (:meth:`StackFile.problems`) of a file that also has type or range errors, so that
    one pass names them all: every invalid value is taken out (a ``stack`` key falls back to its default; a list
    entry with an invalid or missing required value, or an error of its own, is left out), the rest validated again
    and checked. Lines about what was taken out are dropped (its default may clash, a reference to a left-out group
    is not a second problem), and entries keep their indices in the file. Nothing when the rest is still invalid."""
    data = copy.deepcopy(data)
    repaired: set[str] = set()
    left_out: dict[str, set[int]] = {k: set() for k in _ENTRY_LISTS}
    for _ in range(3):
        for err in sorted(exc.errors(), key=lambda e: [str(p) for p in e["loc"]], reverse=True):
            loc = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
            if len(loc) >= 2 and loc[0] in left_out and isinstance(loc[1], int):
                if err["type"] == "missing" or len(loc) == 2 or loc[2] in ("name", "group_id"):
                    left_out[str(loc[0])].add(loc[1])
                    continue
            elif not loc or loc[0] != "stack" or err["type"] == "missing":
                return []
            if not _delete_at(data, loc):
                return []
            repaired.add(yaml_files.loc_text(loc))
        kept = {k: [i for i in range(len(data.get(k) or [])) if i not in gone] for k, gone in left_out.items()}
        trial = {k: ([v[i] for i in kept[k]] if k in left_out and isinstance(v, list) else v) for k, v in data.items()}
        try:
            sf = StackFile.model_validate(trial)
        except ValidationError as again:
            exc = again
            continue
        sf = sf.with_port_offset(sf.stack.port_offset)
        names = {
            str(e.get(key))
            for lst, key in (("groups", "group_id"), ("pools", "name"))
            for i, e in enumerate(data.get(lst) or [])
            if i in left_out[lst] and isinstance(e, dict)
        }

        def in_file(m: re.Match, kept: dict[str, list[int]] = kept) -> str:
            return f"{m.group(1)}[{kept[m.group(1)][int(m.group(2))]}]"

        out = []
        for line in sf.problems(path.resolve().parent):
            line = _ENTRY_INDEX.sub(in_file, line)
            where = line.split(":", 1)[0].split(" (")[0]
            if any(where == r or where.startswith(r + ".") for r in repaired):
                continue
            if any(f"unknown group {n!r}" in line or f"unknown pool {n!r}" in line for n in names):
                continue
            out.append(line)
        return out
    return []


def _delete_at(data: object, loc: tuple) -> bool:
    """Removes the value at ``loc`` (keys and list indices) from ``data``; False when it is not there."""
    *parents, last = loc
    for part in parents:
        try:
            data = data[part]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            return False
    try:
        del data[last]  # type: ignore[attr-defined]
    except (KeyError, IndexError, TypeError):
        return False
    return True
