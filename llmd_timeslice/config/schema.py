"""One configuration schema for every component (gate, picker, orchestrator, sidecar).

A file (YAML or JSON) holds one section per component it configures; any field can also come
from the environment: ``LLMD_TIMESLICE_<SECTION>__<FIELD>`` (``__`` steps into a section, e.g.
``LLMD_TIMESLICE_GATE__MAX_HOLD_S=30``, ``LLMD_TIMESLICE_ORCHESTRATOR__KUBERNETES__NAMESPACE=ns``;
lists and maps as JSON). The environment wins over the file, the file over the defaults. Unknown
keys are refused, in the file and in ``LLMD_TIMESLICE_<SECTION>__...`` variables alike.

Every field is also an option of the component's command (``llmd-timeslice gate --max-hold-s`` is
``gate.max_hold_s``): the commands build their options from these models (:func:`~llmd_timeslice.config.sources.cli_fields`,
``llmd_timeslice/settings_cli.py``) and resolve them with
:func:`~llmd_timeslice.config.sources.component_settings` (defaults < the
section of ``--config FILE`` < environment < options given). Durations are seconds: a number, or a string with units
(``500ms``, ``30s``, ``10m``, ``1h``, ``1m30s``). ``llmd-timeslice config check FILE`` validates a
file, ``config schema`` prints the JSON schema, ``config reference`` the Markdown reference
(``docs/configuration.md``).

Secrets stay out of it: the token itself comes from a file (``token_file``) or
``LLMD_TIMESLICE_TOKEN``, as for the commands.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ByteSize, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from llmd_timeslice.addresses import check_host_port, check_ip_port, check_network
from llmd_timeslice.domain.group_settings import GroupSettings, SleepLevel

ENV_PREFIX = "LLMD_TIMESLICE_"
ENV_DELIMITER = "__"

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any) -> Any:
    """Seconds from a number or a string like ``500ms``, ``30s``, ``10m``, ``1h``, ``1m30s``, ``2.5``."""
    if isinstance(value, bool):
        raise ValueError(f"invalid duration {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        try:
            return float(text)
        except ValueError:
            pass
        pos, total = 0, 0.0
        for m in _DURATION_PART.finditer(text):
            if m.start() != pos:
                break
            total += float(m.group(1)) * _UNIT_S[m.group(2)]
            pos = m.end()
        if text and pos == len(text):
            return total
    raise ValueError(
        f"invalid duration {value!r}: expected seconds (a number) or a number with a unit, e.g. 500ms, 30s, 10m, 1h, 1m30s"
    )


def _host_port(value: str) -> str:
    return check_host_port(value)  # one parser for every host:port (llmd_timeslice/addresses.py)


def _url(value: str) -> str:
    if not re.match(r"^https?://[^/\s:]+(:\d{1,5})?(/\S*)?$", value):
        raise ValueError(f"expected an http(s):// URL, got {value!r}")
    return value


class Seconds:
    """Marker: the field is a duration in seconds (number or ``30s``/``10m``/...)."""


@dataclass(frozen=True)
class Flag:
    """How a settings field reads on its component's command line, where that differs from the default.

    Default: option ``--<field-name>`` (underscores as dashes; ``--x/--no-x`` for a boolean), one value of the
    field's type, the field's description as help. A list field's option is repeatable.

    Attributes:
        name: the option (``--pool`` for the field ``pools``).
        help: help text when the option reads differently from the field (one item of a list or a map).
        item: for a map field: parses one ``KEY=VALUE`` value of the repeatable option into ``(key, value)``
            (raises ValueError); a map of lists collects the values of one key.
        metavar: what the help shows as the option's value.
    """

    name: str | None = None
    help: str | None = None
    item: Callable[[str], tuple[str, Any]] | None = None
    metavar: str | None = None


class RuleError(ValueError):
    """A rule between settings broken (raised by a section's model validator).

    ``field`` is the dotted field the problem is reported on; ``message`` may name other fields as
    ``{field}`` or ``{field=value}``, written ``field: value`` for a file and ``--flag value`` for a command line.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {render_refs(message, _file_ref)}")
        self.field = field
        self.message = message


_REF = re.compile(r"\{([a-z_.]+)(?:=([^}]*))?\}")


def render_refs(message: str, ref: Callable[[str, str | None], str]) -> str:
    """``message`` of a :class:`RuleError` with each ``{field}`` / ``{field=value}`` written by ``ref``."""
    return _REF.sub(lambda m: ref(m.group(1), m.group(2)), message)


def _file_ref(path: str, value: str | None) -> str:
    return path if value is None else f"{path}: {value}"


DURATION_PATTERN = r"^\s*(\d+(\.\d+)?|((\d+(\.\d+)?)(ms|s|m|h))+)\s*$"
Duration = Annotated[
    float,
    BeforeValidator(parse_duration, json_schema_input_type=float | Annotated[str, Field(pattern=DURATION_PATTERN)]),
    Seconds,
]
Port = Annotated[int, Field(ge=0, le=65535)]
HostPort = Annotated[str, AfterValidator(_host_port), Flag(metavar="HOST:PORT")]
Url = Annotated[str, AfterValidator(_url), Flag(metavar="URL")]


class LogLevel(enum.StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_enum_values=True)


def _host(default: str = "127.0.0.1", what: str = "Address the component binds to") -> Any:
    return Field(default, description=f"{what} (`0.0.0.0` in a pod).")


def _token_file() -> Any:
    return Field(
        None,
        description="File holding the control-plane bearer token; unset: the top-level `token_file`, "
        "else `$LLMD_TIMESLICE_TOKEN` (no token: authentication off, warned).",
    )


def _metrics_port() -> Any:
    return Field(0, ge=0, le=65535, description="Prometheus `/metrics` port on `host` (0 = off).")


def _log_level() -> Any:
    return Field(LogLevel.warning, description="Log level (logs go to stderr, key=value).")


def _key_value(text: str, what: str = "KEY=VALUE") -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"expected {what}, got {text!r}")
    return key, value


