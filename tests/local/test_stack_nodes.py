"""A stack across nodes: the node list (stack.nodes, Slurm's hostlist), this task's node, and each bad placement
named in one line before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmd_timeslice.local import nodes
from llmd_timeslice.local.nodes import NodeError
from llmd_timeslice.local.stack_file import StackError, load_stack_file

REPO = Path(__file__).resolve().parents[2]


def _two_node(tmp_path: Path, **stack) -> Path:
    data = yaml.safe_load((REPO / "examples" / "two-node-stack.yaml").read_text())
    data["stack"].update(stack)
    p = tmp_path / "stack.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_the_example_places_one_engine_per_node_of_the_slurm_allocation(tmp_path):
    pytest.importorskip("hostlist", reason="python-hostlist is not installed here and Slurm's scontrol is absent")
    sf = load_stack_file(REPO / "examples" / "two-node-stack.yaml")
    env = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NODEID": "1"}
    placement = sf.placement(env)
    assert placement.head == "gpu01" and placement.engines == {"sampler-0": "gpu01", "sampler-1": "gpu02"}
    assert nodes.this_node(placement.nodes, env=env) == "gpu02"
    assert nodes.this_node(placement.nodes, "gpu01", env=env) == "gpu01"
    assert placement.on("gpu02") == ["sampler-1"]


def test_slurms_own_scontrol_expands_the_nodelist_when_present(tmp_path):
    fake = tmp_path / "scontrol"  # Slurm's CLI answers `show hostnames` one name a line
    fake.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'x1\\nx2\\n'\n")
    fake.chmod(0o755)
    assert nodes.expand_nodelist("x[1-2]", scontrol=str(fake)) == ["x1", "x2"]


def test_a_node_not_in_the_allocation_is_one_line(tmp_path):
    data = yaml.safe_load((REPO / "examples" / "two-node-stack.yaml").read_text())
    data["stack"]["nodes"] = ["node-a", "node-b"]
    data["engines"][1]["node"] = "node-c"
    p = tmp_path / "stack.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(StackError) as ei:
        load_stack_file(p)
    assert ei.value.errors == ["engines[1] (sampler-1).node: node 'node-c' is not in the allocation ['node-a', 'node-b']"]
    with pytest.raises(NodeError, match=r"^--node: node 'node-z' is not in the allocation"):
        nodes.this_node(["node-a", "node-b"], "node-z", env={})


def test_two_engines_on_one_port_of_one_node_are_refused_but_not_on_two_nodes(tmp_path):
    data = yaml.safe_load((REPO / "examples" / "two-node-stack.yaml").read_text())
    data["stack"]["nodes"] = ["node-a", "node-b"]
    load_stack_file(_write(tmp_path, data))  # the same ports on two nodes
    data["engines"][1]["node"] = "node-a"
    with pytest.raises(StackError) as ei:
        load_stack_file(_write(tmp_path, data))
    assert "engines[1] (sampler-1).sidecar_port: port 9100 on node 'node-a' is also engines[0] (sampler-0).sidecar_port" in (
        ei.value.errors
    )


def test_the_head_index_is_resolved_in_the_allocation(tmp_path):
    with pytest.raises(NodeError, match=r"^stack.head_node: node index 5 is not in the allocation of 2 nodes"):
        load_stack_file(_two_node(tmp_path, head_node=5)).placement({"SLURM_JOB_NODELIST": "a,b"})


def test_a_stack_file_that_differs_from_the_heads_is_refused_by_hash(tmp_path):
    p = _two_node(tmp_path)
    head_hash = nodes.file_hash(p)
    nodes.check_same_file(p, head_hash, "gpu01")
    p.write_text(p.read_text() + "\n# edited on one node\n")
    with pytest.raises(NodeError, match=r"differs from the one the head node 'gpu01' runs \(sha256 "):
        nodes.check_same_file(p, head_hash, "gpu01")


def test_without_slurm_or_a_library_the_nodelist_is_one_line(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_hostlist(name, *a, **k):
        if name == "hostlist":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_hostlist)
    with pytest.raises(NodeError, match="neither Slurm's scontrol on PATH nor the python-hostlist package"):
        nodes.expand_nodelist("n[1-2]", scontrol="")


def _write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "stack.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _loopback_nodes(tmp_path: Path) -> Path:
    """Two nodes on this machine's loopback (127.0.0.1 and 127.0.0.2: Linux routes 127/8 to lo)."""
    data = yaml.safe_load((REPO / "examples" / "two-node-stack.yaml").read_text())
    data["stack"]["nodes"] = ["127.0.0.1", "127.0.0.2"]
    return _write(tmp_path, data)


