"""``llmd-timeslice up | down | status -f STACK.yaml``: run the local stack as a supervised service.

``up`` starts, in stages: the vLLM engines the file asks for (in parallel), one snapshot sidecar per
engine, the orchestrator (which wakes and verifies every sampler, then publishes it SERVING) together with the gate
(ready once it has the orchestrator's state; and, with ``gate_edge: ext_proc``, the picker), then Envoy; prints
what to connect to; shows a live status table; restarts children that die.
It keeps ``WORKDIR/stack.json`` current (pids, states, endpoints) for ``status`` and ``down`` from another
shell, and writes each component's log to ``WORKDIR/logs/<name>.log``.

``down`` and ``status`` read that file from another shell: :mod:`~llmd_timeslice.local.stack_state`.

Stop (Ctrl-C, SIGTERM or ``down``), bounded by ``STOP_BOUND_S``: the gate first (held requests get 503
``gate_shutting_down`` through Envoy, which is still up), then engines the stack did not start are woken
if asleep (they keep serving after the stack is gone), then the orchestrator, sidecars, picker, Envoy, and
the engines the stack started (each process group SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from llmd_timeslice.http_tls import verify_for
from llmd_timeslice.local.across import NodePart, check_against_head, this_nodes_part, wait_for_token
from llmd_timeslice.local.across_control import down_requested
from llmd_timeslice.local.commands import StackCommands, envoy_argv
from llmd_timeslice.local.nodes import NodeError
from llmd_timeslice.local.ports import host_problem, port_problems
from llmd_timeslice.local.stack_file import BUILTIN_TINY, StackFile
from llmd_timeslice.local.stack_state import STATE_FILE, STOP_BOUND_S, alive, print_stack_status, read_state, run_down
from llmd_timeslice.local.supervisor import ChildSpec, StartFailed, Supervisor
from llmd_timeslice.status import output_console, table

log = logging.getLogger(__name__)

__all__ = [  # down and status moved to stack_state.py; their names are still imported from here
    "ROUTER_URL_ENV",
    "STATE_FILE",
    "STOP_BOUND_S",
    "Stack",
    "StackRunner",
    "alive",
    "node_stack",
    "print_stack_status",
    "read_state",
    "run_down",
    "run_up",
    "stop_stack",
]

UP_LOCK_FILE = "up.lock"
"""Locked (``flock``) by the ``up`` that runs the workdir's stack, from before its start-up until it exits."""
ROUTER_URL_ENV = "LLMD_TIMESLICE_ROUTER_URL"
"""Environment variable naming the router URL (OpenAI-style API) of a stack; ``up`` prints it on its export line
next to ``TIMESLICE_ORCH_ADDR`` and ``LLMD_TIMESLICE_TOKEN_FILE``, and ``examples/rl_loop.py`` reads it."""
TINY_MODEL_DIR = "tiny-llama"
"""Folder under the workdir where ``builtin:tiny-llama`` is built (a Hugging Face model directory)."""


def http_probe(url: str) -> Callable[[], Awaitable[bool]]:
    """A readiness probe: ``GET url`` answers 200 within 2 s. Called 20 times a second during a child's first
    3 s, then 5 times a second (:func:`~llmd_timeslice.local.supervisor.probe_interval`)."""
    # A plain-http URL needs no TLS context: at 5 probes a second per starting child, httpx's default one per client
    # (the certifi bundle loaded each time) was most of what `up` itself spent.
    verify = verify_for(url)

    async def probe() -> bool:
        async with httpx.AsyncClient(timeout=2, verify=verify) as c:
            return (await c.get(url)).status_code == 200

    return probe


def grpc_health_probe(target: str, service: str = "") -> Callable[[], Awaitable[bool]]:
    """A readiness probe: the gRPC health service ``service`` at ``target`` answers SERVING within 2 s."""

    async def probe() -> bool:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)  # its stubs (types-grpcio-health-checking) declare no methods
            r = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)  # type: ignore[attr-defined]
            return r.status == health_pb2.HealthCheckResponse.SERVING

    return probe