def _pool_endpoint(text: str) -> tuple[str, str]:
    """``POOL=ip:port`` -> ``(pool, "ip:port")`` (the last ``=`` splits: a pool name has none). An IP address, not a
    host name: the picker's answer is Envoy's ORIGINAL_DST destination header, which Envoy parses as an address and
    does not resolve (EPP protocol, GIE proposal 004: ``x-gateway-destination-endpoint`` is ``ip:port``)."""
    pool, sep, address = text.rpartition("=")
    if not sep or not pool:
        raise ValueError(f"expected POOL=ip:port, got {text!r}")
    try:
        check_ip_port(address)
    except ValueError:
        raise ValueError(f"expected POOL=ip:port (an IP address, a port in 1..65535), got {text!r}") from None
    return pool, address


class GateSettings(_Section):
    """`llmd-timeslice gate`: in front of the EPP (hold / drain / steer / release), as Envoy ext_authz + access log
    (the fast path) or ext_proc."""

    host: str = _host(what="Address every port binds to")
    ext_proc_port: Port = Field(
        9002,
        description="gRPC data-plane port: Envoy's ext_proc, its access-log service "
        "(completions of the fast path) and gRPC health only.",
    )
    authz_port: Port | None = Field(
        9005, description="HTTP data-plane port: Envoy's ext_authz checks (admissions of the fast path) only (null: not served)."
    )
    control_port: Port = Field(9003, description="Control port (GateControlService, authenticated).")
    pools: Annotated[list[str], Flag("--pool", help="An InferencePool served (repeatable).")] = Field(
        ["default"], min_length=1, description="InferencePools served."
    )
    default_pool: str = Field("default", min_length=1, description="Pool for ext_proc streams without pool metadata.")
    accept_new_pools: bool = Field(True, description="Create a pool when the orchestrator first names it.")
    max_held: int = Field(10_000, ge=1, description="Most requests held per pool; more get 429 `hold_queue_full`.")
    failed_endpoint_hold_s: Duration = Field(
        5.0,
        ge=0,
        description="Seconds an endpoint Envoy could not connect to is left out of the gate's picks and subset hints "
        "unless the orchestrator publishes a new state for it first (0: until it does).",
    )
    max_hold_s: Duration = Field(
        600.0, gt=0, le=3600, description="Most time a request is held, then 503 `hold_expired` (Envoy caps at 3600 s)."
    )
    release_rate_per_s: Annotated[float, Flag("--release-rate")] = Field(
        20_000.0, ge=0, description="Held requests released per second (0 = unbounded)."
    )
    orchestrator: HostPort | None = Field(
        None, description="Orchestrator host:port to subscribe to for endpoint states (unset: only the control API sets them)."
    )
    gate_id: str | None = Field(
        None, description="Stable id of this replica on the state stream (default host-pid; the pod name in Kubernetes)."
    )
    stale_after_s: Duration = Field(
        5.0,
        ge=0,
        le=600,
        description="Time without the orchestrator's state stream before "
        "new requests are held rather than steered by a possibly outdated view (0: never; "
        "then a partitioned gate may send requests to sleeping engines).",
    )
    lost_completion_after_s: Duration = Field(
        4560.0,
        ge=1,
        description="Time after which a fast-path admission with no "
        "access-log entry (Envoy dropped it, or died) is dropped; above Envoy's "
        "route timeout (the default fits `render-envoy`'s: hold 600 + generation 3600 + 60, plus 300).",
    )
    objectives: Annotated[Path | None, Flag(metavar="FILE")] = Field(
        None,
        description="YAML file with `objectives` (InferenceObjectives: name, pool, priority, max_hold_s) and "
        '`priority_bands` (priority, max_hold_s, hold_deadline_s) (docs/gate.md, "Priority bands"). Unset and '
        "`objectives_from_kubernetes` off: the `x-gateway-inference-objective` header is ignored.",
    )
    objectives_from_kubernetes: bool = Field(
        False,
        description="Read the InferenceObjective objects of the gate's pools (list + watch) in "
        "`objectives_namespace`, from the group the API server serves, `llm-d.ai/v1alpha2` first (as the EPP), else "
        "`inference.networking.x-k8s.io/v1alpha2`; bands still come from `objectives`. Neither served, RBAC refused "
        'or no API server: the gate serves with bands off (docs/gate.md, "Priority bands").',
    )
    objectives_recheck_s: Duration = Field(
        60.0,
        ge=1,
        le=3600,
        description="With `objectives_from_kubernetes`: how often the gate asks the discovery API again which "
        "InferenceObjective group is served (the longest watch request; the wait while none is served or RBAC "
        "refuses), seconds.",
    )
    objectives_namespace: str | None = Field(
        None, description="Namespace of the InferenceObjective objects (unset: the gate's own, else `default`)."
    )
    kubeconfig: Path | None = Field(
        None, description="Kubeconfig outside a cluster, for `objectives_from_kubernetes` (unset: in-cluster config)."
    )
    token_file: Path | None = _token_file()
    metrics_port: int = _metrics_port()
    log_level: LogLevel = _log_level()


