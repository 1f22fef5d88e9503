"""The ``llmd-timeslice`` command: run each component, show status, run the demo."""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="Time-slice accelerators between vLLM samplers and trainers behind the llm-d router.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: wrapped to the terminal (at most 80 columns; $COLUMNS when not a terminal), never cut.
    # rich's help panels end long option names, defaults and words in '…' at 80 columns.
    rich_markup_mode=None,
)

class _Level(enum.StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


LogLevel = Annotated[_Level, typer.Option("--log-level", help="Log level (logs go to stderr, key=value).")]
TokenFile = Annotated[
    Path | None,
    typer.Option("--token-file", help="File holding the control-plane bearer token (else $LLMD_TIMESLICE_TOKEN)."),
]
MetricsPort = Annotated[int, typer.Option("--metrics-port", help="Prometheus /metrics port on --host (0 = off).",
                                          min=0, max=65535)]


def _setup_logging(level: _Level | str) -> None:
    logging.basicConfig(
        level=getattr(logging, str(getattr(level, "value", level)).upper(), logging.WARNING),
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _metrics(port: int, host: str) -> None:
    """Serve Prometheus /metrics on ``host:port`` (the component's own bind address) unless port is 0."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host)


def _run(coro_factory) -> None:
    """Run an async server until SIGINT/SIGTERM, then let it stop cleanly."""

    async def main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await coro_factory()
        except asyncio.CancelledError:
            pass

    asyncio.run(main())


def _run_uvloop(coro_factory) -> None:
    """``_run`` on uvloop's event loop (the gate's HTTP ext_authz edge is measured on it: docs/decisions.md)."""
    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        _run(coro_factory)
    finally:
        asyncio.set_event_loop_policy(None)


def _raise_open_file_limit() -> None:
    """Each held request is one open connection from Envoy: lift the soft descriptor limit to the hard one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


@app.command(short_help="Run the time-slice gate (hold / drain / steer / release).")
def gate(
    host: Annotated[str, typer.Option(help="Bind address of every port.")] = "127.0.0.1",
    ext_proc_port: Annotated[int, typer.Option(
        help="gRPC data-plane port: Envoy's ext_proc, its access-log service (completions of the fast path) and gRPC "
             "health only.", min=0, max=65535)] = 9002,
    authz_port: Annotated[int, typer.Option(
        help="HTTP data-plane port: Envoy's ext_authz checks (admissions of the fast path) only.", min=0, max=65535)] = 9005,
    control_port: Annotated[int, typer.Option(help="Control port (GateControlService, authenticated).",
                                              min=0, max=65535)] = 9003,
    pool: Annotated[list[str], typer.Option(help="InferencePool served (repeatable).")] = ["default"],  # noqa: B006
    default_pool: Annotated[str, typer.Option(help="Pool for ext_proc streams without pool metadata.")] = "default",
    max_held: Annotated[int, typer.Option(help="Most requests held per pool; more get 429.")] = 10_000,
    max_hold_s: Annotated[float, typer.Option(help="Most seconds a request is held; then 503 + retry-after.")] = 600.0,
    release_rate: Annotated[float, typer.Option(help="Held requests released per second (0 = unbounded).")] = 20_000.0,
    orchestrator: Annotated[str | None, typer.Option(
        help="Orchestrator host:port to subscribe to for endpoint states (unset: only the control API sets them).")] = None,
    gate_id: Annotated[str | None, typer.Option(help="Stable id of this replica on the state stream (default host-pid).")] = None,
    stale_after_s: Annotated[float, typer.Option(
        help="Seconds without the orchestrator's state stream before new requests are held rather than steered by a "
             "possibly outdated view (0: never; then a partitioned gate may send requests to sleeping engines).",
        min=0, max=600)] = 5.0,
    lost_completion_after_s: Annotated[float, typer.Option(
        help="Seconds after which a fast-path admission with no access-log entry (Envoy dropped it, or died) is "
             "dropped; set it above Envoy's route timeout.", min=1)] = 900.0,
    token_file: TokenFile = None,
    metrics_port: MetricsPort = 0,
    log_level: LogLevel = "warning",
) -> None:
    """Run the time-slice gate in front of the EPP (hold / drain / steer / release): Envoy ext_authz + access log
    (the fast path) or ext_proc."""
    from epp_plugin.gate.server import GateConfig, serve
    from llmd_timeslice.auth import load_token

    _setup_logging(log_level)
    _metrics(metrics_port, host)
    _raise_open_file_limit()
    cfg = GateConfig(host=host, ext_proc_port=ext_proc_port, authz_port=authz_port, control_port=control_port, pools=pool,
                     default_pool=default_pool, max_held=max_held, max_hold_s=max_hold_s,
                     release_rate_per_s=release_rate, token=load_token(token_file), orchestrator=orchestrator,
                     stale_after_s=stale_after_s, lost_completion_after_s=lost_completion_after_s,
                     **({"gate_id": gate_id} if gate_id else {}))
    from llmd_timeslice import tls

    _run_uvloop(lambda: serve(cfg, tls.from_env()))


@app.command(short_help="Run the EPP-protocol endpoint picker.")
def picker(
    endpoint: Annotated[list[str], typer.Option(help="POOL=ip:port of a model server (repeatable).")],
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="ext_proc port for Envoy's EPP filter.", min=0, max=65535)] = 9004,
    default_pool: Annotated[str, typer.Option(help="Pool for streams without pool metadata.")] = "default",
    metrics_port: MetricsPort = 0,
    log_level: LogLevel = "warning",
) -> None:
    """Run the EPP-protocol endpoint picker (honours the gate's subset hint)."""
    from epp_plugin.picker.server import PickerConfig, serve

    _setup_logging(log_level)
    _metrics(metrics_port, host)
    pools: dict[str, list[str]] = {}
    for item in endpoint:
        name, sep, addr = item.rpartition("=")
        ep_host, colon, port_s = addr.rpartition(":")  # not `host`: that is the picker's own bind address
        if not sep or not name or not colon or not ep_host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise typer.BadParameter(f"expected POOL=ip:port, got {item!r}", param_hint="--endpoint")
        pools.setdefault(name, []).append(addr)
    _run(lambda: serve(PickerConfig(host=host, port=port, pools=pools, default_pool=default_pool)))