class Stack:
    """The children of one stack file and the files they need, under ``workdir``."""

    def __init__(self, sf: StackFile, base_dir: Path, workdir: Path | None = None, part: NodePart | None = None) -> None:
        self.sf = sf
        self.base_dir = base_dir
        self.shared_workdir = (workdir or sf.workdir(base_dir)).resolve()
        self.part = part
        """Across nodes: this node's part (:mod:`llmd_timeslice.local.across`); None: the whole stack here."""
        self.workdir = part.node_workdir(self.shared_workdir) if part else self.shared_workdir
        self.logdir = self.workdir / "logs"
        self.token_file = (
            sf.resolve(base_dir, sf.stack.token_file) if sf.stack.token_file else self.shared_workdir / "control-token"
        )

    @property
    def head(self) -> bool:
        """Whether this node runs the control plane (always, on one machine)."""
        return self.part is None or self.part.head

    def local_engines(self) -> list:
        """The engine entries this node starts (with their sidecars): all of them on one machine."""
        return [e for e in self.sf.engines if self.part is None or e.name in self.part.local_engines]

    # ------------------------------------------------------------------ endpoints
    @property
    def host(self) -> str:
        return self.sf.stack.host

    def endpoints(self) -> dict[str, str]:
        p, h = self.sf.stack.ports, self.host
        eps = {
            "router": f"http://{h}:{p.router}",
            "orchestrator": f"{h}:{p.orchestrator}",
            "gate_control": f"{h}:{p.gate_control}",
            "token_file": str(self.token_file),
            "metrics_gate": f"http://{h}:{p.gate_metrics}/metrics",
            "metrics_orchestrator": f"http://{h}:{p.orchestrator_metrics}/metrics",
            "metrics_envoy": f"http://{h}:{p.router_admin}/stats/prometheus",
        }
        if p.orchestrator_upstream is not None:
            eps["orchestrator_upstream"] = f"{h}:{p.orchestrator_upstream}"  # upstream's client: no token
        for e in self.sf.engines:
            eps[f"metrics_{e.name}"] = f"{e.base_url}/metrics"
        if any(e.vllm is not None and e.vllm.model == BUILTIN_TINY for e in self.sf.engines):
            eps["tiny_model"] = str(self.workdir / TINY_MODEL_DIR)
        return eps

    def ports_to_bind(self) -> list[tuple[str, str, int]]:
        """``(where in the stack file, bind host, port)`` of every port the stack's components bind."""
        h = self.host
        unused = {"picker"} if self.sf.stack.gate_edge == "ext_authz" else set()  # the gate picks: no picker process
        out = (
            [(f"stack.ports.{k}", h, v) for k, v in self.sf.stack.ports.model_dump().items() if k not in unused and v is not None]
            if self.head
            else []
        )
        local = {e.name for e in self.local_engines()}
        for i, e in enumerate(self.sf.engines):
            if e.name not in local:
                continue
            out.append((f"engines[{i}] ({e.name}).sidecar_port", h, e.sidecar_port))
            if e.vllm is not None:  # VllmServer's bind address
                out.append((f"engines[{i}] ({e.name}).vllm.port", e._node_host or "127.0.0.1", e.vllm.port))
        return out

    def port_problems(self) -> list[str]:
        """One line per port of the stack that is taken now, naming the process that holds it."""
        return port_problems(self.ports_to_bind())

    # ------------------------------------------------------------------ children
    def commands(self) -> StackCommands:
        """Every component's command line, from the stack file (:mod:`llmd_timeslice.local.commands`)."""
        return StackCommands(self.sf, self.base_dir, self.workdir, self.token_file)

    def prepare(self, progress=lambda msg: None) -> list[list[ChildSpec]]:
        """Write the token, inventory and Envoy bootstrap; build tiny models if asked; return the stages."""
        from llmd_timeslice.protocol import ENVOY_ID_ENV, GATE_READINESS_SERVICE
        from llmd_timeslice.router.envoy_config import write_bootstrap
        from llmd_timeslice.router.envoy_launcher import envoy_binary, fresh_envoy_id

        self.logdir.mkdir(parents=True, exist_ok=True)
        if self.head and not self.token_file.exists():
            self.token_file.parent.mkdir(parents=True, exist_ok=True)
            # created 0600 (never a moment readable by others), never printed; across nodes the other nodes read it
            # from the allocation's shared filesystem
            # written whole under another name, then linked: another node never reads it empty
            tmp = self.token_file.with_name(f".{self.token_file.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(24))
            try:
                os.link(tmp, self.token_file)  # fails if it exists, as O_EXCL would
            finally:
                tmp.unlink()
        elif not self.head:
            wait_for_token(self.token_file, progress)
        cmds = self.commands()
        p, h = self.sf.stack.ports, self.host

        engines: list[ChildSpec] = []
        for e in self.local_engines():
            if e.vllm is None:
                continue
            v = e.vllm
            if v.model == BUILTIN_TINY:
                from llmd_timeslice.engines.tiny_model import build_tiny_llama

                progress(f"building the tiny Llama for {e.name} (local, no download)")
                model = build_tiny_llama(self.workdir / TINY_MODEL_DIR)
            else:
                model = self.sf.resolve(self.base_dir, v.model)
            server = cmds.vllm(e, model)
            engines.append(
                ChildSpec(
                    f"vllm-{e.name}",
                    server.command(),
                    server.log_path,
                    v.port,
                    probe=http_probe(f"{e.base_url}/health"),
                    start_timeout_s=v.startup_timeout_s,
                    stop_grace_s=15.0,
                    env_factory=partial(server.environment, v.env),
                    listen=(v.port,),
                    after_exit=server.remove_runtime_dir,  # vLLM's IPC sockets and temporary files
                )
            )
        sidecars = [
            ChildSpec(
                f"sidecar-{e.name}",
                cmds.sidecar(e).argv(),
                self.logdir / f"sidecar-{e.name}.log",
                e.sidecar_port,
                probe=grpc_health_probe(f"{h}:{e.sidecar_port}"),
                listen=(e.sidecar_port,),
            )
            for e in self.local_engines()
        ]
        if not self.head:  # an engine node: its engines and sidecars; the head's inventory names them
            return [st for st in (engines, sidecars) if st]
        # Orchestrator state lives as long as one `up`: it carries the orchestrator over its own restarts (the
        # supervisor restarts it), but a new `up` starts new engines, so holders and versions start over too.
        cmds.state_file.unlink(missing_ok=True)
        import yaml

        cmds.inventory.write_text(yaml.safe_dump(self.sf.inventory().model_dump(mode="json"), sort_keys=False))
        orch = ChildSpec(
            "orchestrator",
            cmds.orchestrator().argv(),
            self.logdir / "orchestrator.log",
            p.orchestrator,
            probe=grpc_health_probe(f"{h}:{p.orchestrator}"),
            start_timeout_s=300.0,
            listen=(p.orchestrator, p.orchestrator_metrics, *filter(None, [p.orchestrator_upstream])),
        )
        cmds.write_objectives()
        # Hold, then the longest generation, must fit the route timeout; the gate's age rule for lost access-log
        # entries must never end a request the route may still be serving (docs/gate.md, "Completions"): both
        # come from StackCommands. The gate starts beside the orchestrator (it reconnects until the orchestrator
        # listens) and is ready once it applied the orchestrator's first state snapshot: its readiness service.
        gate = ChildSpec(
            "gate",
            cmds.gate().argv(),
            self.logdir / "gate.log",
            p.gate_ext_proc,
            probe=grpc_health_probe(f"{h}:{p.gate_ext_proc}", GATE_READINESS_SERVICE),
            start_timeout_s=orch.start_timeout_s,  # its readiness waits for the orchestrator
            listen=(p.gate_ext_proc, p.gate_authz, p.gate_control, p.gate_metrics),
        )
        picker_cmd = cmds.picker()  # None on the fast path: the gate picks the endpoint, no picker process
        pickers = (
            [
                ChildSpec(
                    "picker",
                    picker_cmd.argv(),
                    self.logdir / "picker.log",
                    p.picker,
                    probe=grpc_health_probe(f"{h}:{p.picker}"),
                    listen=(p.picker,),
                )
            ]
            if picker_cmd is not None
            else []
        )
        bootstrap = self.workdir / "envoy.json"
        write_bootstrap(cmds.router(), bootstrap)
        envoy = ChildSpec(
            "envoy",
            envoy_argv(envoy_binary(), bootstrap),
            self.logdir / "envoy.log",
            p.router,
            probe=http_probe(f"http://{h}:{p.router_admin}/ready"),
            listen=(p.router, p.router_admin),
            env_factory=lambda: {**os.environ, ENVOY_ID_ENV: fresh_envoy_id()},
        )  # a new id per process
        stages = [engines, sidecars, [orch, gate, *pickers], [envoy]]
        return [st for st in stages if st]

    # ------------------------------------------------------------------ state file
    def write_state(self, sup: Supervisor | None, phase: str) -> None:
        state = {
            "name": self.sf.stack.name,
            "pid": os.getpid(),
            "phase": phase,
            "updated_unix_s": time.time(),
            "endpoints": self.endpoints(),
            "workdir": str(self.workdir),
            "components": sup.snapshot() if sup else [],
            **(
                {"node": self.part.node, "address": self.part.address, "stale_after_s": self.sf.stack.node_stale_after_s}
                if self.part
                else {}
            ),
        }
        tmp = self.workdir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.workdir / STATE_FILE)

    async def wake_external_engines(self) -> None:
        """Engines the stack did not start: wake any that sleep, so they serve after the stack is gone."""
        from llmd_timeslice.snapshot.backends.base import BackendError
        from llmd_timeslice.snapshot.backends.vllm import VllmBackend

        for e in self.sf.engines:
            if e.vllm is not None:
                continue
            b = VllmBackend(e.base_url, request_timeout_s=20)
            try:
                if await b.is_suspended():
                    await b.resume([])
                    log.warning("engine %s was asleep at stop: woken", e.name)
            except BackendError as exc:
                log.error("engine %s could not be woken at stop: %s", e.name, exc)
            finally:
                await b.close()


