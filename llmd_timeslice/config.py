"""One configuration schema for every component (gate, picker, orchestrator, sidecar).

A file (YAML or JSON) holds one section per component it configures; any field can also come
from the environment: ``LLMD_TIMESLICE_<SECTION>__<FIELD>`` (``__`` steps into a section, e.g.
``LLMD_TIMESLICE_GATE__MAX_HOLD_S=30``, ``LLMD_TIMESLICE_ORCHESTRATOR__KUBERNETES__NAMESPACE=ns``;
lists and maps as JSON). The environment wins over the file, the file over the defaults. Unknown
keys are refused, in the file and in ``LLMD_TIMESLICE_<SECTION>__...`` variables alike.

Every field mirrors one command-line option of the component's command (``llmd-timeslice gate
--max-hold-s`` is ``gate.max_hold_s``). Durations are seconds: a number, or a string with units
(``500ms``, ``30s``, ``10m``, ``1h``, ``1m30s``). ``llmd-timeslice config check FILE`` validates a
file, ``config schema`` prints the JSON schema, ``config reference`` the Markdown reference
(``docs/configuration.md``).

Secrets stay out of it: the token itself comes from a file (``token_file``) or
``LLMD_TIMESLICE_TOKEN``, as for the commands.
"""

from __future__ import annotations

import difflib
import enum
import json
import os
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import annotated_types
import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

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
    raise ValueError(f"invalid duration {value!r}: expected seconds (a number) or a number with a unit, "
                     f"e.g. 500ms, 30s, 10m, 1h, 1m30s")