class _Discovery(enum.StrEnum):
    static = "static"
    kubernetes = "kubernetes"


@app.command(short_help="Run the orchestrator (acquire / yield, phase switches).")
def orchestrator(
    inventory: Annotated[Path | None, typer.Option(
        help="Static inventory file (groups and their samplers); required with --discovery static.", exists=True)] = None,
    discovery: Annotated[_Discovery, typer.Option(
        help="Where groups and samplers come from: the --inventory file, or Kubernetes pod labels (list + watch).")
    ] = _Discovery.static,
    namespace: Annotated[str | None, typer.Option(
        help="kubernetes: namespace of the pods (default: the orchestrator's own, else the kubeconfig context's).")] = None,
    label_selector: Annotated[str, typer.Option(
        help="kubernetes: label selector of candidate pods; samplers carry timeslice.io/role=sampler.")
    ] = "timeslice.io/group",
    default_pool: Annotated[str, typer.Option(
        help="kubernetes: pool of sampler pods without the timeslice.io/pool annotation.")] = "default",
    manage_serving_label: Annotated[bool, typer.Option(
        "--manage-serving-label/--no-manage-serving-label",
        help="kubernetes: keep the pod label timeslice.io/serving current (label fallback; needs RBAC patch on pods).")
    ] = False,
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="gRPC port (TimeSliceOrchestratorService).", min=0, max=65535)] = 50051,
    state_file: Annotated[Path | None, typer.Option(
        help="Local state file: holders, leases and group states survive a restart (unset: kept in memory only).")] = None,
    state_configmap: Annotated[str | None, typer.Option(
        help="kubernetes: ConfigMap (in --namespace) that keeps holders, leases and group states across restarts.")
    ] = None,
    token_file: TokenFile = None,
    job_tokens_file: Annotated[Path | None, typer.Option(
        help="YAML mapping job id -> that job's own token: a job's token may act only for that job (acquire, "
             "yield, lease, weights), so one job cannot yield or renew another's lease.", exists=True)] = None,
    require_job_tokens: Annotated[bool, typer.Option(
        help="Jobs listed in --job-tokens-file must use their own token (the control token no longer acts for them).")
    ] = False,
    engine_audit_interval_s: Annotated[float, typer.Option(
        help="Every this many seconds, read the engines of idle groups through their sidecars (weight version "
             "label, sleeping); one that restarted on its own (initial weights again) or sleeps while serving is "
             "taken out of service and woken again at the group's weight version. 0: off.", min=0)] = 10.0,
    metrics_port: MetricsPort = 0,
    log_level: LogLevel = "warning",
) -> None:
    """Run the orchestrator (acquire/yield locks, phase switches). Mutual TLS: LLMD_TIMESLICE_TLS_*_FILE."""
    from llmd_timeslice import tls
    from llmd_timeslice.auth import load_job_tokens, load_token
    from llmd_timeslice.discovery.static import load_inventory
    from llmd_timeslice.orchestrator.persistence import FileStateStore
    from llmd_timeslice.orchestrator.server import OrchestratorServer

    if state_file is not None and state_configmap is not None:
        raise typer.BadParameter("choose one of --state-file and --state-configmap", param_hint="--state-configmap")
    store = FileStateStore(state_file) if state_file is not None else None
    if state_configmap is not None and discovery is not _Discovery.kubernetes:
        raise typer.BadParameter("needs --discovery kubernetes (use --state-file otherwise)",
                                 param_hint="--state-configmap")
    if discovery is _Discovery.kubernetes:
        if inventory is not None:
            raise typer.BadParameter("is for --discovery static; with kubernetes the pods are the inventory",
                                     param_hint="--inventory")
        _setup_logging(log_level)
        _metrics(metrics_port, host)
        _orchestrator_kubernetes(namespace, label_selector, default_pool, manage_serving_label, host, port,
                                 load_token(token_file), store, state_configmap, engine_audit_interval_s)
        return
    if inventory is None:
        raise typer.BadParameter("required with --discovery static", param_hint="--inventory")
    if manage_serving_label:
        raise typer.BadParameter("needs --discovery kubernetes", param_hint="--manage-serving-label")
    _setup_logging(log_level)
    _metrics(metrics_port, host)
    inv = load_inventory(inventory)

    async def main() -> None:
        srv = OrchestratorServer(inv, host=host, port=port, token=load_token(token_file), state_store=store,
                                 job_tokens=load_job_tokens(job_tokens_file) if job_tokens_file else None,
                                 require_job_tokens=require_job_tokens, tls_files=tls.from_env(),
                                 engine_audit_interval_s=engine_audit_interval_s)
        await srv.start()
        try:
            await asyncio.Event().wait()
        finally:
            await srv.stop()

    _run(main)


