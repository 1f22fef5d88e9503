"""One node's part of a stack across nodes: what ``up`` on this node starts, where it binds, what the head writes.

Given the placement (:meth:`~llmd_timeslice.local.stack_file.StackFile.placement`) and this node
(:func:`~llmd_timeslice.local.nodes.this_node`), :func:`node_part` answers:

* ``address`` -- this node's own address (its hostname resolved; an IP address as written): every component here
  binds to it and is advertised at it (``stack.host`` of the node's view);
* ``local_engines`` -- the engines (and sidecars) this node starts;
* ``head`` -- whether it also starts the control plane (orchestrator, gate, Envoy);
* ``engine_hosts`` -- each engine's node address: the head's inventory names the sidecars and engines on other nodes
  there, so the orchestrator and the gate reach them;
* ``workdir`` -- shared files (token, inventory, ``nodes.json``) in the stack's workdir on the allocation's shared
  filesystem, this node's own (logs, ``stack.json``, ``up.lock``) under ``WORKDIR/nodes/<node>``.

Design: docs/decisions/stack-across-nodes.md.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from llmd_timeslice.local.nodes import NodeError, Placement, check_same_file, file_hash, this_node
from llmd_timeslice.local.stack_file import StackFile
from llmd_timeslice.local.supervisor import StartFailed

NODES_FILE = "nodes.json"
"""Written by the head into the shared workdir: ``{"head", "head_address", "nodes", "engines", "stack_sha256", "run"}``."""
STATE_FILE = "stack.json"
"""Each node's state in ``WORKDIR/nodes/<node>/``, refreshed every second while its ``up`` runs."""
STALE_AFTER_S = 10.0
"""A running node refreshes its state every second; older than this it is shown as unreachable (the default of
``stack.node_stale_after_s``, which each node writes into its state as ``stale_after_s``)."""


def is_stale(state: Mapping, now: float) -> bool:
    """Whether a node's ``stack.json`` (``state``) is older than the bound its own ``up`` wrote there
    (``stale_after_s``; :data:`STALE_AFTER_S` if absent); ``now`` in unix seconds."""
    bound = float(state.get("stale_after_s", STALE_AFTER_S))
    return now - float(state.get("updated_unix_s", 0)) > bound


def node_address(node: str) -> str:
    """The address of ``node``: an IP address as given, a hostname resolved (IPv4 first).

    Raises:
        NodeError: the name does not resolve.
    """
    try:
        infos = socket.getaddrinfo(node, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise NodeError([f"node {node!r}: does not resolve to an address ({exc.strerror})"]) from None
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    return str(infos[0][4][0])


@dataclass(frozen=True)
class NodePart:
    node: str
    address: str
    head: bool
    local_engines: tuple[str, ...]
    engine_hosts: dict[str, str]
    head_address: str

    def node_workdir(self, workdir: Path) -> Path:
        """This node's own files (logs, state, lock): ``WORKDIR/nodes/<node>``."""
        return workdir / "nodes" / self.node


def node_part(placement: Placement, me: str) -> NodePart:
    """This node's part of ``placement``.

    Raises:
        NodeError: a node that does not resolve.
    """
    addresses = {n: node_address(n) for n in sorted(set(placement.engines.values()) | {placement.head, me})}
    return NodePart(
        node=me,
        address=addresses[me],
        head=me == placement.head,
        local_engines=tuple(placement.on(me)),
        engine_hosts={name: addresses[n] for name, n in placement.engines.items()},
        head_address=addresses[placement.head],
    )


def write_nodes_file(workdir: Path, placement: Placement, part: NodePart, stack_file: Path) -> Path:
    """The head's record of the placement and the stack file's hash, for the other nodes and ``status``/``down``."""
    path = workdir / NODES_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "head": placement.head,
                "head_address": part.head_address,
                "nodes": list(placement.nodes),
                "engines": placement.engines,
                "stack_sha256": file_hash(stack_file),
                "run": run_id(),
            },
            indent=1,
        )
    )
    tmp.replace(path)
    return path


def read_nodes_file(workdir: Path) -> dict | None:
    """The head's ``nodes.json``, or None before the head wrote it."""
    try:
        return json.loads((workdir / NODES_FILE).read_text())
    except (OSError, ValueError):
        return None


def run_id(env: Mapping[str, str] | None = None) -> str | None:
    """The Slurm job step this task belongs to (``SLURM_JOB_ID.SLURM_STEP_ID``), the same for every task of one
    ``srun``; None outside Slurm."""
    env = os.environ if env is None else env
    job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID")
    return f"{job}.{step}" if job and step else None


