"""``llmd-timeslice status``: groups from the orchestrator and endpoint states from gates, as tables.

Tables print whole values: when stdout is not a terminal and ``COLUMNS`` is unset each row stays on one line
(:func:`output_console`); on a terminal, or with ``COLUMNS``, long cells fold onto more lines (:func:`table`)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import grpc
from rich.console import Console
from rich.table import Table

from llmd_timeslice import auth, tls
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as gpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2_grpc as gpb_grpc
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import orchestrator_info_pb2 as info_pb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import orchestrator_info_pb2_grpc as info_grpc
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import weights_pb2 as wpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import weights_pb2_grpc as wpb_grpc
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc

UNCUT_WIDTH = 1000
"""Console width when the output is not a terminal and ``COLUMNS`` is unset: wide enough that no table cell
is cut (rich would otherwise assume 80 columns and end long values in '…')."""


def output_console(stderr: bool = False) -> Console:
    """A console whose tables show whole values: on a terminal, or with ``$COLUMNS`` set, rich's own width
    (cells too long for it fold onto more lines, see :func:`table`); otherwise (a pipe, a file, a CI log)
    :data:`UNCUT_WIDTH` columns, so each row stays on one line."""
    stream = sys.stderr if stderr else sys.stdout
    if os.environ.get("COLUMNS") or stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=UNCUT_WIDTH)


def table(title: str, columns: tuple[str, ...] | list[str]) -> Table:
    """A left-titled table whose cells fold rather than end in '…' when the console is narrow."""
    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col, overflow="fold")
    return t


def _weights_table(console: Console, ch: grpc.Channel, groups, md) -> None:
    """Weight versions per sampler (groups with samplers only; skipped on an orchestrator without the service)."""
    stub = wpb_grpc.WeightVersionServiceStub(ch)
    t = table("weight versions", ("group", "serving", "pending", "sampler", "version", "in service", "error"))
    for gid in groups:
        try:
            w = stub.GetWeightVersion(wpb.GetWeightVersionRequest(group_id=gid), timeout=5, metadata=md)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return
            raise
        for i, smp in enumerate(w.samplers):
            t.add_row(
                gid if i == 0 else "",
                str(w.serving_version) if i == 0 else "",
                (str(w.pending.version) if w.pending.version else "-") if i == 0 else "",
                smp.address,
                str(smp.version),
                "yes" if smp.in_service else "[red]no[/red]",
                smp.error,
            )
    if t.row_count:
        console.print(t)


def _yield_requests_table(console: Console, info, md) -> None:
    """Yield requests per group (issue 26): counts since the orchestrator started and the one its holder carries
    now (skipped on an orchestrator without ``ListYieldRequests``, and when no group ever had one)."""
    try:
        groups = info.ListYieldRequests(info_pb.ListYieldRequestsRequest(), timeout=5, metadata=md).groups
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return
        raise
    t = table("yield requests", ("group", "sent", "honoured", "ignored", "suppressed", "holder", "current"))
    for g in groups:
        if not (g.sent or g.suppressed or g.HasField("current")):
            continue
        cur = g.current
        current = (
            f"band {cur.band}{f' ({cur.objective})' if cur.objective else ''}, asked {cur.requested_ago_s:.1f} s ago"
            f"{f', deadline {cur.hold_deadline_s:g} s' if cur.hold_deadline_s else ''}: {cur.reason}"
            if g.HasField("current")
            else "-"
        )
        t.add_row(g.group_id, str(g.sent), str(g.honoured), str(g.ignored), str(g.suppressed), g.holder or "-", current)
    if t.row_count:
        console.print(t)


def group_state_text(state: str, agents: list[str]) -> str:
    """What a group is doing, for the groups table: upstream's ``state`` (``IDLE``: no job holds the group,
    ``IDLE_YIELDED``, ``LOCKED``, ``SWITCHING``) with, while no job holds it, whether its samplers serve, read from
    their agent states (``RUNNING``: awake and serving): ``SERVING (IDLE)`` rather than a bare ``IDLE`` for a group
    whose samplers answer requests."""
    if state not in ("IDLE", "IDLE_YIELDED") or not agents:
        return state
    serving = sum(a == "RUNNING" for a in agents)
    if serving == len(agents):
        return f"SERVING ({state})"
    if serving:
        return f"SERVING {serving}/{len(agents)} ({state})"
    return f"{state}, samplers not serving"


def token_hint(token_file: Path | None) -> str:
    """Where the token ``status`` sent came from, for an UNAUTHENTICATED or PERMISSION_DENIED answer: the flag that
    fixes it is named either way."""
    if token_file is not None:
        return f"the token sent came from --token-file {token_file}; is it this stack's?"
    if os.environ.get(auth.TOKEN_FILE_ENV):
        return f"the token sent came from ${auth.TOKEN_FILE_ENV} ({os.environ[auth.TOKEN_FILE_ENV]}); give --token-file FILE"
    if os.environ.get(auth.TOKEN_ENV):
        return f"the token sent came from ${auth.TOKEN_ENV}; give --token-file FILE"
    return (
        f"no token was sent: give --token-file FILE (the stack's token; `up` prints it), or set ${auth.TOKEN_FILE_ENV}, "
        "or use `status -f STACK_FILE`"
    )


def _refusal(exc: grpc.RpcError, token_file: Path | None) -> str:
    """``CODE: details``, with a hint: for a token refused that of :func:`token_hint`, for nothing answering where
    to find a stack's addresses."""
    text = f"{exc.code().name}: {exc.details()}"
    if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        text += f" ({token_hint(token_file)})"
    elif exc.code() == grpc.StatusCode.UNAVAILABLE:
        text += " (is a stack running? `status -f STACK.yaml` reads a stack's own addresses; or pass --orchestrator)"
    return text


