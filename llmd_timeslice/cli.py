"""The ``llmd-timeslice`` command: run each component, show status, run the demo."""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import sys
from pathlib import Path
from typing import Annotated

import typer

from llmd_timeslice.cli_config import config_app
from llmd_timeslice.cli_files import InputFileError, existing_file
from llmd_timeslice.cli_plan import plan
from llmd_timeslice.component_process import run_until_signal, serve_metrics, setup_logging
from llmd_timeslice.config import LogLevel, OrchestratorSettings, SidecarSettings
from llmd_timeslice.settings_cli import settings_command

app = typer.Typer(
    help="Time-slice accelerators between vLLM samplers and trainers behind the llm-d router.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: wrapped to the terminal (at most 80 columns; $COLUMNS when not a terminal), never cut.
    # rich's help panels end long option names, defaults and words in '…' at 80 columns.
    rich_markup_mode=None,
)

LogLevelOpt = Annotated[
    LogLevel,
    typer.Option("--log-level", metavar="[" + "|".join(LogLevel) + "]", help="Log level (logs go to stderr, key=value)."),
]
TokenFile = Annotated[
    Path | None,
    typer.Option(
        "--token-file",
        metavar="FILE",
        help="File holding the control-plane bearer token "
        "(default: $LLMD_TIMESLICE_TOKEN_FILE; else the token in $LLMD_TIMESLICE_TOKEN).",
    ),
]