def _orchestrator_kubernetes(namespace: str | None, label_selector: str, default_pool: str, manage_serving_label: bool,
                             host: str, port: int, token: str | None, store=None,
                             state_configmap: str | None = None, engine_audit_interval_s: float = 10.0) -> None:
    """The orchestrator with Kubernetes discovery: list, serve, then apply each watched change."""
    from llmd_timeslice.discovery import kubernetes as k8s
    from llmd_timeslice.discovery.sync import InventorySync, inventory_from_specs
    from llmd_timeslice.orchestrator.server import OrchestratorServer

    async def main() -> None:
        api = k8s.make_api_client()
        ns = namespace or k8s.default_namespace()
        state_store = store
        if state_configmap:
            from llmd_timeslice.orchestrator.persistence import ConfigMapStateStore

            state_store = ConfigMapStateStore(api, ns, state_configmap)
        changes: asyncio.Queue = asyncio.Queue()
        disc = k8s.KubernetesDiscovery(ns, api, label_selector=label_selector,
                                       defaults=k8s.DiscoveryDefaults(default_pool=default_pool),
                                       on_change=changes.put_nowait)
        specs = await disc.start()
        labeler = k8s.PodLabeler(ns, api, disc.pod_for) if manage_serving_label else None
        srv = OrchestratorServer(inventory_from_specs(specs), host=host, port=port, token=token, labeler=labeler,
                                 state_store=state_store, engine_audit_interval_s=engine_audit_interval_s)
        sync = InventorySync(srv.orchestrator)
        try:
            await srv.start()
            while True:
                latest = await changes.get()
                while not changes.empty():
                    latest = changes.get_nowait()
                await sync.apply(latest)
        finally:
            await disc.stop()
            await srv.stop()
            api.close()

    try:
        _run(main)
    except k8s.KubernetesError as exc:
        typer.echo(f"llmd-timeslice: error: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command(short_help="Run a snapshot sidecar for one engine (sleep / wake).")
def sidecar(
    job_id: Annotated[str, typer.Option(help="Job id of the engine this sidecar serves.")],
    engine_url: Annotated[str, typer.Option(help="URL of the vLLM server in the pod.")] = "http://127.0.0.1:8000",
    backend: Annotated[str, typer.Option(
        help="Default snapshot backend of the job: vllm, sglang (ENGINE_URL is the SGLang server), cuda "
             "(cuda-checkpoint on --pid; needs shareProcessNamespace + SYS_PTRACE) or workload_channel "
             "(the job registers itself over WorkloadChannel).")] = "vllm",
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="gRPC port (SnapshotAgentService).", min=0, max=65535)] = 9001,
    idle_timeout_s: Annotated[float, typer.Option(help="Seconds to wait for the engine to go idle before sleep.")] = 60.0,
    operation_timeout_s: Annotated[float, typer.Option(help="Seconds one sleep/wake may take.")] = 300.0,
    pause_mode: Annotated[str, typer.Option(
        help="vLLM /sleep mode for requests still in flight: wait (finish them), keep (freeze until wake), "
             "abort (end them with finish_reason abort).")] = "wait",
    min_freed_fraction: Annotated[float, typer.Option(
        help="Where NVML is present: fail a sleep that frees less than this fraction of used device memory "
             "(0: only report).", min=0.0, max=1.0)] = 0.0,
    pid: Annotated[list[int], typer.Option("--pid", help="cuda backend: a process to checkpoint (repeatable).")] = [],  # noqa: B006
    annotation: Annotated[list[str], typer.Option(
        "--annotation", help="A pod annotation KEY=VALUE for per-job backend resolution (repeatable), e.g. "
                             "snapshot.timeslice.io/backend=sglang; see docs/snapshot.md.")] = [],  # noqa: B006
    command_timeout_s: Annotated[float, typer.Option(
        help="Seconds a WorkloadChannel workload may take to answer a command.")] = 300.0,
    probe_max_mismatched_prompts: Annotated[int, typer.Option(
        help="vllm: probe prompts whose greedy tokens may differ from the weight version's reference before a wake "
             "fails (0: exact, right for float32; 1 tolerates a bf16 near-tie on GPUs). See docs/snapshot.md.",
        min=0, max=3)] = 0,
    token_file: TokenFile = None,
    metrics_port: MetricsPort = 0,
    log_level: LogLevel = "warning",
) -> None:
    """Run a snapshot sidecar for one engine (sleep / wake, verified)."""
    from llmd_timeslice.auth import load_token
    from llmd_timeslice.snapshot import resolve as _resolve  # noqa: F401 - registers the backends
    from llmd_timeslice.snapshot.backends.base import create_backend
    from llmd_timeslice.snapshot.server import SidecarServer

    annotations = {}
    for a in annotation:
        key, sep, value = a.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{a!r} is not KEY=VALUE", param_hint="--annotation")
        annotations[key] = value
    if backend == "cuda" and not pid:
        raise typer.BadParameter("the cuda backend needs at least one --pid", param_hint="--pid")
    if pause_mode not in ("wait", "keep", "abort"):
        raise typer.BadParameter(f"{pause_mode!r}: choose wait, keep or abort", param_hint="--pause-mode")
    if backend not in ("vllm", "sglang", "cuda", "workload_channel"):
        raise typer.BadParameter(f"{backend!r}: choose vllm, sglang, cuda or workload_channel", param_hint="--backend")
    _setup_logging(log_level)
    _metrics(metrics_port, host)
    engine_kwargs = {"min_freed_fraction": min_freed_fraction}

    async def main() -> None:
        if backend == "vllm":
            defaults = {job_id: create_backend(backend, base_url=engine_url, idle_timeout_s=idle_timeout_s,
                                               pause_mode=pause_mode,
                                               probe_max_mismatched_prompts=probe_max_mismatched_prompts,
                                               **engine_kwargs)}
        elif backend == "sglang":
            defaults = {job_id: create_backend(backend, base_url=engine_url, **engine_kwargs)}
        elif backend == "cuda":
            defaults = {job_id: create_backend(backend, pids=pid)}
        else:
            defaults = {}  # the job registers over WorkloadChannel
        from llmd_timeslice import tls

        srv = SidecarServer(defaults, host=host, port=port, token=load_token(token_file), tls_files=tls.from_env(),
                            operation_timeout_s=operation_timeout_s, annotations=annotations,
                            command_timeout_s=command_timeout_s, backend_kwargs=engine_kwargs)
        await srv.start()
        try:
            await asyncio.Event().wait()
        finally:
            await srv.stop()

    _run(main)