class PickerSettings(_Section):
    """`llmd-timeslice picker`: the EPP-protocol endpoint picker for set-ups without the llm-d EPP."""

    host: str = _host()
    port: Port = Field(9004, description="ext_proc port for Envoy's EPP filter.")
    pools: Annotated[
        dict[str, list[HostPort]],
        Flag("--endpoint", help="POOL=ip:port of a model server (repeatable).", item=_pool_endpoint, metavar="POOL=IP:PORT"),
    ] = Field(min_length=1, description="Pool -> model-server endpoints (ip:port).")
    default_pool: str = Field("default", min_length=1, description="Pool for streams without pool metadata.")
    metrics_port: int = _metrics_port()
    log_level: LogLevel = _log_level()


_GROUP_DEFAULTS = GroupSettings()
"""A group's defaults (docs/group-settings.md): the Kubernetes defaults below start from them."""


class KubernetesDiscoverySettings(_Section):
    """Kubernetes discovery of the orchestrator: pods by label, watched (see `llmd_timeslice/discovery/kubernetes.py`)."""

    namespace: str | None = Field(
        None, description="Namespace of the pods (unset: the orchestrator's own, else the kubeconfig context's, else `default`)."
    )
    label_selector: str = Field(
        "timeslice.io/group",
        min_length=1,
        description="Label selector of candidate pods (samplers: `timeslice.io/role=sampler`).",
    )
    default_pool: str = Field(
        "default", min_length=1, description="Pool of sampler pods without the `timeslice.io/pool` annotation."
    )
    manage_serving_label: bool = Field(
        False, description="Keep the pod label `timeslice.io/serving` current (label fallback; needs `patch` on pods)."
    )
    engine_port: Port = Field(
        8000,
        description="Engine port when a pod has neither the `timeslice.io/engine-port` "
        "annotation nor a port on its `vllm` container.",
    )
    sidecar_port: Port = Field(
        9001,
        description="Sidecar port when a pod has neither the `timeslice.io/sidecar-port` "
        "annotation nor a container port named `ts-grpc`.",
    )
    sleep_level: SleepLevel = Field(
        _GROUP_DEFAULTS.sleep_level,
        description="Sleep level of groups whose pods do not say (`timeslice.io/sleep-level`): 1 offloads weights, 2 discards.",
    )
    drain_timeout_s: Duration = Field(
        _GROUP_DEFAULTS.drain_timeout_s,
        gt=0,
        le=3600,
        description="Drain deadline of groups whose pods do not say (`timeslice.io/drain-timeout-s`).",
    )
    watch_timeout_s: Duration = Field(
        300.0, ge=1, le=3600, description="Server-side timeout of one watch request; the next resumes where it ended."
    )
    backoff_max_s: Duration = Field(30.0, gt=0, le=600, description="Longest wait between retries after API errors.")
    kubeconfig: Path | None = Field(
        None, description="Kubeconfig outside a cluster (unset: in-cluster config, else `$KUBECONFIG` / `~/.kube/config`)."
    )


