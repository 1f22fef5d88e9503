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


@app.command()
def gate(
    host: Annotated[str, typer.Option(help="Bind address of both ports.")] = "127.0.0.1",
    ext_proc_port: Annotated[int, typer.Option(help="Data-plane port: Envoy's ext_proc (and gRPC health) only.",
                                               min=0, max=65535)] = 9002,
    control_port: Annotated[int, typer.Option(help="Control port (GateControlService, authenticated).",
                                              min=0, max=65535)] = 9003,
    pool: Annotated[list[str], typer.Option(help="InferencePool served (repeatable).")] = ["default"],  # noqa: B006
    default_pool: Annotated[str, typer.Option(help="Pool for ext_proc streams without pool metadata.")] = "default",
    max_held: Annotated[int, typer.Option(help="Most requests held per pool; more get 429.")] = 10_000,
    max_hold_s: Annotated[float, typer.Option(help="Most seconds a request is held; then 503 + retry-after.")] = 600.0,
    release_rate: Annotated[float, typer.Option(help="Held requests released per second (0 = unbounded).")] = 5000.0,
    orchestrator: Annotated[str | None, typer.Option(
        help="Orchestrator host:port to subscribe to for endpoint states (unset: only the control API sets them).")] = None,
    gate_id: Annotated[str | None, typer.Option(help="Stable id of this replica on the state stream (default host-pid).")] = None,
    token_file: TokenFile = None,
    metrics_port: MetricsPort = 0,
    log_level: LogLevel = "warning",
) -> None:
    """Run the time-slice gate (Envoy ext_proc in front of the EPP: hold / drain / steer / release)."""
    from epp_plugin.gate.server import GateConfig, serve
    from llmd_timeslice.auth import load_token

    _setup_logging(log_level)
    _metrics(metrics_port, host)
    cfg = GateConfig(host=host, ext_proc_port=ext_proc_port, control_port=control_port, pools=pool,
                     default_pool=default_pool, max_held=max_held, max_hold_s=max_hold_s,
                     release_rate_per_s=release_rate, token=load_token(token_file), orchestrator=orchestrator,
                     **({"gate_id": gate_id} if gate_id else {}))
    _run(lambda: serve(cfg))


@app.command()
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
        host, colon, port_s = addr.rpartition(":")
        if not sep or not name or not colon or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise typer.BadParameter(f"expected POOL=ip:port, got {item!r}", param_hint="--endpoint")
        pools.setdefault(name, []).append(addr)
    _run(lambda: serve(PickerConfig(host=host, port=port, pools=pools, default_pool=default_pool)))


@app.command()
def orchestrator(
    inventory: Annotated[Path, typer.Option(help="Static inventory file (groups and their samplers).", exists=True)],
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="gRPC port (TimeSliceOrchestratorService).", min=0, max=65535)] = 50051,
    token_file: TokenFile = None,
    metrics_port: MetricsPort = 0,
    log_level: LogLevel = "warning",
) -> None:
    """Run the orchestrator (acquire/yield locks, phase switches)."""
    from llmd_timeslice.auth import load_token
    from llmd_timeslice.discovery.static import load_inventory
    from llmd_timeslice.orchestrator.server import OrchestratorServer

    _setup_logging(log_level)
    _metrics(metrics_port, host)
    inv = load_inventory(inventory)

    async def main() -> None:
        srv = OrchestratorServer(inv, host=host, port=port, token=load_token(token_file))
        await srv.start()
        try:
            await asyncio.Event().wait()
        finally:
            await srv.stop()

    _run(main)


@app.command()
def sidecar(
    job_id: Annotated[str, typer.Option(help="Job id of the engine this sidecar serves.")],
    engine_url: Annotated[str, typer.Option(help="URL of the vLLM server in the pod.")] = "http://127.0.0.1:8000",
    backend: Annotated[str, typer.Option(help="Snapshot backend: vllm.")] = "vllm",
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="gRPC port (SnapshotAgentService).", min=0, max=65535)] = 9001,
    idle_timeout_s: Annotated[float, typer.Option(help="Seconds to wait for the engine to go idle before sleep.")] = 60.0,
    operation_timeout_s: Annotated[float, typer.Option(help="Seconds one sleep/wake may take.")] = 300.0,
    token_file: TokenFile = None,
    metrics_port: MetricsPort = 0,
    log_level: LogLevel = "warning",
) -> None:
    """Run a snapshot sidecar for one engine (sleep / wake, verified)."""
    from llmd_timeslice.auth import load_token
    from llmd_timeslice.snapshot.backends import vllm as _vllm  # noqa: F401 - registers the backend
    from llmd_timeslice.snapshot.backends.base import create_backend
    from llmd_timeslice.snapshot.server import SidecarServer

    _setup_logging(log_level)
    _metrics(metrics_port, host)

    async def main() -> None:
        b = create_backend(backend, base_url=engine_url, idle_timeout_s=idle_timeout_s)
        srv = SidecarServer({job_id: b}, host=host, port=port, token=load_token(token_file),
                            operation_timeout_s=operation_timeout_s)
        await srv.start()
        try:
            await asyncio.Event().wait()
        finally:
            await srv.stop()

    _run(main)


@app.command()
def status(
    orchestrator_addr: Annotated[str, typer.Option("--orchestrator", help="Orchestrator host:port.")] = "127.0.0.1:50051",
    gate_addr: Annotated[list[str], typer.Option("--gate", help="Gate control host:port (repeatable).")] = [],  # noqa: B006
    token_file: TokenFile = None,
) -> None:
    """Show groups (holder, waiters, state) and, per gate, endpoint states and held requests."""
    from llmd_timeslice.status import print_status

    raise typer.Exit(print_status(orchestrator_addr, gate_addr, token_file))


@app.command()
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


@app.command("render-envoy")
def render_envoy(
    out: Annotated[Path, typer.Option(help="Where to write the bootstrap JSON.")],
    listen_port: Annotated[int, typer.Option(help="Inference listener port.", min=0, max=65535)] = 8080,
    admin_port: Annotated[int, typer.Option(help="Envoy admin port.", min=0, max=65535)] = 9901,
    gate_port: Annotated[int, typer.Option(help="Gate ext_proc port.", min=0, max=65535)] = 9002,
    epp_port: Annotated[int, typer.Option(help="EPP (picker) ext_proc port.", min=0, max=65535)] = 9004,
    pool: Annotated[str, typer.Option(help="Pool name sent to both ext_proc services.")] = "default",
    max_hold_s: Annotated[float, typer.Option(help="Gate hold limit; Envoy timeouts are sized above it.")] = 600.0,
    validate: Annotated[bool, typer.Option(help="Check it with `envoy --mode validate`.")] = True,
) -> None:
    """Render the local Envoy bootstrap (gate ext_proc -> EPP ext_proc -> ORIGINAL_DST)."""
    from epp_plugin import envoy_launcher
    from epp_plugin.envoy_config import EnvoyRouterConfig, write_bootstrap

    write_bootstrap(EnvoyRouterConfig(listen_port, admin_port, gate_port, epp_port, pool=pool, max_hold_s=max_hold_s), out)
    if validate:
        envoy_launcher.validate(out)
    typer.echo(f"wrote {out}")


def main() -> None:
    """Entry point: user errors (bad files, ports, tokens) print one line and exit 2, no traceback."""
    import pydantic
    import yaml

    try:
        app()
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