# ---------------------------------------------------------------------- up
def _table(stack: Stack, sup: Supervisor) -> Table:
    t = table(
        f"llmd-timeslice stack {stack.sf.stack.name!r} ({stack.workdir})",
        ("component", "state", "pid", "port", "restarts", "up (s)", "last exit"),
    )
    colors = {"ready": "green", "starting": "yellow", "backoff": "red", "failed": "red"}
    for c in sup.snapshot():
        st = c["state"]
        t.add_row(
            c["name"],
            f"[{colors.get(st, 'white')}]{st}[/]",
            str(c["pid"] or "-"),
            str(c["port"] or "-"),
            str(c["restarts"]),
            f"{c['uptime_s']:.0f}" if c["pid"] else "-",
            c["last_exit"] or "-",
        )
    return t


def _print_endpoints(console: Console, stack: Stack) -> None:
    if stack.part is not None and not stack.part.head:
        p = stack.part
        console.print(
            f"node {p.node} ({p.address}) up: engines {', '.join(p.local_engines) or 'none'} with their sidecars; the "
            f"router and orchestrator run on the head node ({p.head_address}); logs: {stack.logdir}/",
            highlight=False,
        )
        return
    e = stack.endpoints()
    lines = [
        f"[bold green]stack up[/]: router (OpenAI API) [bold]{e['router']}[/]  orchestrator [bold]{e['orchestrator']}[/]"
        f"  gate control {e['gate_control']}",
        "  metrics: " + "  ".join(v for k, v in e.items() if k.startswith("metrics_")),
        f"  for the TimeSlice client: export TIMESLICE_ORCH_ADDR={e['orchestrator']} "
        f"LLMD_TIMESLICE_TOKEN_FILE={e['token_file']} {ROUTER_URL_ENV}={e['router']}",
        f"  logs: {stack.logdir}/   from another shell: llmd-timeslice status -f FILE | down -f FILE",
    ]
    if "tiny_model" in e:
        lines.append(f"  tiny model (a Hugging Face model directory, e.g. for rl_loop.py --model-dir): {e['tiny_model']}")
    for line in lines:
        console.print(line, soft_wrap=True)  # never folded: the export line is meant to be copied