def current_record(workdir: Path, env: Mapping[str, str] | None = None) -> dict | None:
    """The head's ``nodes.json`` if it is this run's, else None (not written yet, or left by an earlier run in the
    same workdir, whose stack file may have been another): written by a task of this ``srun`` step, or by a head
    whose ``up`` is starting or running now (its state not stale: :func:`is_stale`)."""
    record = read_nodes_file(workdir)
    if record is None:
        return None
    run = run_id(env)
    if run is not None and record.get("run") == run:
        return record
    try:
        state = json.loads((workdir / "nodes" / record["head"] / STATE_FILE).read_text())
    except (OSError, ValueError, KeyError):
        return None
    fresh = not is_stale(state, time.time())
    return record if fresh and state.get("phase") in ("starting", "running") else None


def check_against_head(
    file: Path, workdir: Path, progress=lambda msg: None, timeout_s: float | None = None, env: Mapping[str, str] | None = None
) -> None:
    """An engine node, before it starts anything: wait for the head's record of this run (:func:`current_record`),
    then refuse a stack file whose hash differs from the one the head runs.

    Raises:
        NodeError: the file differs (one line), or no record of this run within ``timeout_s`` (default
            :data:`TOKEN_WAIT_S`): the head did not start, or the workdir is not shared.
    """
    wait_s = TOKEN_WAIT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + wait_s
    record = current_record(workdir, env)
    if record is None:
        progress(f"waiting for the head node to start (its record {workdir / NODES_FILE}, the allocation's shared filesystem)")
    while record is None:
        if time.monotonic() > deadline:
            raise NodeError(
                [
                    f"{workdir / NODES_FILE}: the head node did not start within {wait_s:g} s, "
                    "or the workdir is not on a filesystem every node shares"
                ]
            )
        time.sleep(0.2)
        record = current_record(workdir, env)
    check_same_file(file, record["stack_sha256"], record["head"])


def this_nodes_part(
    file: Path, sf: StackFile, shared_workdir: Path, node: str | None = None
) -> tuple[StackFile, NodePart] | None:
    """(the stack as this node runs it, this node's part); None on one machine (the file places nothing on nodes).

    ``node``: ``up --node``, else Slurm's environment. The head writes ``nodes.json`` (placement, the file's hash)
    into ``shared_workdir``; another node refuses a file whose hash differs from the head's.

    Raises:
        NodeError: ``--node`` on a one-machine stack, a node not in the allocation, a name that does not resolve,
            two engines on one port of one node, a stack file that differs from the head's.
    """
    if not sf.across_nodes():
        if node is not None:
            raise NodeError(["--node: this stack file places nothing on nodes (no stack.nodes, no engines[].node)"])
        return None
    placement = sf.placement()
    part = node_part(placement, this_node(placement.nodes, node))
    shared_workdir.mkdir(parents=True, exist_ok=True)
    if part.head:
        write_nodes_file(shared_workdir, placement, part, file)
    else:  # checked here when the head already runs; `up` waits for it first (check_against_head)
        record = current_record(shared_workdir)
        if record is not None:
            check_same_file(file, record["stack_sha256"], record["head"])
    return sf.for_node(part.address, part.engine_hosts, url_addresses(sf)), part


def url_addresses(sf: StackFile) -> dict[str, str]:
    """Engine name -> the address its ``url``'s hostname resolves to, for each engine given by a url that names a
    host (``http://gpu02:8001``): Envoy routes only to addresses (an endpoint named by a hostname is refused).

    Raises:
        NodeError: a hostname that does not resolve (one line per engine).
    """
    out, errors = {}, []
    for i, e in enumerate(sf.engines):
        host = urlparse(e.url).hostname if e.url else None
        if not host:
            continue
        try:
            ipaddress.ip_address(host)
            continue
        except ValueError:
            pass
        try:
            out[e.name] = node_address(host)
        except NodeError:
            errors.append(f"engines[{i}] ({e.name}).url: host {host!r} does not resolve to an address")
    if errors:
        raise NodeError(errors)
    return out


TOKEN_WAIT_S = 300.0
"""How long an engine node waits for the head's token on the shared filesystem (seconds)."""


def wait_for_token(token_file: Path, progress=lambda msg: None, timeout_s: float = TOKEN_WAIT_S) -> None:
    """Wait until the head has written the control-plane token (across nodes).

    Raises:
        StartFailed: no token after ``timeout_s`` (the head did not start, or the workdir is not shared).
    """
    deadline = time.monotonic() + timeout_s
    if not token_file.exists():
        progress(f"waiting for the head node's token at {token_file} (the allocation's shared filesystem)")
    while not token_file.exists():
        if time.monotonic() > deadline:
            raise StartFailed(
                f"no control-plane token at {token_file} after {timeout_s:g} s: the head node did not start, "
                "or the workdir is not on a filesystem every node shares"
            )
        time.sleep(0.2)
