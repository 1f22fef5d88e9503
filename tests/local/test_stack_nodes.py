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