async def _up(stack: Stack, console: Console, live_table: bool) -> int:
    stop = asyncio.Event()
    received: list[signal.Signals] = []
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal, sig)
    stack.workdir.mkdir(parents=True, exist_ok=True)
    sup: Supervisor | None = None
    events: list[str] = []
    phase = "starting"

    def on_fatal(exc: StartFailed) -> None:  # a component failed for good after the start: stop the stack
        stop.set()

    def on_event(name: str, msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {name}: {msg}"
        events.append(line)
        log.info("component=%s %s", name, msg)
        failure = any(w in msg for w in ("exited", "failed"))
        if not live_table or (sup is not None and not sup.stopping and failure):
            console.print(f"[red]{escape(line)}[/red]" if failure else escape(line), highlight=False)
        if sup is not None and not sup.stopping:  # `status` and `down` see each start, exit and restart at once
            stack.write_state(sup, phase)

    try:
        with console.status("preparing ...") as st:
            stages = await asyncio.to_thread(stack.prepare, st.update)
            sup = Supervisor(stages, on_event=on_event, on_fatal=on_fatal)
            stack.write_state(sup, "starting")
            start = asyncio.ensure_future(sup.start(st.update))
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set() and not start.done():
                start.cancel()
                with contextlib.suppress(asyncio.CancelledError, StartFailed):
                    await start
                name = received[0].name if received else "a stop"
                console.print(f"[yellow]stopped while starting ({name}); nothing of the stack is left running[/yellow]")
                # A start that did not finish is not a success: 128 + the signal, the shell's convention (130 for
                # Ctrl-C, 143 for SIGTERM), so `up && next-step` does not go on.
                return 128 + int(received[0]) if received else 1
            stopper.cancel()
            start.result()
    except StartFailed as exc:
        console.print(f"[red]llmd-timeslice up: {escape(str(exc))}[/red]", highlight=False)
        if sup is not None:
            stack.write_state(sup, "failed")
        return 1
    _print_endpoints(console, stack)
    phase = "running"
    stack.write_state(sup, phase)
    started = time.time()
    try:
        if live_table:
            with Live(_table(stack, sup), console=console, refresh_per_second=2, transient=False) as live:

                def refresh() -> None:
                    live.update(_table(stack, sup))
                    stack.write_state(sup, "running")

                await _run_until_stop(stack, stop, started, refresh)
        else:
            await _run_until_stop(stack, stop, started, lambda: stack.write_state(sup, "running"))
    finally:
        if sup.fatal is not None:
            console.print(f"[red]llmd-timeslice up: {escape(str(sup.fatal))}[/red]", highlight=False)
        console.print("stopping: gate first (held requests get 503 gate_shutting_down), then the rest ...")
        stack.write_state(sup, "stopping")
        t = time.monotonic()
        if not await stop_stack(stack, sup):
            console.print(f"[red]stop took more than {STOP_BOUND_S:g} s; killing what is left[/red]")
        stack.write_state(sup, "failed" if sup.fatal is not None else "stopped")
        console.print(f"stack stopped in {time.monotonic() - t:.1f} s; nothing of it is left running")
    return 1 if sup.fatal is not None else 0


STATE_REFRESH_S = 1.0
"""How often a running ``up`` rewrites its ``stack.json`` (and its live table), in seconds; it is also written at
each component's start, exit and restart."""
DOWN_POLL_S = 0.2
"""Across nodes: how often a running ``up`` looks for ``down -f``'s marker in the shared workdir, in seconds."""


async def _run_until_stop(stack: Stack, stop: asyncio.Event, started_unix_s: float, refresh: Callable[[], None]) -> None:
    """While the stack runs: ``refresh`` every :data:`STATE_REFRESH_S`; across nodes, ``down -f``'s marker (written
    after ``started_unix_s``) looked for every :data:`DOWN_POLL_S` sets ``stop``. Returns once ``stop`` is set."""
    tick = DOWN_POLL_S if stack.part else STATE_REFRESH_S
    next_refresh = time.monotonic() + STATE_REFRESH_S
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), tick)
        if stack.part and down_requested(stack.shared_workdir, started_unix_s):
            stop.set()  # `down -f` on some node: every node stops its part
        if not stop.is_set() and time.monotonic() >= next_refresh:
            refresh()
            next_refresh = time.monotonic() + STATE_REFRESH_S


