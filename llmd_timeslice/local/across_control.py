"""``status -f`` and ``down -f`` of a stack across nodes, from any node, over the shared workdir.

Each node's ``up`` keeps ``WORKDIR/nodes/<node>/stack.json`` current (every second while running: phase, components,
``updated_unix_s``). ``down -f`` on any node writes ``WORKDIR/down-requested``; every node's ``up`` sees it within
0.2 s (:func:`down_requested`), stops its part and writes phase ``stopped`` after checking its own processes are
gone; ``down`` waits until every node that ran reports that. ``status -f`` shows every node's table. A node whose
state has not been refreshed for ``stack.node_stale_after_s`` is shown as ``unreachable`` (dead, frozen or its
filesystem cut off).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console

from llmd_timeslice.local.across import STATE_FILE, is_stale, read_nodes_file
from llmd_timeslice.status import table

DOWN_FILE = "down-requested"


def down_requested(shared_workdir: Path, started_unix_s: float) -> bool:
    """Whether ``down -f`` asked every node to stop after this ``up`` started (a marker of an earlier ``down``,
    older than this ``up``, does not stop it)."""
    try:
        return (shared_workdir / DOWN_FILE).stat().st_mtime >= started_unix_s
    except OSError:
        return False


def node_states(shared_workdir: Path) -> dict[str, dict]:
    """Node -> its ``stack.json`` (nodes that never wrote one are absent)."""
    out = {}
    for f in sorted((shared_workdir / "nodes").glob(f"*/{STATE_FILE}")):
        try:
            out[f.parent.name] = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
    return out


def _phase(state: dict, now: float) -> str:
    if state.get("phase") in ("starting", "running", "stopping") and is_stale(state, now):
        return f"unreachable (no update for {now - state.get('updated_unix_s', 0):.0f} s)"
    return str(state.get("phase"))


def print_nodes_status(shared_workdir: Path, console: Console) -> tuple[int, dict | None]:
    """One table per node; returns (exit code: 0 when every node runs, else 1; the head's state or None)."""
    states, record, now = node_states(shared_workdir), read_nodes_file(shared_workdir), time.time()
    if not states:
        console.print(f"no node of this stack has state in {shared_workdir}/nodes: start it with `up` on every node")
        return 1, None
    head = (record or {}).get("head")
    code = 0
    for node in (record or {}).get("nodes", sorted(states)):
        st = states.get(node)
        if st is None:
            console.print(f"node {node}: no state (its `up` did not start)")
            code = 1
            continue
        phase = _phase(st, now)
        code |= phase != "running"
        t = table(
            f"node {node}{' (head)' if node == head else ''}: {phase} (pid {st.get('pid')})",
            ("component", "state", "pid", "port", "restarts", "last exit"),
        )
        for c in st.get("components", []):
            t.add_row(
                c["name"], c["state"], str(c["pid"] or "-"), str(c["port"] or "-"), str(c["restarts"]), c["last_exit"] or "-"
            )
        console.print(t)
    return code, states.get(head) if head else None


def request_down(shared_workdir: Path, console: Console, timeout_s: float) -> int:
    """``down -f`` across nodes: ask every node to stop, wait until each that ran reports ``stopped``; 1 when one
    did not (named, with its last phase), else 0."""
    (shared_workdir / DOWN_FILE).write_text(str(time.time()))
    deadline = time.monotonic() + timeout_s
    with console.status("stopping every node of the stack ..."):
        while True:
            now = time.time()
            left = {
                n: _phase(s, now)
                for n, s in node_states(shared_workdir).items()
                if s.get("phase") in ("starting", "running", "stopping")
            }
            if all(p.startswith("unreachable") for p in left.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    for node, st in node_states(shared_workdir).items():
        console.print(f"node {node}: {_phase(st, time.time())}")
    if left:
        console.print(f"[red]not confirmed stopped: {', '.join(f'{n} ({p})' for n, p in left.items())}[/red]")
        return 1
    return 0