def _host_port(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port with a port in 1..65535, got {value!r}")
    return value


def _url(value: str) -> str:
    if not re.match(r"^https?://[^/\s:]+(:\d{1,5})?(/\S*)?$", value):
        raise ValueError(f"expected an http(s):// URL, got {value!r}")
    return value


class Seconds:
    """Marker: the field is a duration in seconds (number or ``30s``/``10m``/...)."""


DURATION_PATTERN = r"^\s*(\d+(\.\d+)?|((\d+(\.\d+)?)(ms|s|m|h))+)\s*$"
Duration = Annotated[float, BeforeValidator(parse_duration,
                                            json_schema_input_type=float | Annotated[str, Field(pattern=DURATION_PATTERN)]),
                     Seconds]
Port = Annotated[int, Field(ge=0, le=65535)]
HostPort = Annotated[str, AfterValidator(_host_port)]
Url = Annotated[str, AfterValidator(_url)]


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
    return Field(None, description="File holding the control-plane bearer token; unset: the top-level `token_file`, "
                                   "else `$LLMD_TIMESLICE_TOKEN` (no token: authentication off, warned).")


def _metrics_port() -> Any:
    return Field(0, ge=0, le=65535, description="Prometheus `/metrics` port on `host` (0 = off).")


def _log_level() -> Any:
    return Field(LogLevel.warning, description="Log level (logs go to stderr, key=value).")


class GateSettings(_Section):
    """`llmd-timeslice gate`: in front of the EPP (hold / drain / steer / release), as Envoy ext_authz + access log
    (the fast path) or ext_proc."""

    host: str = _host(what="Address every port binds to")
    ext_proc_port: Port = Field(9002, description="gRPC data-plane port: Envoy's ext_proc, its access-log service "
                                                  "(completions of the fast path) and gRPC health only.")
    authz_port: Port = Field(9005, description="HTTP data-plane port: Envoy's ext_authz checks (admissions of the "
                                               "fast path) only.")
    control_port: Port = Field(9003, description="Control port (GateControlService, authenticated).")
    pools: list[str] = Field(["default"], min_length=1, description="InferencePools served (`--pool`, repeatable).")
    default_pool: str = Field("default", min_length=1, description="Pool for ext_proc streams without pool metadata.")
    accept_new_pools: bool = Field(True, description="Create a pool when the orchestrator first names it (no flag).")
    max_held: int = Field(10_000, ge=1, description="Most requests held per pool; more get 429 `hold_queue_full`.")
    max_hold_s: Duration = Field(600.0, gt=0, le=3600,
                                 description="Most time a request is held, then 503 `hold_expired` (Envoy caps at 3600 s).")
    release_rate_per_s: float = Field(20_000.0, ge=0,
                                      description="Held requests released per second (0 = unbounded) (`--release-rate`).")
    orchestrator: HostPort | None = Field(None, description="Orchestrator host:port to subscribe to for endpoint states "
                                                            "(unset: only the control API sets them).")
    gate_id: str | None = Field(None, description="Stable id of this replica on the state stream (default host-pid; "
                                                  "the pod name in Kubernetes).")
    stale_after_s: Duration = Field(5.0, ge=0, le=600, description="Time without the orchestrator's state stream before "
                                    "new requests are held rather than steered by a possibly outdated view (0: never).")
    lost_completion_after_s: Duration = Field(900.0, ge=1, description="Time after which a fast-path admission with no "
                                              "access-log entry (Envoy dropped it, or died) is dropped; above Envoy's "
                                              "route timeout.")
    token_file: Path | None = _token_file()
    metrics_port: int = _metrics_port()
    log_level: LogLevel = _log_level()


class PickerSettings(_Section):
    """`llmd-timeslice picker`: the EPP-protocol endpoint picker for set-ups without the llm-d EPP."""

    host: str = _host()
    port: Port = Field(9004, description="ext_proc port for Envoy's EPP filter.")
    pools: dict[str, list[HostPort]] = Field(
        {}, description="Pool -> model-server endpoints (ip:port) (`--endpoint POOL=ip:port`, repeatable).")
    default_pool: str = Field("default", min_length=1, description="Pool for streams without pool metadata.")
    metrics_port: int = _metrics_port()
    log_level: LogLevel = _log_level()


class KubernetesDiscoverySettings(_Section):
    """Kubernetes discovery of the orchestrator: pods by label, watched (see `llmd_timeslice/discovery/kubernetes.py`)."""

    namespace: str | None = Field(None, description="Namespace of the pods (unset: the orchestrator's own, else the "
                                                     "kubeconfig context's, else `default`).")
    label_selector: str = Field("timeslice.io/group", min_length=1,
                                description="Label selector of candidate pods (samplers: `timeslice.io/role=sampler`).")
    default_pool: str = Field("default", min_length=1,
                              description="Pool of sampler pods without the `timeslice.io/pool` annotation.")
    manage_serving_label: bool = Field(False, description="Keep the pod label `timeslice.io/serving` current (label "
                                                          "fallback; needs `patch` on pods).")
    engine_port: Port = Field(8000, description="Engine port when a pod has neither the `timeslice.io/engine-port` "
                                                "annotation nor a port on its `vllm` container (no flag).")
    sidecar_port: Port = Field(9001, description="Sidecar port when a pod has neither the `timeslice.io/sidecar-port` "
                                                 "annotation nor a container port named `ts-grpc` (no flag).")
    sleep_level: Literal[1, 2] = Field(1, description="Sleep level of groups whose pods do not say "
                                                      "(`timeslice.io/sleep-level`): 1 offloads weights, 2 discards (no flag).")
    drain_timeout_s: Duration = Field(60.0, gt=0, le=3600, description="Drain deadline of groups whose pods do not "
                                                                      "say (`timeslice.io/drain-timeout-s`) (no flag).")
    watch_timeout_s: Duration = Field(300.0, ge=1, le=3600, description="Server-side timeout of one watch request; "
                                                                       "the next resumes where it ended (no flag).")
    backoff_max_s: Duration = Field(30.0, gt=0, le=600, description="Longest wait between retries after API errors "
                                                                    "(no flag).")
    kubeconfig: Path | None = Field(None, description="Kubeconfig outside a cluster (unset: in-cluster config, else "
                                                      "`$KUBECONFIG` / `~/.kube/config`) (no flag).")


class OrchestratorSettings(_Section):
    """`llmd-timeslice orchestrator`: acquire/yield locks and phase switches."""

    discovery: Literal["static", "kubernetes"] = Field(
        "static", description="Where groups and samplers come from: the `inventory` file, or pod labels.")
    inventory: Path | None = Field(None, description="Static inventory file (groups and their samplers); required "
                                                     "with `discovery: static`.")
    kubernetes: KubernetesDiscoverySettings = Field(default_factory=KubernetesDiscoverySettings,
                                                    description="Used with `discovery: kubernetes`.")
    host: str = _host()
    port: Port = Field(50051, description="gRPC port (TimeSliceOrchestratorService and GateStateService).")
    state_file: Path | None = Field(None, description="Local state file: holders, leases and group states survive a "
                                    "restart (unset: kept in memory only).")
    state_configmap: str | None = Field(None, description="With `discovery: kubernetes`: ConfigMap that keeps holders, "
                                                          "leases and group states across restarts.")
    token_file: Path | None = _token_file()
    job_tokens_file: Path | None = Field(None, description="YAML mapping job id -> that job's own token: a job's token "
                                                           "may act only for that job (acquire, yield, lease, weights).")
    require_job_tokens: bool = Field(False, description="Jobs listed in `job_tokens_file` must use their own token.")
    engine_audit_interval_s: Duration = Field(
        10.0, ge=0, le=3600, description="Between switches, read the engines of idle groups through their sidecars "
        "every this many seconds; one that restarted on its own (initial weights again) or sleeps while serving is "
        "taken out of service and woken again at the group's weight version. 0: off.")
    metrics_port: int = _metrics_port()
    log_level: LogLevel = _log_level()

    @model_validator(mode="after")
    def _discovery_needs(self) -> OrchestratorSettings:
        if self.discovery == "static" and self.inventory is None:
            raise ValueError("inventory: required when discovery is static (or set discovery: kubernetes)")
        if self.discovery == "static" and self.kubernetes.manage_serving_label:
            raise ValueError("kubernetes.manage_serving_label: needs discovery: kubernetes")
        return self


class SidecarSettings(_Section):
    """`llmd-timeslice sidecar`: the snapshot sidecar of one engine (sleep / wake, verified)."""

    job_id: str = Field(min_length=1, description="Job id of the engine this sidecar serves (the pod name in Kubernetes).")
    engine_url: Url = Field("http://127.0.0.1:8000", description="URL of the vLLM server in the pod.")
    backend: Literal["vllm", "sglang", "cuda", "workload_channel"] = Field(
        "vllm", description="Default snapshot backend of the job (docs/snapshot.md).")
    host: str = _host()
    port: Port = Field(9001, description="gRPC port (SnapshotAgentService).")
    idle_timeout_s: Duration = Field(60.0, gt=0, le=3600, description="Time to wait for the engine to go idle "
                                                                      "before sleep.")
    operation_timeout_s: Duration = Field(300.0, gt=0, le=3600, description="Most time one sleep or wake may take.")
    pause_mode: Literal["wait", "keep", "abort"] = Field(
        "wait", description="vLLM /sleep mode for requests still in flight: wait, keep or abort.")
    min_freed_fraction: float = Field(0.0, ge=0, le=1, description="Where NVML is present: fail a sleep that frees "
                                                                   "less than this fraction of used device memory.")
    pid: list[int] = Field(default_factory=list, description="cuda backend: processes to checkpoint.")
    annotation: dict[str, str] = Field(default_factory=dict, description="Pod annotations for per-job backend "
                                                                         "resolution (docs/snapshot.md).")
    command_timeout_s: Duration = Field(300.0, gt=0, le=3600, description="Most time a WorkloadChannel workload may "
                                                                          "take to answer a command.")
    probe_max_mismatched_prompts: int = Field(0, ge=0, le=3, description="vllm: probe prompts whose greedy tokens may "
                                              "differ from the weight version's reference before a wake fails (0: exact; "
                                              "1 tolerates a bf16 near-tie on GPUs; docs/snapshot.md).")
    token_file: Path | None = _token_file()
    metrics_port: int = _metrics_port()
    log_level: LogLevel = _log_level()


SECTIONS: dict[str, type[BaseModel]] = {
    "gate": GateSettings, "picker": PickerSettings, "orchestrator": OrchestratorSettings, "sidecar": SidecarSettings,
}


class TimesliceConfig(BaseSettings):
    """Configuration of llmd-timeslice components; a section per component (absent: not configured)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_DELIMITER, extra="forbid",
                                      use_enum_values=True)

    token_file: Path | None = Field(None, description="Control-plane token file shared by every component (a "
                                                      "section's own `token_file` wins); also `$LLMD_TIMESLICE_TOKEN_FILE`.")
    gate: GateSettings | None = Field(None, description=GateSettings.__doc__)
    picker: PickerSettings | None = Field(None, description=PickerSettings.__doc__)
    orchestrator: OrchestratorSettings | None = Field(None, description=OrchestratorSettings.__doc__)
    sidecar: SidecarSettings | None = Field(None, description=SidecarSettings.__doc__)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return (env_settings, init_settings)  # environment over file (passed as init values) over defaults

    def configured(self) -> list[str]:
        return [name for name in SECTIONS if getattr(self, name) is not None]

    def token_file_for(self, section: str) -> Path | None:
        own = getattr(getattr(self, section), "token_file", None)
        return own or self.token_file


class _FileOnlyConfig(TimesliceConfig):
    """The same schema without the environment (``config check --no-env``)."""

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return (init_settings,)


# --------------------------------------------------------------------------- loading
class ConfigError(ValueError):
    """The configuration is not valid: ``errors`` holds one line per problem, each naming the field."""

    def __init__(self, errors: list[str], source: str = "") -> None:
        self.errors = errors
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("; ".join(prefix + e for e in errors))


def _known_keys(loc: tuple) -> list[str]:
    """Field names valid at ``loc`` (the parent of an unknown key), for suggestions."""
    model: Any = TimesliceConfig
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = next((a for a in typing.get_args(field.annotation) if isinstance(a, type) and issubclass(a, BaseModel)),
                     field.annotation)
    return list(getattr(model, "model_fields", {}))


def _error_line(err: dict) -> str:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "json-or-python"))))
    path = ".".join(str(p) for p in loc) or "(top level)"
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        parent, key = loc[:-1], str(loc[-1])
        close = difflib.get_close_matches(key, _known_keys(parent), n=1)
        line = f"{path}: unknown key" + (f" (did you mean {'.'.join([*map(str, parent), close[0]])}?)" if close else "")
    elif kind == "missing":
        line = f"{path}: required"
    else:
        msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if kind == "value_error" and re.match(r"^[a-z_.]+: ", msg):
            line = f"{path}.{msg}" if loc else msg  # model validator naming its own field
        else:
            got = err.get("input")
            shown = "" if kind == "value_error" or isinstance(got, dict | list) else f" (got {got!r})"
            line = f"{path}: {msg}{shown}"
    env = ENV_PREFIX + ENV_DELIMITER.join(str(p) for p in loc).upper()
    if loc and env in os.environ:
        line += f" [from ${env}]"
    return line


def error_lines(exc: ValidationError) -> list[str]:
    """One line per problem, each starting with the dotted field name."""
    return [_error_line(e) for e in exc.errors(include_url=False)]


def load_config(path: str | os.PathLike | None = None, *, env: bool = True) -> TimesliceConfig:
    """Load ``path`` (YAML or JSON; None: environment and defaults only), environment on top.

    Raises:
        ConfigError: unreadable file, not YAML, not a mapping, or invalid fields (one line each).
    """
    data: Any = {}
    source = str(path) if path is not None else "environment"
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError([f"cannot read: {exc.strerror or exc}"], source) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError([f"not valid YAML: {' '.join(str(exc).split())}"], source) from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError([f"expected a mapping of sections ({', '.join(SECTIONS)}), got {type(data).__name__}"],
                              source)
    try:
        return (TimesliceConfig if env else _FileOnlyConfig)(**data)
    except ValidationError as exc:
        raise ConfigError(error_lines(exc), source) from None
    except (ValueError, json.JSONDecodeError) as exc:  # e.g. an env variable that is not JSON for a list
        raise ConfigError([str(exc)], source) from None


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
        out.append(f"gate: ext_proc {g.host}:{g.ext_proc_port}, ext_authz {g.host}:{g.authz_port}, control "
                   f"{g.host}:{g.control_port}, pools {g.pools}, "
                   f"max_held {g.max_held}, max_hold {g.max_hold_s:g} s, orchestrator {g.orchestrator or '(none)'}")
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
            src = (f"kubernetes (namespace {k.namespace or '(own)'}, selector {k.label_selector!r}, "
                   f"serving label {'managed' if k.manage_serving_label else 'not managed'})")
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


# --------------------------------------------------------------------------- reference
def _type_name(field) -> str:
    ann = field.annotation
    if Seconds in field.metadata or any(m is Seconds for m in field.metadata):
        return "duration (s)"

    def name(t: Any) -> str:
        origin = typing.get_origin(t)
        if t is type(None):
            return "null"
        if origin is Literal:
            return " \\| ".join(json.dumps(a) for a in typing.get_args(t))
        if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            return " \\| ".join(name(a) for a in typing.get_args(t))
        if origin is Annotated:
            base, *meta = typing.get_args(t)
            if Seconds in meta:
                return "duration (s)"
            return name(base)
        if origin is list:
            return f"list[{name(typing.get_args(t)[0])}]"
        if origin is dict:
            k, v = typing.get_args(t)
            return f"map[{name(k)}, {name(v)}]"
        if isinstance(t, type) and issubclass(t, enum.Enum):
            return " \\| ".join(json.dumps(m.value) for m in t)
        if isinstance(t, type) and issubclass(t, BaseModel):
            return "section"
        return {str: "string", int: "integer", float: "number", bool: "boolean", Path: "path"}.get(t, str(t))

    text = name(ann)
    if text == "integer" and any(isinstance(m, annotated_types.Le) and m.le == 65535 for m in field.metadata):
        return "port"
    return text


def _bounds(field) -> str:
    parts = []
    for m in field.metadata:
        for attr, sym in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            if isinstance(m, getattr(annotated_types, attr.capitalize())):
                parts.append(f"{sym} {getattr(m, attr):g}")
        if isinstance(m, annotated_types.MinLen) and m.min_length:
            parts.append(f"at least {m.min_length}")
    return ", ".join(parts)


def _default(field) -> str:
    if field.is_required():
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "unset"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{json.dumps(value) if not isinstance(value, str) else value}`"


def _rows(model: type[BaseModel], prefix: tuple[str, ...]) -> list[str]:
    rows = []
    nested = []
    for key, field in model.model_fields.items():
        path = (*prefix, key)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            nested.append((field.annotation, path, field))
            continue
        env = ENV_PREFIX + ENV_DELIMITER.join(path).upper()
        desc = (field.description or "").replace("|", "\\|")
        type_name = _type_name(field)
        bounds = "" if type_name == "port" else _bounds(field)
        rows.append(f"| `{'.'.join(path)}` | {type_name} | {_default(field)} | "
                    f"{desc}{f' ({bounds})' if bounds else ''} | `{env}` |")
    for sub, path, field in nested:
        rows.append(f"| **`{'.'.join(path)}`** | section | | {field.description or ''} | |")
        rows.extend(_rows(sub, path))
    return rows


def reference_markdown() -> str:
    """``docs/configuration.md``, generated from the schema (``llmd-timeslice config reference``)."""
    head = """# Configuration reference

<!-- Generated by `llmd-timeslice config reference > docs/configuration.md` from
     llmd_timeslice/config.py; tests/test_config.py checks it is current. Edit the schema, not this file. -->

One schema covers every component: a file has one section per component it configures (`gate`,
`picker`, `orchestrator`, `sidecar`), plus the shared `token_file`. Every field mirrors a
command-line option of that component's command (`llmd-timeslice gate --max-hold-s` is
`gate.max_hold_s`; the few marked "no flag" exist only here or in the library).