class OrchestratorSettings(_Section):
    """`llmd-timeslice orchestrator`: acquire/yield locks and phase switches."""

    discovery: Literal["static", "kubernetes"] = Field(
        "static", description="Where groups and samplers come from: the `inventory` file, or pod labels (list + watch)."
    )
    inventory: Path | None = Field(
        None, description="Static inventory file (groups and their samplers); required with `discovery` static."
    )
    kubernetes: KubernetesDiscoverySettings = Field(
        default_factory=KubernetesDiscoverySettings, description="Used with `discovery` kubernetes."
    )
    host: str = _host()
    port: Port = Field(50051, description="gRPC port (TimeSliceOrchestratorService and GateStateService).")
    upstream_compat_port: Port | None = Field(
        None,
        description="Second gRPC port serving only the upstream-compatible TimeSliceOrchestratorService (and gRPC "
        "health) WITHOUT the bearer token, plain TCP, for upstream's client, which cannot send one; restrict who "
        "reaches it (a NetworkPolicy, `upstream_compat_allowed_peers`: docs/security.md). Unset: not served.",
    )
    upstream_compat_allowed_peers: Annotated[
        list[Annotated[str, AfterValidator(check_network)]],
        Flag(
            "--upstream-compat-allowed-peer",
            help="A source address or CIDR admitted on --upstream-compat-port (repeatable).",
            metavar="CIDR",
        ),
    ] = Field(
        [],
        description="Source addresses or CIDRs admitted on `upstream_compat_port` (others: PERMISSION_DENIED); "
        "empty: every peer that reaches the port.",
    )
    state_file: Path | None = Field(
        None, description="Local state file: holders, leases and group states survive a restart (unset: kept in memory only)."
    )
    state_configmap: str | None = Field(
        None,
        description="ConfigMap (in the pods' namespace; the Kubernetes API of `kubernetes`) that keeps holders, "
        "leases and group states across restarts and takeovers.",
    )
    leader_election: bool = Field(
        False,
        description="Run as one of several replicas: only the holder of the Lease `lease_name` serves (and is Ready), "
        "restoring the state from `state_configmap` when it takes over; every command to sidecars and gates carries "
        "its term (fencing). Needs `state_configmap`; docs/operations.md.",
    )
    lease_name: str = Field(
        "llmd-timeslice-orchestrator", min_length=1, description="coordination.k8s.io/v1 Lease of the leader election."
    )
    lease_duration_s: Duration = Field(
        15.0,
        ge=2,
        le=600,
        description="Whole seconds a replica waits, after it last saw the Lease renewed, before it takes over.",
    )
    renew_deadline_s: Duration = Field(
        10.0, gt=1, le=600, description="The leader steps down when it could not renew the Lease for this long."
    )
    retry_period_s: Duration = Field(2.0, ge=1, le=60, description="Between attempts to take or renew the Lease.")
    token_file: Path | None = _token_file()
    job_tokens_file: Path | None = Field(
        None,
        description="YAML mapping job id -> that job's own token: a job's token "
        "may act only for that job (acquire, yield, lease, weights).",
    )
    require_job_tokens: bool = Field(
        False,
        description="Jobs listed in `job_tokens_file` must use their own token (the control token no longer acts for them).",
    )
    engine_audit_interval_s: Duration = Field(
        10.0,
        ge=0,
        le=3600,
        description="Between switches, read the engines of idle groups through their sidecars "
        "every this many seconds; one that restarted on its own (initial weights again) or sleeps while serving is "
        "taken out of service and woken again at the group's weight version. 0: off.",
    )
    sidecar_call_timeout_s: Duration = Field(
        6.0,
        ge=0.5,
        le=300,
        description="Deadline of the call that starts a sleep or wake on a sidecar (waiting for its connection), and "
        "of the health call that checks a sidecar silent on a command for `sidecar_probe_after_s`: a dead or cut-off "
        "sidecar fails the switch after about the sum of the two.",
    )
    sidecar_probe_after_s: Duration = Field(
        2.0,
        ge=0.1,
        le=60,
        description="A command to a sidecar without an answer after this long gets a health call checking that the "
        "sidecar is reachable, and again this often while it waits.",
    )
    placement_plan: Path | None = Field(
        None,
        description="A plan written by `llmd-timeslice plan` (plan.json): its predicted duty cycle and slowdowns are "
        "checked against the measured ones every `placement_check_interval_s` (docs/placement.md). Unset: profiles "
        "are recorded and served, nothing is checked.",
    )
    placement_check_interval_s: Duration = Field(
        300.0, ge=1, le=86400, description="Seconds between two checks of `placement_plan` (each measures over its interval)."
    )
    replan_gap: float = Field(
        0.10,
        gt=0,
        le=10,
        description="Re-plan when the measured duty cycle is this far from the plan's prediction (relative), or a job "
        "runs over its slowdown budget.",
    )
    replan_gain: float = Field(
        0.10,
        ge=0,
        le=10,
        description="Advise the re-plan when its predicted duty cycle beats the current groups' by more than this (relative).",
    )
    metrics_port: int = _metrics_port()
    log_level: LogLevel = _log_level()

    @model_validator(mode="after")
    def _discovery_needs(self) -> OrchestratorSettings:
        if self.discovery == "static":
            if self.inventory is None:
                raise RuleError("inventory", "required when {discovery=static} (or set {discovery=kubernetes})")
            if self.kubernetes.manage_serving_label:
                raise RuleError("kubernetes.manage_serving_label", "needs {discovery=kubernetes}")
        elif self.inventory is not None:
            raise RuleError("inventory", "is for {discovery=static}; with kubernetes the pods are the inventory")
        if self.state_file is not None and self.state_configmap is not None:
            raise RuleError("state_configmap", "choose one of {state_file} and {state_configmap}")
        if self.upstream_compat_port is not None and self.upstream_compat_port and self.upstream_compat_port == self.port:
            raise RuleError("upstream_compat_port", "must differ from {port} (the main port keeps the bearer token)")
        if self.upstream_compat_allowed_peers and self.upstream_compat_port is None:
            raise RuleError("upstream_compat_allowed_peers", "needs {upstream_compat_port}")
        if self.leader_election:
            if self.state_configmap is None:
                raise RuleError("leader_election", "needs {state_configmap} (the state a new leader restores)")
            from llmd_timeslice.orchestrator.election import check_timings

            try:
                check_timings(self.lease_duration_s, self.renew_deadline_s, self.retry_period_s)
            except ValueError as exc:
                raise RuleError("lease_duration_s", str(exc)) from None
        return self