def _deadlines_table(console: Console, info, md) -> None:
    """Each group's sleep, wake and reload deadlines (issue 38; skipped on an orchestrator without
    ``ListGroupDeadlines``)."""
    try:
        groups = info.ListGroupDeadlines(info_pb.ListGroupDeadlinesRequest(), timeout=5, metadata=md).groups
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return
        raise
    t = table("operation deadlines (s)", ("group", "sleep", "wake", "reload"))
    for g in groups:
        reload = f"{g.reload_s:g}" if g.reload_s else f"by bytes: {g.reload_rule}"
        t.add_row(g.group_id, f"{g.sleep_s:g}", f"{g.wake_s:g}", reload)
    if t.row_count:
        console.print(t)


def print_status(orchestrator: str, gates: list[str], token_file: Path | None = None, console: Console | None = None) -> int:
    """Print the tables; returns 0, or 1 when a component could not be reached (its error is shown)."""
    console = console or output_console()
    md = auth.call_metadata(auth.load_token(token_file))
    tls_files = tls.from_env()
    rc = 0
    with tls.channel(orchestrator, tls_files) as ch:
        stub = opb_grpc.TimeSliceOrchestratorServiceStub(ch)
        try:
            groups = stub.ListGroups(opb.ListGroupsRequest(), timeout=5, metadata=md).group_ids
            t = table(f"groups @ {orchestrator}", ("group", "state", "holder", "loaded", "waiters", "samplers"))
            for gid in groups:
                s = stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id=gid), timeout=5, metadata=md)
                states = [opb.SnapshotAgentJobState.State.Name(a.job_state)[6:] for a in s.agent_job_states]
                agents = ", ".join(f"{a.job_id}:{st}" for a, st in zip(s.agent_job_states, states, strict=True))
                t.add_row(
                    gid,
                    group_state_text(opb.GroupStatus.State.Name(s.group.group_state)[6:], states),
                    s.group.locking_job or "-",
                    s.group.loaded_job or "samplers",
                    str(s.group.waiter_queue_depth),
                    agents,
                )
            console.print(t)
            _weights_table(console, ch, groups, md)
            info = info_grpc.OrchestratorInfoServiceStub(ch)
            _yield_requests_table(console, info, md)
            _deadlines_table(console, info, md)
            switches = info.ListSwitches(info_pb.ListSwitchesRequest(limit=10), timeout=5, metadata=md).switches
            t = table("recent switches (newest first)", ("when", "group", "kind", "cause", "job", "ok", "phases (s)", "error"))
            for sw in switches:
                when = time.strftime("%H:%M:%S", time.localtime(sw.started_at_unix_s))
                phases = " ".join(f"{k}={v:.3f}" for k, v in sw.phase_seconds.items())
                notes = [sw.error[:80]] if sw.error else []
                if sw.drain_cut_request_ids:
                    notes.append(f"{len(sw.drain_cut_request_ids)} cut at drain deadline (503)")
                notes += [f"{a}: {n} parked" for a, n in sorted(sw.parked_requests.items())]
                t.add_row(
                    when,
                    sw.group_id,
                    sw.kind,
                    sw.cause or "-",
                    sw.job_id or "-",
                    "yes" if sw.ok else "[red]no[/red]",
                    phases,
                    "; ".join(notes),
                )
            console.print(t)
        except grpc.RpcError as exc:
            console.print(f"orchestrator {orchestrator}: {_refusal(exc, token_file)}", style="red", markup=False)
            rc = 1
    for gate in gates:
        with tls.channel(gate, tls_files) as ch:
            gate_stub = gpb_grpc.GateControlServiceStub(ch)
            try:
                pools = gate_stub.ListPools(gpb.ListPoolsRequest(), timeout=5, metadata=md).pools
                t = table(f"gate @ {gate}", ("pool", "epoch", "endpoint", "state", "weight version", "in flight", "held"))
                bands: list = []
                for p in pools:
                    s = gate_stub.GetPoolStatus(gpb.GetPoolStatusRequest(pool=p), timeout=5, metadata=md)
                    bands += [(p, b) for b in s.bands]
                    if not s.endpoints:
                        t.add_row(p, str(s.epoch), "-", "-", "-", "-", str(s.held))
                    for i, e in enumerate(s.endpoints):  # pool-wide figures on the pool's first row only
                        t.add_row(
                            p if i == 0 else "",
                            str(s.epoch) if i == 0 else "",
                            e.address,
                            gpb.EndpointState.Name(e.state)[15:],
                            str(e.weight_version),
                            str(e.in_flight),
                            str(s.held) if i == 0 else "",
                        )
                console.print(t)
                line = objectives_line(gate_stub, md)
                if line:
                    console.print(line)
                if bands:
                    console.print(bands_table(bands))
            except grpc.RpcError as exc:
                console.print(f"gate {gate}: {_refusal(exc, token_file)}", style="red", markup=False)
                rc = 1
    return rc