- **File**: YAML (or JSON). Unknown keys are refused, with a suggestion when one is close.
- **Environment**: `LLMD_TIMESLICE_<SECTION>__<FIELD>`, `__` stepping into a section
  (`LLMD_TIMESLICE_GATE__MAX_HOLD_S=30`, `LLMD_TIMESLICE_ORCHESTRATOR__KUBERNETES__NAMESPACE=ns`);
  lists and maps as JSON (`LLMD_TIMESLICE_GATE__POOLS='["a","b"]'`). Setting one field creates its
  section.
- **Precedence**: environment, then the file, then the defaults below.
- **Durations** (`duration (s)`): seconds, as a number or with units: `500ms`, `30s`, `10m`, `1h`,
  `1m30s`.
- **Ports**: 0–65535; 0 picks a free port (servers) or turns the endpoint off (`metrics_port`).
- **Secrets** are not part of it: the token comes from `token_file` or `$LLMD_TIMESLICE_TOKEN`.

```bash
llmd-timeslice config check deploy.yaml    # OK + a summary, or one line per error (exit 2)
llmd-timeslice config schema               # JSON schema (editors, CI)
```

Example:

```yaml
token_file: /var/run/secrets/llmd-timeslice/token
gate:
  host: 0.0.0.0
  pools: [sampler-pool]
  default_pool: sampler-pool
  max_hold_s: 10m
  orchestrator: llmd-timeslice-orchestrator:50051
orchestrator:
  host: 0.0.0.0
  discovery: kubernetes
  kubernetes:
    namespace: llm-d-timeslice
    default_pool: sampler-pool
sidecar:
  job_id: vllm-sampler-0
  host: 0.0.0.0
```