StackFileOpt = Annotated[Path, typer.Option("--file", "-f", help="Stack file (see examples/cpu-stack.yaml).",
                                            exists=True, dir_okay=False)]
WorkdirOpt = Annotated[Path | None, typer.Option(help="Stack working folder (default: from the stack file).")]


@app.command(short_help="Show groups, weight versions and gate endpoint states.")
def status(
    orchestrator_addr: Annotated[str, typer.Option("--orchestrator", help="Orchestrator host:port.")] = "127.0.0.1:50051",
    gate_addr: Annotated[list[str], typer.Option("--gate", help="Gate control host:port (repeatable).")] = [],  # noqa: B006
    token_file: TokenFile = None,
    file: Annotated[Path | None, typer.Option(
        "--file", "-f", help="Stack file of a stack run by `up`: its components, then its groups and gate "
                             "(addresses and token from the stack; the other options are ignored).",
        exists=True, dir_okay=False)] = None,
    workdir: WorkdirOpt = None,
) -> None:
    """Show groups (holder, waiters, state, weight versions) and, per gate, endpoint states and held requests."""
    if file is not None:
        from llmd_timeslice.local.up import print_stack_status

        raise typer.Exit(print_stack_status(file, workdir))
    from llmd_timeslice.status import print_status

    raise typer.Exit(print_status(orchestrator_addr, gate_addr, token_file))