def objectives_line(gate_stub, md) -> str:
    """One line on where the gate's InferenceObjectives come from (``GetObjectivesSource``): the group read, or why
    priority bands are off. Empty for a gate that does not read them from Kubernetes, or predates the call."""
    try:
        src = gate_stub.GetObjectivesSource(gpb.GetObjectivesSourceRequest(), timeout=5, metadata=md)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return ""
        raise
    if src.state in (gpb.OBJECTIVES_SOURCE_STATE_UNSPECIFIED, gpb.OBJECTIVES_SOURCE_STATE_NOT_KUBERNETES):
        return ""
    from rich.markup import escape

    state = gpb.ObjectivesSourceState.Name(src.state)[len("OBJECTIVES_SOURCE_STATE_") :].lower()
    served = f"; served: {', '.join(src.served)}" if len(src.served) > 1 else ""
    if src.state == gpb.OBJECTIVES_SOURCE_STATE_READING:
        return (
            f"objectives: {src.objectives} InferenceObjectives from {src.group_version} in {src.namespace}{served}; "
            "priority bands on"
        )
    if src.group_version:
        return (
            f"[yellow]objectives: {state}: {escape(src.detail)}; keeping the {src.objectives} InferenceObjectives of "
            f"{src.group_version} last read[/yellow]"
        )
    return f"[yellow]objectives: {state}: priority bands off: {escape(src.detail)}[/yellow]"


def bands_table(bands: list) -> Table:
    """Held requests per priority band: ``bands`` is ``[(pool, BandStatus)]`` (``GetPoolStatus``)."""
    t = Table(title="priority bands (held per band, highest first)")
    for col in (
        "pool",
        "band",
        "held",
        "oldest held (s)",
        "deadline (s)",
        "max hold (s)",
        "released",
        "refused",
        "deadline misses",
    ):
        t.add_column(col)
    for pool, b in bands:
        refused = ", ".join(f"{r}={n}" for r, n in sorted(b.refused_total.items())) or "0"
        t.add_row(
            pool,
            str(b.band),
            str(b.held),
            f"{b.oldest_held_s:.1f}" if b.held else "-",
            f"{b.hold_deadline_s:g}" if b.hold_deadline_s else "-",
            f"{b.max_hold_s:g}",
            str(b.released_total),
            refused,
            str(b.deadline_misses_total),
        )
    return t