class SidecarSettings(_Section):
    """`llmd-timeslice sidecar`: the snapshot sidecar of one engine (sleep / wake, verified)."""

    job_id: str = Field(min_length=1, description="Job id of the engine this sidecar serves (the pod name in Kubernetes).")
    engine_url: Url = Field("http://127.0.0.1:8000", description="URL of the vLLM server in the pod.")
    backend: Literal["vllm", "sglang", "cuda", "workload_channel"] = Field(
        "vllm",
        description="Default snapshot backend of the job: vllm, sglang (`engine_url` is the SGLang server), "
        "cuda (cuda-checkpoint on `pid`; needs shareProcessNamespace + SYS_PTRACE) or workload_channel (the job "
        "registers itself over WorkloadChannel); docs/snapshot.md.",
    )
    host: str = _host()
    port: Port = Field(9001, description="gRPC port (SnapshotAgentService).")
    idle_timeout_s: Duration = Field(60.0, gt=0, le=3600, description="Time to wait for the engine to go idle before sleep.")
    operation_timeout_s: Duration = Field(
        300.0,
        gt=0,
        le=3600,
        description="Most time one sleep or wake may take when the command names no deadline (the orchestrator sends "
        "its group's sleep_deadline_s / wake_deadline_s: docs/group-settings.md).",
    )
    hung_after_s: Duration = Field(
        5.0,
        gt=0,
        le=9,
        description="An engine that does not answer the orchestrator's audit read (its weight version and sleep state) "
        "within this long is reported hung and leaves service like a dead one, until it answers again (below the "
        "orchestrator's 10 s deadline for that read).",
    )
    pause_mode: Literal["wait", "keep", "abort"] = Field(
        "wait",
        description="vLLM /sleep mode for requests still in flight: wait (finish them), keep (freeze until "
        "wake), abort (end them with finish_reason abort). SGLang, for requests still inside after the idle wait: "
        "wait and abort end them (/pause_generation abort), keep retracts them (retract).",
    )
    min_freed_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Where NVML answers: a sleep must free at least this fraction of the device memory the engine "
        "held before it (0: that part of the check off; docs/snapshot.md, 'Device memory after a sleep').",
    )
    residual_margin_bytes: Annotated[ByteSize, Flag(metavar="SIZE")] = Field(
        ByteSize(1024**3),
        ge=0,
        description="Where NVML answers and the group sets no residual_budget_bytes for the level: a sleep's budget "
        "is the residual of the engine's first verified sleep at that level plus this (bytes or a size, e.g. 2GiB).",
    )
    memory_settle_timeout_s: Duration = Field(
        60.0,
        ge=0,
        le=3600,
        description="Most time to wait after a sleep for the engine's device memory to settle within its budget "
        "(below operation_timeout_s).",
    )
    max_identical_wake_failures: int = Field(
        3,
        ge=0,
        le=100,
        description="After this many wakes of a job failing the same way in a row, its engine is marked failed: "
        "restores fail at once naming the failure until a snapshot of it succeeds (0: never; docs/snapshot.md).",
    )
    pid: Annotated[list[int], Flag(help="cuda backend: a process to checkpoint (repeatable).")] = Field(
        default_factory=list, description="cuda backend: processes to checkpoint."
    )
    annotation: Annotated[
        dict[str, str],
        Flag(
            help="A pod annotation KEY=VALUE for per-job backend resolution (repeatable), e.g. "
            "snapshot.timeslice.io/backend=sglang; see docs/snapshot.md.",
            item=_key_value,
            metavar="KEY=VALUE",
        ),
    ] = Field(default_factory=dict, description="Pod annotations for per-job backend resolution (docs/snapshot.md).")
    command_timeout_s: Duration = Field(
        300.0, gt=0, le=3600, description="Most time a WorkloadChannel workload may take to answer a command."
    )
    probe_max_mismatched_prompts: int = Field(
        0,
        ge=0,
        le=3,
        description="vllm: probe prompts whose greedy tokens may "
        "differ from the weight version's reference before a wake fails (0: exact; "
        "1 tolerates a bf16 near-tie on GPUs; docs/snapshot.md).",
    )
    token_file: Path | None = _token_file()
    metrics_port: int = _metrics_port()
    log_level: LogLevel = _log_level()

    @model_validator(mode="after")
    def _backend_needs(self) -> SidecarSettings:
        if self.backend == "cuda" and not self.pid:
            raise RuleError("pid", "required with {backend=cuda} (the processes to checkpoint)")
        if self.memory_settle_timeout_s >= self.operation_timeout_s:
            raise RuleError("memory_settle_timeout_s", "must be below {operation_timeout_s} (a sleep includes it)")
        return self