@app.command(short_help="Start and supervise the stack of a stack file.")
def up(
    file: StackFileOpt,
    workdir: WorkdirOpt = None,
    live: Annotated[bool | None, typer.Option(
        help="Live status table (default: when stdout is a terminal; else a line per event).")] = None,
    log_level: LogLevel = "warning",
) -> None:
    """Start the whole stack of a stack file and supervise it until Ctrl-C / SIGTERM / `down`.

    Starts the vLLM engines it lists (or uses running ones given by URL), a snapshot sidecar per engine,
    the orchestrator, the gate, the picker and Envoy; prints the router URL, the orchestrator address and
    metrics URLs; restarts a component that dies (back-off 1 s to 30 s); writes logs to WORKDIR/logs.
    On stop, held requests get 503 (gate_shutting_down), engines it did not start are woken, the rest stopped.

    On a shared node: a port of the stack that is taken is refused before anything starts (exit 2, one line per
    port naming its holder); a component is ready only on its own sockets; a restart that cannot succeed (port
    held by another process, a usage error, 5 failed starts in a row) stops the stack (exit 1)."""
    from llmd_timeslice.local.up import run_up

    _setup_logging(log_level)
    raise typer.Exit(run_up(file, workdir, live))


@app.command(short_help="Stop a stack started with `up`; check nothing is left.")
def down(file: StackFileOpt, workdir: WorkdirOpt = None) -> None:
    """Stop a stack started with `up` (from another shell) and check that none of its processes is left."""
    from llmd_timeslice.local.up import run_down

    raise typer.Exit(run_down(file, workdir))


