"""What ``up`` refuses in a stack file before it starts anything, beside its ports: one check that ``up`` and
``config check`` both call (:func:`start_check`), so ``config check`` says OK only for a file ``up`` would start.

Checked: across nodes, the placement (a node list exists, every node an engine or ``stack.head_node`` names is in
it, no two components on one port of one node) and the hostnames of engines given by ``url``; on one machine,
``stack.host`` (an address of this machine); ``stack.token_file`` (not a directory, readable, not empty; one that
does not exist is a note: ``up`` creates it, mode 0600, with a new token). Ports in use now are not checked here
(:meth:`~llmd_timeslice.local.up.Stack.port_problems`: ``up`` refuses them, ``config check`` lists them as notes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llmd_timeslice import auth
from llmd_timeslice.local.nodes import NodeError
from llmd_timeslice.local.ports import host_problem
from llmd_timeslice.local.stack_file import StackFile


@dataclass(frozen=True)
class StartCheck:
    errors: list[str] = field(default_factory=list)
    """What ``up`` refuses (exit 2, nothing started), one line each, every one found."""
    notes: list[str] = field(default_factory=list)
    """What ``up`` does that the user may not expect (a token file it creates), one line each."""


def start_check(sf: StackFile, base_dir: Path) -> StartCheck:
    """The checks of the module docstring on the loaded stack file ``sf`` (relative paths from ``base_dir``, the
    stack file's folder). Writes nothing; resolves hostnames and tries to bind ``stack.host`` with port 0."""
    from llmd_timeslice.local.across import url_addresses

    out = StartCheck()
    if sf.across_nodes():
        for check in (sf.placement, lambda: url_addresses(sf)):
            try:
                check()
            except NodeError as exc:
                out.errors.extend(exc.errors)
    else:  # across nodes each node binds its own address, checked by `up` on that node
        bad_host = host_problem(sf.stack.host)
        if bad_host:
            out.errors.append(bad_host)
    if sf.stack.token_file:
        path = sf.resolve(base_dir, sf.stack.token_file)
        problem = token_file_problem(path)
        if problem == _MISSING:
            out.notes.append(f"stack.token_file {path}: no such file; `up` creates it with a new token (mode 0600)")
        elif problem:
            out.errors.append(f"stack.token_file {path}: {problem}")
    return out


_MISSING = "no such file"


def token_file_problem(path: Path) -> str | None:
    """None when ``path`` is a readable, non-empty token file; else what is wrong, as the end of one line
    (``"no such file"`` when it does not exist)."""
    if path.is_dir():
        return "is a directory; name a file holding the token, or leave stack.token_file out (`up` generates one)"
    try:
        auth.load_token(path)  # the reader every component uses
    except auth.TokenFileMissing:
        return _MISSING
    except auth.TokenFileNotText:
        return "is not text; write the token into it as one line"
    except auth.TokenFileError as exc:
        return f"cannot read it ({exc.strerror}); make it readable by this user"
    except ValueError:
        return "the file is empty; write the token into it, or delete it and `up` creates one"
    return None
