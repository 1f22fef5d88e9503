"""Placement of a stack on several nodes: the allocation's node list, this task's node, and the checks of a placement.

One stack file, the same on every node (docs/local-stack.md, "Across nodes"): each engine (with its sidecar) names
a node -- a hostname, or an index into the allocation's node list -- and the control plane (orchestrator, gate,
Envoy) runs on ``stack.head_node`` (default: index 0, the first node). Every node runs ``llmd-timeslice up -f FILE``
and starts only what is placed on it.

Where the node list comes from, first match wins:

1. ``stack.nodes`` in the file (bare metal, ``up --node NAME`` on each host);
2. ``SLURM_JOB_NODELIST`` (Slurm's compressed hostlist, e.g. ``gpu[01-04],head``), expanded by Slurm's own
   ``scontrol show hostnames`` when it is on ``PATH``, else by the ``hostlist`` module of python-hostlist. Neither:
   :class:`NodeError` (no home-made parser of Slurm's syntax).

Which node this process is: ``up --node NAME`` (a name or an index), else ``SLURMD_NODENAME``, else
``SLURM_NODEID`` (the task's index into the node list, as Slurm sets it for each step task).

A stack file that differs between nodes is refused by hash: the head writes :func:`file_hash` of the file it read
into the inventory (``WORKDIR/nodes.json`` on the allocation's shared filesystem), and a worker whose own hash differs
stops before starting anything (:func:`check_same_file`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

NodeRef = str | int
"""A node as the stack file names it: a hostname, or an index into the allocation's node list."""


class NodeError(Exception):
    """The placement is unusable; ``errors`` holds one line per problem (``where: what``)."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


def expand_nodelist(nodelist: str, scontrol: str | None = None) -> list[str]:
    """The hostnames of a Slurm hostlist expression (``n[01-02],head`` -> ``["n01", "n02", "head"]``), in order.

    ``scontrol`` is the path of Slurm's ``scontrol`` (default: found on ``PATH``); without it the ``hostlist``
    module of python-hostlist expands the expression.

    Raises:
        NodeError: neither is available, or the expression is malformed.
    """
    scontrol = scontrol if scontrol is not None else shutil.which("scontrol")
    if scontrol:
        proc = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=False)
        if proc.returncode != 0:
            raise NodeError([f"SLURM_JOB_NODELIST: scontrol show hostnames {nodelist!r} failed: {proc.stderr.strip()}"])
        return proc.stdout.split()
    try:
        import hostlist  # type: ignore[import-untyped]  # python-hostlist (no type stubs)
    except ImportError:
        raise NodeError(
            [
                f"SLURM_JOB_NODELIST: cannot expand {nodelist!r}: neither Slurm's scontrol on PATH nor the python-hostlist "
                "package is installed (pip install python-hostlist), or list the nodes in stack.nodes"
            ]
        ) from None
    try:
        return list(hostlist.expand_hostlist(nodelist))
    except hostlist.BadHostlist as exc:
        raise NodeError([f"SLURM_JOB_NODELIST: {nodelist!r} is not a hostlist: {exc}"]) from None


def allocation_nodes(declared: Sequence[str] | None, env: Mapping[str, str] | None = None) -> list[str] | None:
    """The node list: ``declared`` (``stack.nodes``) when given, else the expanded ``SLURM_JOB_NODELIST``; None on
    one machine (neither)."""
    env = os.environ if env is None else env
    if declared:
        return list(declared)
    if env.get("SLURM_JOB_NODELIST"):
        return expand_nodelist(env["SLURM_JOB_NODELIST"])
    return None


def resolve_node(ref: NodeRef, nodes: Sequence[str], where: str) -> str:
    """The hostname ``ref`` names in ``nodes``.

    Raises:
        NodeError: a name not in the allocation, or an index out of range (one line naming ``where``).
    """
    if isinstance(ref, int) or (isinstance(ref, str) and ref.isdigit()):
        i = int(ref)
        if not 0 <= i < len(nodes):
            raise NodeError([f"{where}: node index {i} is not in the allocation of {len(nodes)} nodes {list(nodes)}"])
        return nodes[i]
    if ref not in nodes:
        raise NodeError([f"{where}: node {ref!r} is not in the allocation {list(nodes)}"])
    return ref


def this_node(nodes: Sequence[str], node_flag: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """Which node of ``nodes`` this process runs on: ``up --node`` (name or index), else ``SLURMD_NODENAME``, else
    ``SLURM_NODEID``.

    Raises:
        NodeError: none given, or the one given is not in the allocation.
    """
    env = os.environ if env is None else env
    if node_flag is not None:
        return resolve_node(node_flag, nodes, "--node")
    if env.get("SLURMD_NODENAME"):
        return resolve_node(env["SLURMD_NODENAME"], nodes, "SLURMD_NODENAME")
    if env.get("SLURM_NODEID"):
        return resolve_node(int(env["SLURM_NODEID"]), nodes, "SLURM_NODEID")
    raise NodeError(
        [f"--node: the stack places components on nodes {list(nodes)}; say which this is (up --node NAME, or run under srun)"]
    )


@dataclass(frozen=True)
class Placement:
    """Where each component runs: ``head`` the control plane's node, ``engines`` engine name -> node."""

    nodes: tuple[str, ...]
    head: str
    engines: dict[str, str]

    def on(self, node: str) -> list[str]:
        """The engines (with their sidecars) placed on ``node``, in stack-file order."""
        return [name for name, n in self.engines.items() if n == node]


def place(nodes: Sequence[str], head: NodeRef, engines: Sequence[tuple[str, NodeRef | None]]) -> Placement:
    """The placement of ``engines`` (name, node or None: the head) and the head on ``nodes``.

    Raises:
        NodeError: every node reference not in the allocation, one line each.
    """
    errors: list[str] = []
    try:
        head_name = resolve_node(head, nodes, "stack.head_node")
    except NodeError as exc:
        errors += exc.errors
        head_name = nodes[0] if nodes else ""
    placed: dict[str, str] = {}
    for i, (name, ref) in enumerate(engines):
        try:
            placed[name] = head_name if ref is None else resolve_node(ref, nodes, f"engines[{i}] ({name}).node")
        except NodeError as exc:
            errors += exc.errors
    if errors:
        raise NodeError(errors)
    return Placement(nodes=tuple(nodes), head=head_name, engines=placed)


def port_clashes(ports: Sequence[tuple[str, str, int]]) -> list[str]:
    """One line per port bound twice on one node; ``ports`` as (node, where, port)."""
    used: dict[tuple[str, int], str] = {}
    out = []
    for node, where, port in ports:
        if (node, port) in used:
            out.append(f"{where}: port {port} on node {node!r} is also {used[node, port]}")
        else:
            used[node, port] = where
    return out


def file_hash(path: Path) -> str:
    """SHA-256 (hex) of the stack file's bytes: equal on every node when the file is the same."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_same_file(path: Path, head_hash: str, head: str) -> None:
    """Refuse a stack file that differs from the head's.

    Raises:
        NodeError: the hashes differ (one line with both prefixes).
    """
    own = file_hash(path)
    if own != head_hash:
        raise NodeError(
            [
                f"{path}: this stack file differs from the one the head node {head!r} runs (sha256 {own[:12]} here, "
                f"{head_hash[:12]} there); use one file on every node"
            ]
        )