@app.command(short_help="Run the whole stack and an RL loop on this machine.")
def demo(
    out: Annotated[Path, typer.Option(help="Folder for summary.json, timeline.png and logs.")] = Path("demo-out"),
    iterations: Annotated[int, typer.Option(help="RL iterations (each a switch to the trainer and back).", min=1)] = 5,
    load_rps: Annotated[float, typer.Option(help="Background load: requests per second through Envoy.", min=0.1)] = 6.0,
    train_s: Annotated[float, typer.Option(help="Least seconds of training per iteration.", min=0)] = 4.0,
    log_level: LogLevel = "warning",
) -> None:
    """Run the whole stack on this machine (Envoy, gate, picker, orchestrator, 2 vLLM + sidecars)
    and an RL loop with background load; writes OUT/summary.json and OUT/timeline.png."""
    from llmd_timeslice.demo.run import run_demo

    _setup_logging(log_level)
    raise typer.Exit(run_demo(out, iterations=iterations, load_rps=load_rps, train_s=train_s))


class _GateEdge(enum.StrEnum):
    ext_authz = "ext_authz"
    ext_proc = "ext_proc"


class _Picker(enum.StrEnum):
    epp = "epp"
    gate = "gate"


@app.command("render-envoy", short_help="Render the local Envoy bootstrap.")
def render_envoy(
    out: Annotated[Path, typer.Option(help="Where to write the bootstrap JSON.")],
    listen_port: Annotated[int, typer.Option(help="Inference listener port.", min=0, max=65535)] = 8080,
    admin_port: Annotated[int, typer.Option(help="Envoy admin port.", min=0, max=65535)] = 9901,
    gate_edge: Annotated[_GateEdge, typer.Option(
        help="How Envoy calls the gate: ext_authz (the fast path: HTTP ext_authz + gRPC access log) or ext_proc.")]
        = _GateEdge.ext_authz,
    gate_port: Annotated[int, typer.Option(help="Gate gRPC data-plane port (ext_proc, access-log service).",
                                           min=0, max=65535)] = 9002,
    authz_port: Annotated[int, typer.Option(help="Gate HTTP ext_authz port (ext_authz edge).", min=0, max=65535)] = 9005,
    picker: Annotated[_Picker, typer.Option(
        help="Who picks the endpoint: the EPP (ext_proc filter after the gate) or, with the ext_authz edge only, "
             "the gate itself (least in flight; no EPP).")] = _Picker.epp,
    epp_port: Annotated[int, typer.Option(help="EPP (picker) ext_proc port.", min=0, max=65535)] = 9004,
    pool: Annotated[str, typer.Option(help="Pool name sent to the gate and the EPP.")] = "default",
    max_hold_s: Annotated[float, typer.Option(help="Gate hold limit; Envoy timeouts are sized above it.")] = 600.0,
    validate: Annotated[bool, typer.Option(help="Check it with `envoy --mode validate`.")] = True,
) -> None:
    """Render the local Envoy bootstrap (gate -> EPP -> ORIGINAL_DST). With the ext_authz edge, start Envoy with
    LLMD_TIMESLICE_ENVOY_ID set to a fresh id per process."""
    from epp_plugin import envoy_launcher
    from epp_plugin.envoy_config import EnvoyRouterConfig, write_bootstrap

    if picker is _Picker.gate and gate_edge is not _GateEdge.ext_authz:
        raise typer.BadParameter("the gate picks the endpoint only on the ext_authz edge", param_hint="--picker")
    write_bootstrap(EnvoyRouterConfig(listen_port, admin_port, gate_port, epp_port if picker is _Picker.epp else None,
                                      pool=pool, max_hold_s=max_hold_s, gate_edge=gate_edge.value,
                                      authz_port=authz_port), out)
    if validate:
        envoy_launcher.validate(out)
    typer.echo(f"wrote {out}")