async def _stop(stack: Stack, sup: Supervisor) -> None:
    sup.stopping = True
    if stack.head:  # an engine node across nodes runs no gate
        await sup.stop_child("gate")
    await stack.wake_external_engines()
    await sup.stop(order=["orchestrator"] if stack.head else [])


async def stop_stack(stack: Stack, sup: Supervisor, bound_s: float = STOP_BOUND_S) -> bool:
    """Stop the stack as ``up`` does (the gate first, engines the stack did not start woken, then the rest), within
    ``bound_s`` seconds; past it every process group left is SIGKILLed. Returns False when the bound was hit."""
    try:
        await asyncio.wait_for(_stop(stack, sup), bound_s)
    except TimeoutError:
        for c in sup.children:
            if c.proc is not None and c.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
        return False
    return True


class StackRunner:
    """The stack of ``up`` run from this process, without ``up``'s terminal (the demo and the benchmarks start
    theirs with it): :meth:`start` prepares it (:meth:`Stack.prepare`), starts it stage by stage and supervises it
    (children that die are restarted); :meth:`stop` stops it as ``up`` does (:func:`stop_stack`). Also an async
    context manager (``async with StackRunner(stack) as sup:``) that stops it however the body ends.

    Args:
        stack: the stack (a :class:`Stack` of a stack file, read or built in code).
        on_event: called with (component, message) for starts, exits and restarts (default: logged).
    """

    def __init__(self, stack: Stack, on_event: Callable[[str, str], None] | None = None) -> None:
        self.stack = stack
        self.on_event = on_event
        self.supervisor: Supervisor | None = None

    async def start(
        self, progress: Callable[[str], None] = lambda msg: None, on_stage_ready: Callable[[list[str]], None] = lambda n: None
    ) -> Supervisor:
        """Prepare and start every stage; ``on_stage_ready`` gets each stage's component names once it is ready.

        Raises:
            StartFailed: a component did not start (what was started is stopped; the message names its log).
        """
        stages = await asyncio.to_thread(self.stack.prepare, progress)
        self.supervisor = Supervisor(stages, on_event=self.on_event)
        await self.supervisor.start(progress, on_stage_ready)
        return self.supervisor

    async def stop(self) -> bool:
        """Stop what :meth:`start` started (nothing if it did not run); False when :data:`STOP_BOUND_S` was hit."""
        sup, self.supervisor = self.supervisor, None
        return True if sup is None else await stop_stack(self.stack, sup)

    async def __aenter__(self) -> Supervisor:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def node_stack(file: Path, sf: StackFile, workdir: Path | None = None, node: str | None = None) -> Stack:
    """The part of the stack of ``file`` this node runs (:func:`~llmd_timeslice.local.across.this_nodes_part`):
    the whole stack on one machine.

    Raises:
        NodeError: as :func:`~llmd_timeslice.local.across.this_nodes_part`.
    """
    base = file.resolve().parent
    part = this_nodes_part(file, sf, (workdir or sf.workdir(base)).resolve(), node)
    return Stack(sf, base, workdir) if part is None else Stack(part[0], base, workdir, part[1])


