"""``llmd-timeslice status``: groups from the orchestrator and endpoint states from gates, as tables."""

from __future__ import annotations

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


def _weights_table(console: Console, ch: grpc.Channel, groups, md) -> None:
    """Weight versions per sampler (groups with samplers only; skipped on an orchestrator without the service)."""
    stub = wpb_grpc.WeightVersionServiceStub(ch)
    t = Table(title="weight versions")
    for col in ("group", "serving", "pending", "sampler", "version", "in service", "error"):
        t.add_column(col)
    for gid in groups:
        try:
            w = stub.GetWeightVersion(wpb.GetWeightVersionRequest(group_id=gid), timeout=5, metadata=md)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return
            raise
        for i, smp in enumerate(w.samplers):
            t.add_row(gid if i == 0 else "", str(w.serving_version) if i == 0 else "",
                      (str(w.pending.version) if w.pending.version else "-") if i == 0 else "", smp.address,
                      str(smp.version), "yes" if smp.in_service else "[red]no[/red]", smp.error[:80])
    if t.row_count:
        console.print(t)


def print_status(orchestrator: str, gates: list[str], token_file: Path | None = None, console: Console | None = None) -> int:
    """Print the tables; returns 0, or 1 when a component could not be reached (its error is shown)."""
    console = console or Console()
    md = auth.call_metadata(auth.load_token(token_file))
    tls_files = tls.from_env()
    rc = 0
    with tls.channel(orchestrator, tls_files) as ch:
        stub = opb_grpc.TimeSliceOrchestratorServiceStub(ch)
        try:
            groups = stub.ListGroups(opb.ListGroupsRequest(), timeout=5, metadata=md).group_ids
            t = Table(title=f"groups @ {orchestrator}")
            for col in ("group", "state", "holder", "loaded", "waiters", "samplers"):
                t.add_column(col)
            for gid in groups:
                s = stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id=gid), timeout=5, metadata=md)
                agents = ", ".join(f"{a.job_id}:{opb.SnapshotAgentJobState.State.Name(a.job_state)[6:]}"
                                   for a in s.agent_job_states)
                t.add_row(gid, opb.GroupStatus.State.Name(s.group.group_state)[6:], s.group.locking_job or "-",
                          s.group.loaded_job or "samplers", str(s.group.waiter_queue_depth), agents)
            console.print(t)
            _weights_table(console, ch, groups, md)
            info = info_grpc.OrchestratorInfoServiceStub(ch)
            switches = info.ListSwitches(info_pb.ListSwitchesRequest(limit=10), timeout=5, metadata=md).switches
            t = Table(title="recent switches (newest first)")
            for col in ("when", "group", "kind", "job", "ok", "phases (s)", "error"):
                t.add_column(col)
            for sw in switches:
                when = time.strftime("%H:%M:%S", time.localtime(sw.started_at_unix_s))
                phases = " ".join(f"{k}={v:.3f}" for k, v in sw.phase_seconds.items())
                notes = [sw.error[:80]] if sw.error else []
                if sw.drain_cut_request_ids:
                    notes.append(f"{len(sw.drain_cut_request_ids)} cut at drain deadline (503)")
                notes += [f"{a}: {n} parked" for a, n in sorted(sw.parked_requests.items())]
                t.add_row(when, sw.group_id, sw.kind, sw.job_id or "-", "yes" if sw.ok else "[red]no[/red]", phases,
                          "; ".join(notes))
            console.print(t)
        except grpc.RpcError as exc:
            console.print(f"[red]orchestrator {orchestrator}: {exc.code().name}: {exc.details()}[/red]")
            rc = 1
    for gate in gates:
        with tls.channel(gate, tls_files) as ch:
            stub = gpb_grpc.GateControlServiceStub(ch)
            try:
                pools = stub.ListPools(gpb.ListPoolsRequest(), timeout=5, metadata=md).pools
                t = Table(title=f"gate @ {gate}")
                for col in ("pool", "epoch", "endpoint", "state", "weight version", "in flight", "held"):
                    t.add_column(col)
                for p in pools:
                    s = stub.GetPoolStatus(gpb.GetPoolStatusRequest(pool=p), timeout=5, metadata=md)
                    if not s.endpoints:
                        t.add_row(p, str(s.epoch), "-", "-", "-", "-", str(s.held))
                    for i, e in enumerate(s.endpoints):  # pool-wide figures on the pool's first row only
                        t.add_row(p if i == 0 else "", str(s.epoch) if i == 0 else "", e.address,
                                  gpb.EndpointState.Name(e.state)[15:], str(e.weight_version), str(e.in_flight),
                                  str(s.held) if i == 0 else "")
                console.print(t)
            except grpc.RpcError as exc:
                console.print(f"[red]gate {gate}: {exc.code().name}: {exc.details()}[/red]")
                rc = 1
    return rc