config_app = typer.Typer(help="Check a configuration file or a stack file, print the configuration's JSON schema or its "
                              "reference.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(config_app, name="config", short_help="Check a configuration or stack file; schema; reference.")


@config_app.command("check", short_help="Validate a configuration file or a stack file.")
def config_check(
    file: Annotated[Path, typer.Argument(help="YAML (or JSON) configuration file (LLMD_TIMESLICE_* variables apply "
                                              "on top), or a stack file of `up` (recognised by its `stack` or "
                                              "`engines` key).")],
    env: Annotated[bool, typer.Option(help="Apply LLMD_TIMESLICE_<SECTION>__<FIELD> environment variables.")] = True,
) -> None:
    """Validate FILE: prints OK and a summary, or one line per error (exit 2).

    A stack file is checked as `up` checks it, without starting anything; ports that are in use now are
    listed as notes (`up` would refuse them)."""
    from llmd_timeslice.config import ConfigError, load_config, summary_lines

    if _check_stack_file(file):
        return
    try:
        cfg = load_config(file, env=env)
    except ConfigError as exc:
        for line in exc.errors:
            typer.echo(f"{file}: {line}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"OK {file}: {', '.join(cfg.configured()) or 'no component'} configured")
    for line in summary_lines(cfg):
        typer.echo(f"  {line}")


def _check_stack_file(file: Path) -> bool:
    """``config check`` on a stack file: True when FILE is one (and was checked); exits 2 on problems."""
    import yaml

    from llmd_timeslice.local.stack_file import StackError, load_stack_file, looks_like_stack_file

    try:
        data = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError):
        return False  # the component-config path reports it
    if not looks_like_stack_file(data):
        return False
    try:
        sf = load_stack_file(file)
    except StackError as exc:
        for line in exc.errors:
            typer.echo(f"{file}: {line}", err=True)
        raise typer.Exit(2) from None
    from llmd_timeslice.local.up import Stack

    base = file.resolve().parent
    def n(items: list, what: str) -> str:
        return f"{len(items)} {what}{'' if len(items) == 1 else 's'}"

    typer.echo(f"OK {file}: stack file ({n(sf.engines, 'engine')}, {n(sf.groups, 'group')}, {n(sf.pools, 'pool')})")
    for line in sf.summary_lines(base):
        typer.echo(f"  {line}")
    for line in Stack(sf, base).port_problems():
        typer.echo(f"  note: {line}; `up` would refuse it now")
    return True


@config_app.command("schema")
def config_schema() -> None:
    """Print the JSON schema of the configuration file."""
    import json

    from llmd_timeslice.config import json_schema

    typer.echo(json.dumps(json_schema(), indent=2))


@config_app.command("reference")
def config_reference() -> None:
    """Print the Markdown reference (docs/configuration.md)."""
    from llmd_timeslice.config import reference_markdown

    typer.echo(reference_markdown(), nl=False)


def main() -> None:
    """Entry point: user errors (bad files, ports, tokens) print one line and exit 2, no traceback."""
    import pydantic
    import yaml

    from llmd_timeslice.local.stack_file import StackError

    try:
        app()
    except StackError as exc:
        for line in exc.errors:
            typer.echo(f"{exc.path or 'stack file'}: {line}", err=True)
        raise SystemExit(2) from None
    except (pydantic.ValidationError, yaml.YAMLError, OSError, ValueError) as exc:
        typer.echo(f"llmd-timeslice: error: {exc}", err=True)
        raise SystemExit(2) from None
    except RuntimeError as exc:
        if "bind" not in str(exc).lower():
            raise
        typer.echo(f"llmd-timeslice: error: {exc} (is the port already in use?)", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
