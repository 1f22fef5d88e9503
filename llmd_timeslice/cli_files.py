"""Options of the ``llmd-timeslice`` commands that name a file to read: one line when it is not there.

click's own check (``exists=True``) answers a missing file with four lines of usage; :func:`existing_file` answers
``llmd-timeslice up: stack file missing.yaml: no such file`` instead (exit 2, the usage-error code, from
:func:`llmd_timeslice.cli.main`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer


class InputFileError(Exception):
    """A file named on the command line that cannot be read; ``str()`` is the one line to print."""


def file_problem(path: Path) -> str | None:
    """None when ``path`` is a file this user can read; else what is wrong (``no such file``, ...)."""
    if not path.exists():
        return "no such file"
    if path.is_dir():
        return "is a directory, not a file"
    if not os.access(path, os.R_OK):
        return "not readable by this user"
    return None


def existing_file(what: str) -> Callable[[typer.Context, Any], Any]:
    """A typer option callback: the option's path (or each of its paths, for a repeatable option) must be a file
    this user can read.

    Args:
        what: what the file is, for the message (``stack file``, ``profiles file``).

    Raises:
        InputFileError: ``<command>: <what> <path>: <problem>`` for the first path that is not.
    """

    def check(ctx: typer.Context, value: Any) -> Any:
        if ctx.resilient_parsing:  # shell completion: nothing is read
            return value
        for p in value if isinstance(value, list | tuple) else [value]:
            problem = None if p is None else file_problem(Path(p))
            if problem:
                raise InputFileError(f"{ctx.command_path}: {what} {p}: {problem}")
        return value

    return check