def run_up(
    file: Path,
    workdir: Path | None = None,
    live_table: bool | None = None,
    port_offset: int | None = None,
    node: str | None = None,
) -> int:
    """``llmd-timeslice up``; returns the exit code: 0 after a clean stop of a running stack, 128 + the signal
    (130 for Ctrl-C, 143 for SIGTERM) when stopped while starting, 1 if the stack did not start or a
    component failed for good, 2 if a stack already runs from the workdir, another ``up`` of the workdir is starting
    (it holds ``WORKDIR/up.lock``) or a port of the stack is taken (one line per port on stderr, naming the process
    that holds it; nothing is started)."""
    from filelock import FileLock, Timeout

    from llmd_timeslice.local.preflight import start_check
    from llmd_timeslice.local.stack_file import load_stack_file

    sf = load_stack_file(file, port_offset)
    console = output_console()
    check = start_check(sf, file.resolve().parent)  # what `config check` reports too
    if check.errors:
        err = output_console(stderr=True)
        for line in check.errors:
            err.print(f"llmd-timeslice up: {line}", markup=False, highlight=False, soft_wrap=True)
        return 2
    try:
        stack = node_stack(file, sf, workdir, node)
        if stack.part is not None and not stack.part.head:  # the head's file of this run, before anything starts
            check_against_head(file, stack.shared_workdir, console.print)
    except NodeError as exc:
        err = output_console(stderr=True)
        for line in exc.errors:
            err.print(f"llmd-timeslice up: {line}", markup=False, highlight=False, soft_wrap=True)
        return 2
    if stack.head:
        for line in check.notes:
            console.print(f"llmd-timeslice up: {line}", markup=False, highlight=False, soft_wrap=True)
    stack.workdir.mkdir(parents=True, exist_ok=True)
    # Held for the life of this `up`, taken before anything is built or started: a second `up` of the same workdir
    # during the first one's start-up (before stack.json or any port shows it) is refused here. The kernel drops
    # the lock with the process, so a killed `up` leaves nothing to clean.
    lock = FileLock(stack.workdir / UP_LOCK_FILE)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        console.print(
            f"[red]another `llmd-timeslice up` is starting or running a stack from {stack.workdir} (it holds "
            f"{lock.lock_file}); `llmd-timeslice status -f FILE` to see it, `llmd-timeslice down -f FILE` to stop it[/red]"
        )
        return 2
    try:
        return _run_up_locked(file, stack, console, live_table)
    except KeyboardInterrupt:  # Ctrl-C before the event loop's own handler is installed: nothing started yet
        console.print("[yellow]stopped while starting (SIGINT); nothing was started[/yellow]")
        return 128 + signal.SIGINT
    finally:
        lock.release()


def _run_up_locked(file: Path, stack: Stack, console, live_table: bool | None) -> int:
    state = stack.workdir / STATE_FILE
    if state.exists():
        with contextlib.suppress(ValueError, OSError):
            prev = json.loads(state.read_text())
            if prev.get("phase") in ("starting", "running") and alive(prev.get("pid")):
                console.print(
                    f"[red]a stack already runs from {stack.workdir} (pid {prev['pid']}); "
                    "`llmd-timeslice down -f FILE` first[/red]"
                )
                return 2
    # across nodes: this node's own address (on one machine stack.host was checked by start_check)
    bad_host = host_problem(stack.host) if stack.part is not None else None
    if bad_host:
        output_console(stderr=True).print(f"llmd-timeslice up: {bad_host}", markup=False, highlight=False, soft_wrap=True)
        return 2
    taken = stack.port_problems()
    if taken:
        err = output_console(stderr=True)
        for line in taken:
            err.print(f"llmd-timeslice up: {line}", markup=False, highlight=False, soft_wrap=True)
        err.print(
            f"llmd-timeslice up: nothing started; stop what holds the port(s) or give {file} other ports",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return 2
    return asyncio.run(_up(stack, console, sys.stdout.isatty() if live_table is None else live_table))