def _register_command_plugins(app: typer.Typer) -> None:
    """Add the commands other packages of this distribution contribute through the entry point group
    ``llmd_timeslice.commands`` (pyproject.toml): the gate and the picker (``epp_plugin/commands.py``). The router
    side imports the library, never the reverse (docs/decisions/process-code-layout.md). A plugin that cannot be
    loaded leaves its commands out with one line on stderr; the other commands still run."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="llmd_timeslice.commands"):
        try:
            ep.load()(app)
        except Exception as exc:  # an optional part missing: its commands are off, said once
            typer.echo(f"llmd-timeslice: the commands of {ep.value} are unavailable: {exc!r}", err=True)


_register_command_plugins(app)


@settings_command(app, "orchestrator", short_help="Run the orchestrator (acquire / yield, phase switches).")
def orchestrator(settings: OrchestratorSettings, token_file: Path | None) -> None:
    """Run the orchestrator (acquire/yield locks, phase switches). Mutual TLS: LLMD_TIMESLICE_TLS_*_FILE."""
    from llmd_timeslice import tls
    from llmd_timeslice.auth import load_job_tokens, load_token
    from llmd_timeslice.orchestrator.persistence import FileStateStore
    from llmd_timeslice.orchestrator.placement_watch import CheckSettings
    from llmd_timeslice.orchestrator.server import OrchestratorServer

    s = settings
    setup_logging(s.log_level)
    token = load_token(token_file)
    job_tokens = load_job_tokens(s.job_tokens_file) if s.job_tokens_file else None
    store = FileStateStore(s.state_file) if s.state_file is not None else None

    def server(inventory, **kwargs) -> OrchestratorServer:
        return OrchestratorServer(
            inventory,
            host=s.host,
            port=s.port,
            token=token,
            job_tokens=job_tokens,
            require_job_tokens=s.require_job_tokens,
            tls_files=tls.from_env(),
            engine_audit_interval_s=s.engine_audit_interval_s,
            sidecar_call_timeout_s=s.sidecar_call_timeout_s,
            sidecar_probe_after_s=s.sidecar_probe_after_s,
            upstream_compat_port=s.upstream_compat_port,
            upstream_compat_allowed_peers=tuple(s.upstream_compat_allowed_peers),
            placement=CheckSettings(s.placement_plan, s.placement_check_interval_s, s.replan_gap, s.replan_gain),
            **kwargs,
        )

    if s.discovery == "kubernetes":
        serve_metrics(s.metrics_port, s.host)
        _orchestrator_kubernetes(s, server, store)
        return
    from llmd_timeslice.discovery import kubernetes as k8s
    from llmd_timeslice.discovery.static import load_inventory

    assert s.inventory is not None  # OrchestratorSettings requires it with static discovery
    inv = load_inventory(s.inventory)
    serve_metrics(s.metrics_port, s.host)

    async def main() -> None:
        api = k8s.make_api_client(s.kubernetes.kubeconfig) if s.state_configmap else None
        state_store, election = _cluster_state(s, api, store)
        srv = server(inv, state_store=state_store, election=election)
        try:
            await srv.start()
            await srv.stepped_down.wait()
            await _exit_stepped_down(srv)
        finally:
            await srv.stop()
            if api is not None:
                api.close()

    try:
        run_until_signal(main)
    except k8s.KubernetesError as exc:
        typer.echo(f"llmd-timeslice: error: {exc}", err=True)
        raise typer.Exit(2) from None


async def _exit_stepped_down(srv) -> None:
    """A deposed leader exits at once with STEPPED_DOWN_EXIT_CODE (Kubernetes restarts it as a follower): it stops
    what it can within 5 s, then leaves without waiting for calls still hanging in worker threads (a node cut off
    from the API server)."""
    import os

    from llmd_timeslice.orchestrator.server import STEPPED_DOWN_EXIT_CODE

    try:
        await asyncio.wait_for(srv.stop(), 5.0)
    except Exception as exc:  # TimeoutError included: leaving anyway
        logging.getLogger(__name__).warning("stopping after stepping down: %r", exc)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(STEPPED_DOWN_EXIT_CODE)


def _cluster_state(s: OrchestratorSettings, api, store):
    """``(state store, leader election or None)``: the ConfigMap store when ``state_configmap`` is set (else
    ``store``), and with ``leader_election`` a candidate named after the pod plus a per-process suffix."""
    if not s.state_configmap:
        return store, None
    import os
    import socket
    import uuid

    from llmd_timeslice.discovery import kubernetes as k8s
    from llmd_timeslice.orchestrator.persistence import ConfigMapStateStore

    ns = s.kubernetes.namespace or k8s.default_namespace()
    state_store = ConfigMapStateStore(api, ns, s.state_configmap)
    if not s.leader_election:
        return state_store, None
    from llmd_timeslice.orchestrator.election import LeaderElector

    identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:6]}"
    election = LeaderElector(
        api,
        ns,
        s.lease_name,
        identity,
        lease_duration_s=s.lease_duration_s,
        renew_deadline_s=s.renew_deadline_s,
        retry_period_s=s.retry_period_s,
    )
    return state_store, election


def _orchestrator_kubernetes(s: OrchestratorSettings, server, store) -> None:
    """The orchestrator with Kubernetes discovery: list, serve, then apply each watched change (the reconcile loop:
    llmd_timeslice/discovery/reconcile.py)."""
    from llmd_timeslice.discovery import kubernetes as k8s
    from llmd_timeslice.discovery.reconcile import Reconciler
    from llmd_timeslice.discovery.sync import inventory_from_specs
    from llmd_timeslice.domain.group_settings import GroupSettings

    k = s.kubernetes
    defaults = k8s.DiscoveryDefaults(
        default_pool=k.default_pool,
        engine_port=k.engine_port,
        sidecar_port=k.sidecar_port,
        settings=GroupSettings(sleep_level=k.sleep_level, drain_timeout_s=k.drain_timeout_s),
    )

    async def main() -> None:
        api = k8s.make_api_client(k.kubeconfig)
        ns = k.namespace or k8s.default_namespace()
        state_store, election = _cluster_state(s, api, store)
        reconciler = Reconciler(backoff_max_s=k.backoff_max_s)  # changes seen before the server starts are kept
        disc = k8s.KubernetesDiscovery(
            ns,
            api,
            label_selector=k.label_selector,
            defaults=defaults,
            on_change=reconciler.submit,
            watch_timeout_s=k.watch_timeout_s,
            backoff_max_s=k.backoff_max_s,
        )
        specs = await disc.start()
        labeler = k8s.PodLabeler(ns, api, disc.pod_for) if k.manage_serving_label else None
        srv = server(inventory_from_specs(specs), labeler=labeler, state_store=state_store, election=election)
        try:
            await srv.start()
            reconciler.start(srv.orchestrator)
            await srv.stepped_down.wait()
            await reconciler.close()
            await disc.stop()
            await _exit_stepped_down(srv)
        finally:
            await reconciler.close()
            await disc.stop()
            await srv.stop()
            api.close()

    try:
        run_until_signal(main)
    except k8s.KubernetesError as exc:
        typer.echo(f"llmd-timeslice: error: {exc}", err=True)
        raise typer.Exit(2) from None


@settings_command(app, "sidecar", short_help="Run a snapshot sidecar for one engine (sleep / wake).")
def sidecar(settings: SidecarSettings, token_file: Path | None) -> None:
    """Run a snapshot sidecar for one engine (sleep / wake, verified). Mutual TLS: LLMD_TIMESLICE_TLS_*_FILE."""
    from llmd_timeslice import tls
    from llmd_timeslice.auth import load_token
    from llmd_timeslice.snapshot.backends.cuda import UnsupportedWorkload
    from llmd_timeslice.snapshot.backends.registry import job_default_backend
    from llmd_timeslice.snapshot.server import SidecarServer

    s = settings
    setup_logging(s.log_level)
    serve_metrics(s.metrics_port, s.host)
    token = load_token(token_file)
    engine_kwargs = {
        "min_freed_fraction": s.min_freed_fraction,
        "residual_margin_bytes": int(s.residual_margin_bytes),
        "memory_settle_timeout_s": s.memory_settle_timeout_s,
    }

    try:  # built before the loop: a workload the backend cannot serve (cuda: NCCL mapped) is refused at start
        backend = job_default_backend(  # by name, from the one backend registry
            s.backend,
            engine_url=s.engine_url,
            pids=s.pid,
            idle_timeout_s=s.idle_timeout_s,
            pause_mode=s.pause_mode,
            probe_max_mismatched_prompts=s.probe_max_mismatched_prompts,
            **engine_kwargs,
        )
    except UnsupportedWorkload as exc:
        typer.echo(f"llmd-timeslice sidecar: error: {exc}", err=True)
        raise typer.Exit(2) from None

    async def main() -> None:
        defaults = {} if backend is None else {s.job_id: backend}  # None: the job registers over WorkloadChannel
        srv = SidecarServer(
            defaults,
            host=s.host,
            port=s.port,
            token=token,
            tls_files=tls.from_env(),
            operation_timeout_s=s.operation_timeout_s,
            annotations=s.annotation,
            command_timeout_s=s.command_timeout_s,
            backend_kwargs=engine_kwargs,
            max_identical_wake_failures=s.max_identical_wake_failures,
            hung_after_s=s.hung_after_s,
        )
        await srv.start()
        try:
            await asyncio.Event().wait()
        finally:
            await srv.stop()

    run_until_signal(main)


StackFileOpt = Annotated[
    Path,
    typer.Option(
        "--file", "-f", metavar="FILE", help="Stack file (see examples/cpu-stack.yaml).", callback=existing_file("stack file")
    ),
]
WorkdirOpt = Annotated[Path | None, typer.Option(metavar="DIR", help="Stack working folder (default: from the stack file).")]
PortOffsetOpt = Annotated[
    int | None,
    typer.Option(
        "--port-offset",
        min=0,
        max=60000,
        metavar="N",
        help="Add N to every port the stack binds (replaces the file's stack.port_offset): a second stack beside the "
        "first; its workdir is .llmd-timeslice/<name>+N. Give the same N to status and down.",
    ),
]


def _host_port_option(value):
    """Option callback: ``value`` (one or a list) checked by the project's one ``host:port`` parser
    (llmd_timeslice/addresses.py), the same as for the components' settings."""
    from llmd_timeslice.addresses import check_host_port

    try:
        if isinstance(value, list | tuple):
            return [check_host_port(v) for v in value]
        return value if value is None else check_host_port(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command(short_help="Show groups, weight versions and gate endpoint states.")
def status(
    orchestrator_addr: Annotated[
        str, typer.Option("--orchestrator", help="Orchestrator host:port.", metavar="HOST:PORT", callback=_host_port_option)
    ] = "127.0.0.1:50051",
    gate_addr: Annotated[
        list[str],
        typer.Option("--gate", help="Gate control host:port (repeatable).", metavar="HOST:PORT", callback=_host_port_option),
    ] = [],  # noqa: B006
    token_file: TokenFile = None,
    file: Annotated[
        Path | None,
        typer.Option(
            "--file",
            "-f",
            help="Stack file of a stack run by `up`: its components, then its groups and gate "
            "(addresses and token from the stack; the other options are ignored).",
            metavar="FILE",
            callback=existing_file("stack file"),
        ),
    ] = None,
    workdir: WorkdirOpt = None,
    port_offset: PortOffsetOpt = None,
    profiles: Annotated[
        bool,
        typer.Option(
            "--profiles",
            help="Show each job's recorded phase profile, the measured switch costs and the last placement check "
            "instead (docs/placement.md).",
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="With --profiles: the profiles as JSON (`plan --profiles` reads it).")
    ] = False,
) -> None:
    """Show groups (holder, waiters, state, weight versions) and, per gate, endpoint states and held requests."""
    if profiles:
        from llmd_timeslice.placement.profiles_view import print_profiles
        from llmd_timeslice.status import output_console

        if file is not None:
            from llmd_timeslice.local.find_stack import running_stack_endpoints
            from llmd_timeslice.local.stack_state import up_command

            eps = running_stack_endpoints(file, workdir, port_offset)
            if not eps:
                typer.echo(f"no stack runs from {file}: start it with `{up_command(file, workdir, port_offset)}`", err=True)
                raise typer.Exit(1)
            orchestrator_addr, token_file = eps["orchestrator"], Path(eps["token_file"])
        raise typer.Exit(print_profiles(orchestrator_addr, token_file, as_json, output_console()))
    if file is not None:
        from llmd_timeslice.local.stack_state import print_stack_status

        raise typer.Exit(print_stack_status(file, workdir, port_offset))
    from llmd_timeslice.status import print_status

    raise typer.Exit(print_status(orchestrator_addr, gate_addr, token_file))


@app.command(short_help="Start and supervise the stack of a stack file.")
def up(
    file: StackFileOpt,
    workdir: WorkdirOpt = None,
    live: Annotated[
        bool | None, typer.Option(help="Live status table (default: when stdout is a terminal; else a line per event).")
    ] = None,
    log_level: LogLevelOpt = LogLevel.warning,
    port_offset: PortOffsetOpt = None,
    node: Annotated[
        str | None,
        typer.Option(
            metavar="NODE",
            help="Across nodes without Slurm: which node of stack.nodes this is (name or index); under srun, "
            "SLURMD_NODENAME / SLURM_NODEID say it. docs/local-stack.md, 'Across nodes'.",
        ),
    ] = None,
) -> None:
    """Start the whole stack of a stack file and supervise it until Ctrl-C / SIGTERM / `down`.

    Starts the vLLM engines it lists (or uses running ones given by URL), a snapshot sidecar per engine,
    the orchestrator, the gate, the picker and Envoy; prints the router URL, the orchestrator address and
    metrics URLs; restarts a component that dies (back-off 1 s to 30 s); writes logs to WORKDIR/logs.
    On stop, held requests get 503 (gate_shutting_down), engines it did not start are woken, the rest stopped.

    On a shared node: `--port-offset N` (or the file's stack.port_offset) moves every port of the stack by N, so a
    second stack runs beside the first. A `host` that is not an address of this machine, or a port of the stack that
    is taken, is refused before anything starts (exit 2: one line, or one line per port naming its holder); a
    component is ready only on its own sockets; a restart that cannot succeed (port held by another process, a usage
    error, 5 failed starts in a row) stops the stack (exit 1)."""
    from llmd_timeslice.local.up import run_up

    setup_logging(log_level)
    raise typer.Exit(run_up(file, workdir, live, port_offset, node))


@app.command(short_help="Stop a stack started with `up`; check nothing is left.")
def down(file: StackFileOpt, workdir: WorkdirOpt = None, port_offset: PortOffsetOpt = None) -> None:
    """Stop a stack started with `up` (from another shell) and check that none of its processes is left."""
    from llmd_timeslice.local.stack_state import run_down

    raise typer.Exit(run_down(file, workdir, port_offset=port_offset))


@app.command(short_help="Run the whole stack and an RL loop on this machine.")
def demo(
    out: Annotated[Path, typer.Option(metavar="DIR", help="Folder for summary.json, timeline.png and logs.")] = Path("demo-out"),
    iterations: Annotated[
        int, typer.Option(metavar="INTEGER", help="RL iterations (each a switch to the trainer and back).", min=1)
    ] = 5,
    load_rps: Annotated[
        float, typer.Option(metavar="NUMBER", help="Background load: requests per second through Envoy.", min=0.1)
    ] = 6.0,
    train_s: Annotated[float, typer.Option(metavar="SECONDS", help="Least seconds of training per iteration.", min=0)] = 4.0,
    eval_rps: Annotated[
        float,
        typer.Option(
            metavar="NUMBER",
            help="A second traffic class: eval requests per second (InferenceObjective 'eval', priority 10, with a hold "
            "deadline); the trainer honours yield requests at its step boundaries. 0: none.",
            min=0,
        ),
    ] = 0.0,
    eval_deadline_s: Annotated[
        float,
        typer.Option(metavar="SECONDS", help="The eval band's hold deadline, seconds (with --eval-rps).", min=0.1, max=120),
    ] = 5.0,
    log_level: LogLevelOpt = LogLevel.warning,
) -> None:
    """Run the whole stack on this machine (Envoy, gate on the fast path picking the endpoint, orchestrator, 2 vLLM + sidecars)
    and an RL loop with background load; writes OUT/summary.json and OUT/timeline.png."""
    from llmd_timeslice.demo.run import run_demo

    setup_logging(log_level)
    code = run_demo(out, iterations, load_rps, train_s, eval_rps=eval_rps, eval_deadline_s=eval_deadline_s)
    raise typer.Exit(code)


class _GateEdge(enum.StrEnum):
    ext_authz = "ext_authz"
    ext_proc = "ext_proc"


class _Picker(enum.StrEnum):
    epp = "epp"
    gate = "gate"


@app.command("render-envoy", short_help="Render the local Envoy bootstrap.")
def render_envoy(
    out: Annotated[Path, typer.Option(metavar="FILE", help="Where to write the bootstrap JSON.")],
    listen_port: Annotated[int, typer.Option(metavar="PORT", help="Inference listener port.", min=1, max=65535)] = 8080,
    admin_port: Annotated[int, typer.Option(metavar="PORT", help="Envoy admin port.", min=1, max=65535)] = 9901,
    gate_edge: Annotated[
        _GateEdge,
        typer.Option(
            metavar="[ext_authz|ext_proc]",
            help="How Envoy calls the gate: ext_authz (the fast path: HTTP ext_authz + gRPC access log) or ext_proc.",
        ),
    ] = _GateEdge.ext_authz,
    gate_port: Annotated[
        int, typer.Option(metavar="PORT", help="Gate gRPC data-plane port (ext_proc, access-log service).", min=1, max=65535)
    ] = 9002,
    authz_port: Annotated[
        int, typer.Option(metavar="PORT", help="Gate HTTP ext_authz port (ext_authz edge).", min=1, max=65535)
    ] = 9005,
    picker: Annotated[
        _Picker,
        typer.Option(
            metavar="[epp|gate]",
            help="Who picks the endpoint: the EPP (ext_proc filter after the gate) or, with the ext_authz edge only, "
            "the gate itself (least in flight; no EPP).",
        ),
    ] = _Picker.epp,
    epp_port: Annotated[int, typer.Option(metavar="PORT", help="EPP (picker) ext_proc port.", min=1, max=65535)] = 9004,
    pool: Annotated[str, typer.Option(metavar="TEXT", help="Pool name sent to the gate and the EPP.")] = "default",
    max_hold_s: Annotated[
        float,
        typer.Option(
            metavar="SECONDS",
            help="Gate hold limit (seconds, above 0, at most 3600 as the gate's); Envoy timeouts are sized above it.",
            max=3600.0,
        ),
    ] = 600.0,
    generation_timeout_s: Annotated[
        float,
        typer.Option(
            metavar="SECONDS",
            help="Longest generation once a request is admitted (seconds). The route timeout is max hold + this + 60 s; "
            "start the gate with the --lost-completion-after-s this command prints. At most 7 days.",
            min=1.0,
            max=7 * 86400.0,
        ),
    ] = 3600.0,
    validate: Annotated[bool, typer.Option(help="Check it with `envoy --mode validate`.")] = True,
) -> None:
    """Render the local Envoy bootstrap (gate -> EPP -> ORIGINAL_DST). With the ext_authz edge, start Envoy with
    LLMD_TIMESLICE_ENVOY_ID set to a fresh id per process. The route timeout fits a full hold plus the longest
    generation (as ``llmd-timeslice up`` sizes it); the gate's matching ``--lost-completion-after-s`` is printed."""
    from llmd_timeslice.router import envoy_launcher
    from llmd_timeslice.router.envoy_config import EnvoyRouterConfig, lost_completion_after_s, route_timeout_s, write_bootstrap

    if picker is _Picker.gate and gate_edge is not _GateEdge.ext_authz:
        raise typer.BadParameter("the gate picks the endpoint only on the ext_authz edge", param_hint="--picker")
    for name, value in (("--max-hold-s", max_hold_s), ("--generation-timeout-s", generation_timeout_s)):
        if not math.isfinite(value) or value <= 0:  # click's range check lets nan through
            raise typer.BadParameter(f"must be a positive number of seconds, not {value:g}", param_hint=name)
    if not pool.strip():
        raise typer.BadParameter("must not be empty", param_hint="--pool")
    ports = {"--listen-port": listen_port, "--admin-port": admin_port}
    if gate_edge is _GateEdge.ext_authz:
        ports["--authz-port"] = authz_port
    ports["--gate-port"] = gate_port  # the access-log service (ext_authz edge) or ext_proc
    if picker is _Picker.epp:
        ports["--epp-port"] = epp_port
    by_port: dict[int, list[str]] = {}
    for name, port in ports.items():
        by_port.setdefault(port, []).append(name)
    clash = [names for names in by_port.values() if len(names) > 1]
    if clash:
        raise typer.BadParameter(
            "; ".join(f"{' and '.join(names)} are the same port {ports[names[0]]}" for names in clash), param_hint="ports"
        )
    route_timeout = route_timeout_s(max_hold_s, generation_timeout_s)
    write_bootstrap(
        EnvoyRouterConfig(
            listen_port,
            admin_port,
            gate_port,
            epp_port if picker is _Picker.epp else None,
            pool=pool,
            max_hold_s=max_hold_s,
            upstream_timeout_s=route_timeout,
            gate_edge=gate_edge.value,
            authz_port=authz_port,
        ),
        out,
    )
    if validate:
        try:
            envoy_launcher.validate(out)
        except ValueError:
            out.unlink(missing_ok=True)  # a rejected bootstrap is not left where Envoy would be pointed at it
            raise
    typer.echo(f"wrote {out} (route timeout {route_timeout:g} s)")
    typer.echo(
        f"start the gate with: --max-hold-s {max_hold_s:g} --lost-completion-after-s {lost_completion_after_s(route_timeout):g}"
    )


app.add_typer(config_app, name="config", short_help="Check a configuration or stack file; schema; reference.")
app.command("plan", short_help="Propose which RL jobs share accelerators (placement planner).")(plan)


k8s_app = typer.Typer(
    help="Kubernetes helpers for the well-lit-path guide (manifests/guides/time-slicing).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(k8s_app, name="k8s", short_help="Kubernetes helpers (time-slice your own model server).")


@k8s_app.command("modelserver", short_help="Print your model-server Deployment, time-sliced.")
def k8s_modelserver(
    file: Annotated[
        str,
        typer.Argument(
            metavar="FILE",
            help="Manifests of your model server (kubectl get -o yaml, or a guide's "
            "rendered manifests; multi-document YAML); - for stdin.",
        ),
    ],
    settings: Annotated[
        Path | None,
        typer.Option("--settings", metavar="FILE", help="The guide's settings.yaml (image, group, pool, device_class)."),
    ] = None,
    image: Annotated[
        str | None, typer.Option("--image", metavar="TEXT", help="This project's image (overrides --settings).")
    ] = None,
    group: Annotated[str | None, typer.Option("--group", metavar="TEXT", help="Accelerator group (timeslice.io/group).")] = None,
    pool: Annotated[str | None, typer.Option("--pool", metavar="TEXT", help="InferencePool of the model server.")] = None,
    device_class: Annotated[
        str | None, typer.Option("--device-class", metavar="TEXT", help="DRA DeviceClass of the claim.")
    ] = None,
    name: Annotated[str | None, typer.Option("--name", metavar="TEXT", help="The Deployment, when there are several.")] = None,
    container: Annotated[str, typer.Option("--container", metavar="TEXT", help="The vLLM container.")] = "modelserver",
    replicas: Annotated[
        int | None, typer.Option("--replicas", metavar="INTEGER", help="Scale the Deployment to this (1).")
    ] = None,
    no_claim: Annotated[
        bool, typer.Option("--no-claim", help="No DRA: keep the nvidia.com/gpu request, print no ResourceClaim.")
    ] = False,
) -> None:
    """Print the documents of FILE with the model-server Deployment time-sliced: the snapshot sidecar, sleep mode
    (--enable-sleep-mode, VLLM_SERVER_DEV_MODE=1), the sampler labels, and the group's shared ResourceClaim (with
    as many devices as the engine uses) in place of nvidia.com/gpu; everything else as it was. Pipe it to
    `kubectl apply -f -`."""
    from llmd_timeslice.k8s_modelserver import SamplerSettings, copy_settings, load_sampler_settings, transform

    text = sys.stdin.read() if file == "-" else Path(file).read_text()
    base = load_sampler_settings(settings.read_text(), str(settings)) if settings else SamplerSettings()
    s = copy_settings(base, image=image, group=group, pool=pool, device_class=device_class)
    out, count = transform(
        text,
        s,
        name=name,
        container_name=container,
        replicas=replicas,
        claim=not no_claim,
        source="stdin" if file == "-" else file,
    )
    typer.echo(out, nl=False)
    if not no_claim:
        typer.echo(f"llmd-timeslice: claim {s.claim_name}: {count} device(s) of {s.device_class}", err=True)


@k8s_app.command("restore", short_help="Print a kubectl-get backup ready for `kubectl replace -f -`.")
def k8s_restore(
    file: Annotated[str, typer.Argument(metavar="FILE", help="The backup (kubectl get -o yaml); - for stdin.")],
) -> None:
    """Print the objects of FILE less their server-set metadata and status: `kubectl replace -f -` then puts back
    exactly what the backup held (the guide's clean-up of the model server and the Istio Gateway parameters)."""
    from llmd_timeslice.k8s_modelserver import restorable

    text = sys.stdin.read() if file == "-" else Path(file).read_text()
    typer.echo(restorable(text, "stdin" if file == "-" else file), nl=False)


def main() -> None:
    """Entry point: user errors (bad files, ports, tokens) print one line and exit 2, no traceback."""
    import pydantic
    import yaml

    from llmd_timeslice.discovery.static import InventoryError
    from llmd_timeslice.local.stack_file import StackError

    try:
        app()
    except InputFileError as exc:
        typer.echo(str(exc), err=True)
        raise SystemExit(2) from None
    except StackError as exc:
        for line in exc.errors:
            typer.echo(f"{exc.path or 'stack file'}: {line}", err=True)
        raise SystemExit(2) from None
    except InventoryError as exc:
        for line in exc.errors:
            typer.echo(f"llmd-timeslice: error: inventory {exc.path}: {line}", err=True)
        raise SystemExit(2) from None
    except (pydantic.ValidationError, yaml.YAMLError, OSError, ValueError) as exc:
        text = str(exc)
        if isinstance(exc, OSError) and exc.filename and text.startswith("[Errno"):  # not "[Errno 2] ...: 'f'"
            text = f"{exc.filename}: {exc.strerror}"
        typer.echo(f"llmd-timeslice: error: {text}", err=True)
        raise SystemExit(2) from None
    except RuntimeError as exc:
        if "bind" not in str(exc).lower():
            raise
        typer.echo(f"llmd-timeslice: error: {exc} (is the port already in use?)", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