SECTIONS: dict[str, type[BaseModel]] = {
    "gate": GateSettings,
    "picker": PickerSettings,
    "orchestrator": OrchestratorSettings,
    "sidecar": SidecarSettings,
}


class TimesliceConfig(BaseSettings):
    """Configuration of llmd-timeslice components; a section per component (absent: not configured)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_DELIMITER, extra="forbid", use_enum_values=True
    )

    token_file: Path | None = Field(
        None,
        description="Control-plane token file shared by every component (a "
        "section's own `token_file` wins); also `$LLMD_TIMESLICE_TOKEN_FILE`.",
    )
    gate: GateSettings | None = Field(None, description=GateSettings.__doc__)
    picker: PickerSettings | None = Field(None, description=PickerSettings.__doc__)
    orchestrator: OrchestratorSettings | None = Field(None, description=OrchestratorSettings.__doc__)
    sidecar: SidecarSettings | None = Field(None, description=SidecarSettings.__doc__)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        return (env_settings, init_settings)  # environment over file (passed as init values) over defaults

    def configured(self) -> list[str]:
        return [name for name in SECTIONS if getattr(self, name) is not None]

    def token_file_for(self, section: str) -> Path | None:
        own = getattr(getattr(self, section), "token_file", None)
        return own or self.token_file


class _FileOnlyConfig(TimesliceConfig):
    """The same schema without the environment (``config check --no-env``)."""

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        return (init_settings,)


def json_schema() -> dict:
    """The JSON schema of the whole file."""
    schema = TimesliceConfig.model_json_schema()
    schema["title"] = "llmd-timeslice configuration"
    return schema


# --------------------------------------------------------------------------- summary
def summary_lines(cfg: TimesliceConfig) -> list[str]:
    """A short human summary of what a configuration sets up."""
    out = []
    if cfg.gate:
        g = cfg.gate
        out.append(
            f"gate: ext_proc {g.host}:{g.ext_proc_port}, ext_authz {g.host}:{g.authz_port}, control "
            f"{g.host}:{g.control_port}, pools {g.pools}, "
            f"max_held {g.max_held}, max_hold {g.max_hold_s:g} s, orchestrator {g.orchestrator or '(none)'}"
        )
    if cfg.picker:
        p = cfg.picker
        eps = sum(len(v) for v in p.pools.values())
        out.append(f"picker: {p.host}:{p.port}, {len(p.pools)} pools, {eps} endpoints")
    if cfg.orchestrator:
        o = cfg.orchestrator
        if o.discovery == "static":
            src = f"static inventory {o.inventory}"
        else:
            k = o.kubernetes
            src = (
                f"kubernetes (namespace {k.namespace or '(own)'}, selector {k.label_selector!r}, "
                f"serving label {'managed' if k.manage_serving_label else 'not managed'})"
            )
        out.append(f"orchestrator: {o.host}:{o.port}, discovery {src}")
    if cfg.sidecar:
        s = cfg.sidecar
        out.append(f"sidecar: job {s.job_id}, {s.host}:{s.port} -> {s.engine_url} ({s.backend})")
    missing = [n for n in SECTIONS if getattr(cfg, n) is None]
    if missing:
        out.append(f"not configured: {', '.join(missing)}")
    for name in cfg.configured():
        tf = cfg.token_file_for(name)
        if tf is None and name != "picker":
            out.append(f"note: {name} has no token_file (it falls back to $LLMD_TIMESLICE_TOKEN, else no authentication)")
    return out
