"""`llmd-timeslice ARGS` through its console entry point, in the test's process, for commands that exit at once.

A Python start with the CLI's imports is ~0.5 s of CPU here, and several seconds of wall time on 2 loaded cores;
the commands that only check their input and exit (usage errors, `config check`, bad stack files) run
``llmd_timeslice.cli:main`` (what the `llmd-timeslice` script calls) here instead. Tests that start a server keep
a real process, and tests/test_cli.py runs the installed entry point as a process once.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import threading
from unittest import mock


class _ThisThread(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` for one call: this thread's writes go to ``buf``, other threads' (servers a
    test left running in this process) to the stream that was there."""

    def __init__(self, buf: io.StringIO, other) -> None:
        self._buf, self._other, self._thread = buf, other, threading.current_thread()

    def _target(self):
        return self._buf if threading.current_thread() is self._thread else self._other

    def write(self, s: str) -> int:
        return self._target().write(s)

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return False  # a pipe, as for a child process


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``llmd-timeslice ARGS``; returns its exit code, stdout and stderr as :func:`subprocess.run` would.

    The process's ``LLMD_TIMESLICE_*`` variables are hidden and ``env`` is added, for the call only. A command that
    would serve (reach the CLI's event-loop runner) raises AssertionError instead of blocking the test.
    """
    import llmd_timeslice.cli as cli

    def refuse(*_a, **_k):
        raise AssertionError(f"`llmd-timeslice {' '.join(args)}` started serving instead of exiting")

    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ))
        for k in [k for k in os.environ if k.startswith("LLMD_TIMESLICE_")]:
            del os.environ[k]
        os.environ.update(env or {})
        stack.enter_context(mock.patch.object(sys, "argv", ["llmd-timeslice", *args]))
        stack.enter_context(mock.patch.object(cli, "_run", refuse))
        stack.enter_context(mock.patch.object(cli, "_run_uvloop", refuse))
        stack.enter_context(contextlib.redirect_stdout(_ThisThread(out, sys.stdout)))
        stack.enter_context(contextlib.redirect_stderr(_ThisThread(err, sys.stderr)))
        try:
            cli.main()
        except SystemExit as exc:
            code = exc.code
    if isinstance(code, str):  # SystemExit("message"): Python prints it and exits 1
        err.write(code + "\n")
        code = 1
    return subprocess.CompletedProcess(["llmd-timeslice", *args], code or 0, out.getvalue(), err.getvalue())