def test_each_node_starts_its_own_part_and_the_heads_inventory_names_the_other_nodes_sidecars(tmp_path):
    from llmd_timeslice.local.up import node_stack

    p = _loopback_nodes(tmp_path)
    sf = load_stack_file(p)
    head = node_stack(p, sf, node="0")
    worker = node_stack(p, sf, node="127.0.0.2")
    assert head.head and not worker.head
    assert [e.name for e in head.local_engines()] == ["sampler-0"] and [e.name for e in worker.local_engines()] == ["sampler-1"]
    # the engine node binds its engine and sidecar to its own address, and none of the control plane's ports
    assert worker.ports_to_bind() == [
        ("engines[1] (sampler-1).sidecar_port", "127.0.0.2", 9100),
        ("engines[1] (sampler-1).vllm.port", "127.0.0.2", 8001),
    ]
    assert {w for w, _, _ in head.ports_to_bind()} >= {"stack.ports.orchestrator", "engines[0] (sampler-0).sidecar_port"}
    samplers = {s.job_id: s for s in head.sf.inventory().groups[0].samplers}
    assert samplers["sampler-1"].sidecar == "127.0.0.2:9100" and samplers["sampler-1"].address == "127.0.0.2:8001"
    assert samplers["sampler-0"].sidecar == "127.0.0.1:9100"
    # shared: token and nodes.json; per node: state, logs, lock
    assert head.token_file == worker.token_file and head.workdir != worker.workdir
    assert (head.shared_workdir / "nodes.json").is_file()


def test_an_engine_node_refuses_a_stack_file_that_differs_from_the_heads(tmp_path):
    from llmd_timeslice.local.up import node_stack

    p = _loopback_nodes(tmp_path)
    node_stack(p, load_stack_file(p), node="0")  # the head records the file's hash
    p.write_text(p.read_text() + "# edited\n")
    with pytest.raises(NodeError, match=r"differs from the one the head node '127\.0\.0\.1' runs"):
        node_stack(p, load_stack_file(p), node="1")


def test_node_on_a_one_machine_stack_is_one_line(tmp_path):
    from llmd_timeslice.local.up import node_stack

    with pytest.raises(NodeError, match=r"^--node: this stack file places nothing on nodes"):
        node_stack(REPO / "examples" / "cpu-stack.yaml", load_stack_file(REPO / "examples" / "cpu-stack.yaml"), node="a")


def test_down_from_any_node_waits_for_every_node_and_names_one_it_cannot_confirm(tmp_path):
    import json
    import time

    from rich.console import Console

    from llmd_timeslice.local.across_control import down_requested, print_nodes_status, request_down

    started = time.time() - 1
    for node, phase, age in (("a", "stopped", 0), ("b", "running", 60)):
        d = tmp_path / "nodes" / node
        d.mkdir(parents=True)
        state = {"pid": 1, "phase": phase, "updated_unix_s": time.time() - age, "components": []}
        (d / "stack.json").write_text(json.dumps(state))
    console = Console(record=True, width=200)
    assert not down_requested(tmp_path, started)
    assert request_down(tmp_path, console, timeout_s=5) == 1  # node b stopped refreshing: not confirmed
    assert down_requested(tmp_path, started)
    assert "not confirmed stopped: b (unreachable (no update for 60 s))" in console.export_text()
    code, head = print_nodes_status(tmp_path, console)
    assert code == 1 and head is None


def test_a_head_node_whose_control_plane_port_is_taken_is_refused_naming_the_port(tmp_path):
    import socket

    from llmd_timeslice.local.up import node_stack

    data = yaml.safe_load((REPO / "examples" / "two-node-stack.yaml").read_text())
    data["stack"]["nodes"] = ["127.0.0.1", "127.0.0.2"]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        data["stack"]["ports"] = {"orchestrator": held.getsockname()[1]}
        p = _write(tmp_path, data)
        head = node_stack(p, load_stack_file(p), node="0")
        worker = node_stack(p, load_stack_file(p), node="1")
        taken = head.port_problems()
        assert len(taken) == 1 and "(stack.ports.orchestrator) on 127.0.0.1 is in use" in taken[0]
        assert worker.port_problems() == []  # the engine node binds none of the control plane's ports
