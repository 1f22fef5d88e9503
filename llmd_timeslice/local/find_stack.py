"""Where a running stack is, for a script that uses one (the examples; your own trainer): one rule for all.

Each of the router URL, the orchestrator address and the control-plane token file comes from, in order:

1. the script's flag (``--router``, ``--orchestrator``, ``--token-file``);
2. the variables of the export line ``llmd-timeslice up`` prints (``LLMD_TIMESLICE_ROUTER_URL``,
   ``TIMESLICE_ORCH_ADDR``, ``LLMD_TIMESLICE_TOKEN_FILE``);
3. the stack running from ``--stack FILE`` (its ``stack.json``, written by ``up``), when it runs.

With one of them found nowhere it stops (:class:`StackNotFound`, exit code 2 in the examples) rather than guess
``127.0.0.1:8080``: on a shared node that port may be another user's stack, which would then get the rollouts.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from llmd_timeslice.addresses import check_host_port
from llmd_timeslice.local.stack_file import StackError
from llmd_timeslice.local.up import ROUTER_URL_ENV, alive, read_state

ORCH_ADDR_ENV = "TIMESLICE_ORCH_ADDR"
"""The orchestrator address on ``up``'s export line (the upstream client's own variable)."""
TOKEN_FILE_ENV = "LLMD_TIMESLICE_TOKEN_FILE"
"""The token file on ``up``'s export line."""


class StackNotFound(ValueError):
    """No value for one or more of router / orchestrator / token file; the message names them and the way out."""


@dataclass(frozen=True)
class StackEndpoints:
    """A running stack as a script reaches it."""

    router: str
    """Router URL (OpenAI-style API), ``http://host:port``."""
    orchestrator: str
    """Orchestrator ``host:port``."""
    token_file: str
    """Control-plane token file."""
    token_source: str = "--token-file"
    """Where ``token_file`` was found: ``--token-file``, ``$LLMD_TIMESLICE_TOKEN_FILE`` or ``the running stack of
    FILE``, for error messages (the client's ``token_file_source=``)."""

    def export(self) -> None:
        """Set the export line's variables to these values, for code that reads them (the upstream phase
        callbacks read ``TIMESLICE_ORCH_ADDR``; the TimeSlice client ``LLMD_TIMESLICE_TOKEN_FILE``)."""
        os.environ[ROUTER_URL_ENV] = self.router
        os.environ[ORCH_ADDR_ENV] = self.orchestrator
        os.environ[TOKEN_FILE_ENV] = self.token_file


def add_arguments(ap: argparse.ArgumentParser, default_stack: Path) -> None:
    """Add ``--stack``, ``--router``, ``--orchestrator``, ``--token-file`` to a script's parser (read them back
    with :func:`from_args`)."""
    ap.add_argument("--stack", type=Path, default=default_stack, help="stack file of the running stack (its endpoints and token)")
    ap.add_argument("--router", help=f"router URL (OpenAI-style API); default: ${ROUTER_URL_ENV}, else the running stack's")
    ap.add_argument("--orchestrator", help=f"orchestrator host:port; default: ${ORCH_ADDR_ENV}, else the running stack's")
    ap.add_argument("--token-file", help=f"control-plane token file; default: ${TOKEN_FILE_ENV}, else the running stack's")


def from_args(a: argparse.Namespace) -> StackEndpoints:
    """:func:`find_stack` with the options :func:`add_arguments` added."""
    return find_stack(a.stack, router=a.router, orchestrator=a.orchestrator, token_file=a.token_file)


def running_stack_endpoints(stack: Path, workdir: Path | None = None, port_offset: int | None = None) -> dict:
    """The ``endpoints`` of the stack running from stack file ``stack`` (``{}`` when none runs, the file is missing
    or not a stack file); ``workdir`` and ``port_offset`` as given to ``up``."""
    if not stack.exists():
        return {}
    try:
        _, state = read_state(stack, workdir, port_offset)
    except (StackError, OSError, ValueError):
        return {}
    if state and state.get("phase") == "running" and alive(state.get("pid")):
        return dict(state.get("endpoints") or {})
    return {}


def find_stack(
    stack: Path, *, router: str | None = None, orchestrator: str | None = None, token_file: str | None = None
) -> StackEndpoints:
    """The stack's router, orchestrator and token file, each from its flag, else the export line's variable, else
    the stack running from ``stack`` (module docstring).

    Raises:
        StackNotFound: one of the three found nowhere (the message names the flags, the variables and ``stack``).
        ValueError: an orchestrator address that is not ``host:port`` (one line, llmd_timeslice/addresses.py).
    """
    token_source = "--token-file" if token_file else f"${TOKEN_FILE_ENV}"
    router = router or os.environ.get(ROUTER_URL_ENV)
    orchestrator = orchestrator or os.environ.get(ORCH_ADDR_ENV)
    token_file = token_file or os.environ.get(TOKEN_FILE_ENV)
    if not (router and orchestrator and token_file):
        eps = running_stack_endpoints(stack)
        router = router or eps.get("router")
        orchestrator = orchestrator or eps.get("orchestrator")
        if not token_file:
            token_file, token_source = eps.get("token_file"), f"the running stack of {stack}"
    missing = [n for n, v in (("--router", router), ("--orchestrator", orchestrator), ("--token-file", token_file)) if not v]
    if missing or router is None or orchestrator is None or token_file is None:
        raise StackNotFound(
            f"no {', '.join(missing)}: no stack runs from {stack}; run the export line `llmd-timeslice up` printed "
            f"({ROUTER_URL_ENV}, {ORCH_ADDR_ENV}, {TOKEN_FILE_ENV}), pass --stack FILE, or pass the flags"
        )
    check_host_port(orchestrator, "the orchestrator as host:port")
    return StackEndpoints(router.rstrip("/"), orchestrator, str(token_file), token_source)
