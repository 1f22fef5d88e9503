"""``llmd-timeslice down | status -f STACK.yaml`` from another shell: the stack's state file, ``WORKDIR/stack.json``,
which ``up`` keeps current (:meth:`Stack.write_state <llmd_timeslice.local.up.Stack.write_state>`: its pid and phase,
each component's pid, state, port, restarts and last exit, the endpoints), read back.

``down`` sends ``up`` SIGTERM and waits for its bounded stop (``STOP_BOUND_S``), then kills any component left
behind (an ``up`` that was SIGKILLed); ``status`` prints the components, then the groups and gates of the running
stack. A stack across nodes is asked through its shared workdir instead (:mod:`~llmd_timeslice.local.across_control`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

from rich.console import Console

from llmd_timeslice.local.across_control import print_nodes_status, request_down
from llmd_timeslice.status import output_console, table

__all__ = ["STATE_FILE", "STOP_BOUND_S", "alive", "print_stack_status", "read_state", "run_down"]

STATE_FILE = "stack.json"
"""The state file's name in the stack's workdir."""
STOP_BOUND_S = 60.0
"""Most seconds a stop takes: gate, engine wake-ups, then every process group (SIGKILL after its grace)."""


def alive(pid) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:  # no /proc (not Linux): kill(0) is all we know
        return True


def read_state(file: Path, workdir: Path | None = None, port_offset: int | None = None) -> tuple[Path, dict | None]:
    """(the workdir of the stack of ``file``, its ``stack.json`` or None); ``port_offset`` as given to ``up``."""
    from llmd_timeslice.local.stack_file import load_stack_file

    sf = load_stack_file(file, port_offset)
    wd = (workdir or sf.workdir(file.resolve().parent)).resolve()
    try:
        return wd, json.loads((wd / STATE_FILE).read_text())
    except (OSError, ValueError):
        return wd, None


def _across_workdir(file: Path, workdir: Path | None, port_offset: int | None) -> Path | None:
    """The shared workdir of a stack across nodes (None: a one-machine stack)."""
    from llmd_timeslice.local.stack_file import load_stack_file

    sf = load_stack_file(file, port_offset)
    return (workdir or sf.workdir(file.resolve().parent)).resolve() if sf.across_nodes() else None


def run_down(
    file: Path, workdir: Path | None = None, timeout_s: float = STOP_BOUND_S + 15, port_offset: int | None = None
) -> int:
    """Stop a stack started by ``up`` from another shell: SIGTERM to ``up``, wait, then check nothing is left."""
    console = Console()
    across = _across_workdir(file, workdir, port_offset)
    if across is not None:
        return request_down(across, console, timeout_s)
    wd, state = read_state(file, workdir, port_offset)
    if state is None or not alive(state.get("pid")):
        console.print(f"no running stack in {wd}")
        return 0 if state is None or state.get("phase") == "stopped" else _reap(console, state)
    pid = int(state["pid"])
    os.kill(pid, signal.SIGTERM)
    with console.status(f"stopping the stack (pid {pid}) ..."):
        deadline = time.monotonic() + timeout_s
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    if alive(pid):
        console.print(f"[red]the stack (pid {pid}) did not stop within {timeout_s:g} s; killing it and its children[/red]")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return _reap(console, state) or 1
    console.print("stack stopped")
    return _reap(console, state)


def _reap(console: Console, state: dict) -> int:
    """Kill the process group of any component still alive (an ``up`` that was SIGKILLed); 0 if none was."""
    left = [c for c in state.get("components", []) if alive(c.get("pid"))]
    for c in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(c["pid"]), signal.SIGKILL)
        console.print(f"[yellow]killed {c['name']} (pid {c['pid']}), left behind[/yellow]")
    return 0


def up_command(file: Path, workdir: Path | None = None, port_offset: int | None = None) -> str:
    """``llmd-timeslice up -f FILE`` with the ``--workdir`` and ``--port-offset`` given (for a hint: the stack
    those options name, not the one without them)."""
    extra = (f" --workdir {workdir}" if workdir is not None else "") + (
        f" --port-offset {port_offset}" if port_offset is not None else ""
    )
    return f"llmd-timeslice up -f {file}{extra}"


def print_stack_status(file: Path, workdir: Path | None = None, port_offset: int | None = None) -> int:
    """Components from the state file, then groups and gate tables from the running stack."""
    from llmd_timeslice.status import print_status

    console = output_console()
    across = _across_workdir(file, workdir, port_offset)
    if across is not None:
        code, head = print_nodes_status(across, console)
        if head is None or (code and head.get("phase") != "running"):
            return code or 1
        e = head["endpoints"]
        console.print(f"router {e['router']}  orchestrator {e['orchestrator']}")
        return print_status(e["orchestrator"], [e["gate_control"]], Path(e["token_file"]), console) or code
    wd, state = read_state(file, workdir, port_offset)
    if state is None:
        hint = f"no stack state in {wd}: start one with `{up_command(file, workdir, port_offset)}`"
        console.print(hint, soft_wrap=True, markup=False, highlight=False)  # never folded: the command is copied
        return 1
    running = alive(state.get("pid")) and state.get("phase") in ("starting", "running")
    t = table(
        f"stack {state['name']!r}: {state['phase'] if running else 'not running'} (pid {state['pid']})",
        ("component", "state", "pid", "port", "restarts", "last exit"),
    )
    for c in state.get("components", []):
        is_alive = alive(c.get("pid"))
        t.add_row(
            c["name"],
            c["state"] if running else ("orphan!" if is_alive else "stopped"),
            str(c["pid"] or "-"),
            str(c["port"] or "-"),
            str(c["restarts"]),
            c["last_exit"] or "-",
        )
    console.print(t)
    console.print(f"logs: {Path(state['workdir']) / 'logs'}/<component>.log")
    if not running:
        return 1
    e = state["endpoints"]
    console.print(f"router {e['router']}  orchestrator {e['orchestrator']}")
    return print_status(e["orchestrator"], [e["gate_control"]], Path(e["token_file"]), console)