## Fields

| key | type | default | description | environment |
|---|---|---|---|---|
"""
    rows = []
    for key, field in TimesliceConfig.model_fields.items():
        ann = typing.get_args(field.annotation) or (field.annotation,)
        section = next((a for a in ann if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if section is None:
            env = ENV_PREFIX + key.upper()
            rows.append(f"| `{key}` | {_type_name(field)} | {_default(field)} | {field.description} | `{env}` |")
            continue
        rows.append(f"| **`{key}`** | section | unset | {section.__doc__} | |")
        rows.extend(_rows(section, (key,)))
    tail = """
## Pod contract of Kubernetes discovery

With `orchestrator.discovery: kubernetes` the orchestrator lists and watches the pods matching
`label_selector` in `namespace` (RBAC: `get`, `list`, `watch` on pods; `patch` too with
`manage_serving_label`):

| on the pod | kind | meaning | when absent |
|---|---|---|---|
| `timeslice.io/group` | label | accelerator group (upstream label) | pod skipped |
| `timeslice.io/role` | label | `sampler`: a sampler of the group; other roles only make the group exist | not a sampler |
| `timeslice.io/job-id` | label | the sampler's job id (the sidecar's `--job-id`) | pod name |
| `timeslice.io/pool` | annotation | InferencePool of the sampler | `default_pool` |
| `timeslice.io/engine-port` | annotation | port the EPP routes to on the pod IP | `vllm` container's port, else `engine_port` |
| `timeslice.io/sidecar-port` | annotation | the snapshot sidecar's gRPC port | port named `ts-grpc`, else `sidecar_port` |
| `timeslice.io/sleep-level` | annotation | the group's sleep level (1 or 2) | `sleep_level` |
| `timeslice.io/drain-timeout-s` | annotation | the group's drain deadline, seconds | `drain_timeout_s` |
| `timeslice.io/lease-ttl-s`, `timeslice.io/scheduling-policy`, `timeslice.io/sleep-level-policy`, \
`timeslice.io/job-priority`, `timeslice.io/job-sleep-level` | annotation | the other group settings \
(docs/group-settings.md) | the inventory defaults |
| `timeslice.io/serving` | label | written by the orchestrator with `manage_serving_label` | — |

A pod joins once it is Running, has an IP and is Ready; it leaves when deleted, terminating or
finished.
"""
    return head + "\n".join(rows) + "\n" + tail
