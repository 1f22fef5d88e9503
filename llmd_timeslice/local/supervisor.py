"""Child processes of ``llmd-timeslice up``: started in stages, probed until ready, restarted with back-off.

Each child runs in its own process group (``start_new_session``), so stopping it (SIGTERM, then SIGKILL
after ``stop_grace_s``) also stops what it spawned (vLLM's engine-core and worker processes). On Linux each
child also gets SIGTERM from the kernel if the supervisor itself dies, even by SIGKILL
(``prctl(PR_SET_PDEATHSIG)``), so a killed ``up`` leaves no orphans running. A child
that exits while the stack runs is logged, marked ``backoff`` and started again after 1, 2, 4 ... 30 s
(tenacity; the delay resets once it stayed up for ``healthy_reset_s``).

Ready means the probe answers *and* every port the child binds (``ChildSpec.listen``) has a listening
socket in the child's own process group and none outside it: on a shared node a probe may reach another
stack's server on the same port. A start that cannot succeed by retrying (a port held by another
process, exit code 2: a usage error such as a bad flag), or ``max_start_failures`` failed starts in a
row, is final: the child is marked ``failed`` and ``on_fatal`` is called instead of restarting forever.

Why not supervisord or circus: they are daemons with their own configuration files and control
sockets; here the stack needs in-process knowledge of each child (its readiness probe, its stage in
the start order, its restarts) to render the status table and the stack state file. See
docs/decisions/up-supervises-children.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential

from llmd_timeslice.local.ports import split_listeners

log = logging.getLogger(__name__)

Probe = Callable[[], Awaitable[bool]]


@dataclass
class ChildSpec:
    """How to run one component. ``probe`` answers True once it serves (None: still running after
    ``settle_s`` seconds is ready)."""

    name: str
    argv: list[str]
    log_path: Path
    port: int | None = None
    env: dict[str, str] | None = None
    probe: Probe | None = None
    start_timeout_s: float = 60.0
    stop_grace_s: float = 10.0
    settle_s: float = 1.0
    env_factory: Callable[[], dict[str, str]] | None = None
    """Called before each start (e.g. a fresh vLLM runtime directory); wins over ``env``."""
    listen: tuple[int, ...] = ()
    """TCP ports the child binds: it is ready only once each has a listener in its process group and none
    outside it."""
    after_exit: Callable[[], None] | None = None
    """Called each time the child's process group is gone (after a stop, after an exit before the restart): e.g.
    removing a vLLM server's private runtime directory."""


@dataclass(eq=False)
class Child:
    spec: ChildSpec
    state: str = "pending"  # pending | starting | ready | backoff | stopping | stopped | failed
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: float = 0.0
    last_exit: str = ""
    ready_event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    def to_json(self) -> dict:
        return {
            "name": self.spec.name,
            "state": self.state,
            "pid": self.pid,
            "port": self.spec.port,
            "restarts": self.restarts,
            "uptime_s": round(time.monotonic() - self.started_at, 1) if self.pid else 0.0,
            "last_exit": self.last_exit,
            "log": str(self.spec.log_path),
        }


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """``prctl(PR_SET_PDEATHSIG, SIGTERM)`` where libc has it (Linux); a no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


PROBE_EVERY_S = 0.2
"""Seconds between two readiness probes of a starting child, once it has started for :data:`PROBE_FAST_FOR_S`."""
PROBE_FAST_EVERY_S = 0.05
"""Seconds between two probes during a child's first :data:`PROBE_FAST_FOR_S`: our components are ready within a
second or two, and each stage waits for its slowest child's probe, so a long interval is wait added to every start."""
PROBE_FAST_FOR_S = 3.0


def probe_interval(starting_for_s: float) -> float:
    """Seconds to the next readiness probe of a child that has been starting for ``starting_for_s`` seconds."""
    return PROBE_FAST_EVERY_S if starting_for_s < PROBE_FAST_FOR_S else PROBE_EVERY_S


USAGE_ERROR_EXIT = 2
"""Exit code of a usage error (a bad flag or setting: click, argparse and ``llmd-timeslice`` itself)."""


class _Exited(Exception):
    """A child's process ended early while the stack ran (what the restarts retry)."""


class StartFailed(Exception):
    """A child did not become ready; the message names it, says why and where its log is.
    ``permanent``: starting it again cannot help (a port held by another process, a usage error)."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


class Supervisor:
    """Starts children stage by stage, keeps them running, stops them in reverse order.

    Args:
        stages: lists of children; a stage starts once every child of the previous one is ready.
        max_backoff_s: longest delay before a restart, in seconds.
        healthy_reset_s: a child up this many seconds gets its back-off reset.
        on_event: called with (child name, message) for starts, exits and restarts.
        backoff_s: first delay before a restart, in seconds (doubles up to ``max_backoff_s``).
        max_start_failures: failed restarts in a row after which a child is given up.
        on_fatal: called once when a child is given up after the start (a permanent failure or
            ``max_start_failures``), with the :class:`StartFailed` that says why.
    """

    def __init__(
        self,
        stages: list[list[ChildSpec]],
        max_backoff_s: float = 30.0,
        healthy_reset_s: float = 60.0,
        on_event: Callable[[str, str], None] | None = None,
        backoff_s: float = 1.0,
        max_start_failures: int = 5,
        on_fatal: Callable[[StartFailed], None] | None = None,
    ) -> None:
        self.stages = [[Child(s) for s in stage] for stage in stages]
        self.children = [c for stage in self.stages for c in stage]
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.healthy_reset_s = healthy_reset_s
        self.max_start_failures = max_start_failures
        self.on_event = on_event or (lambda name, msg: log.info("component=%s %s", name, msg))
        self.on_fatal = on_fatal or (lambda exc: None)
        self.fatal: StartFailed | None = None
        """Set when a child failed for good after the start (see ``on_fatal``)."""
        self.stopping = False
        self._watchers: list[asyncio.Task] = []

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.spec.name == name)

    async def _spawn(self, c: Child) -> None:
        spec = c.spec
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = spec.env_factory() if spec.env_factory else ({**os.environ, **spec.env} if spec.env else None)
        with open(spec.log_path, "ab") as logf:
            logf.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} start #{c.restarts + 1}: {' '.join(spec.argv)}\n".encode())
            logf.flush()
            c.proc = await asyncio.create_subprocess_exec(
                *spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logf,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        c.started_at = time.monotonic()
        c.state = "starting"

    async def _wait_ready(self, c: Child) -> None:
        if c.proc is None or c.proc.returncode is not None:
            raise await self._exit_failure(c)
        # The child's exit ends a probe in flight: a probe that hangs (e.g. on another process's socket listening on
        # the child's port, which never answers) would otherwise hold the exit's report back by its own timeout.
        exited = asyncio.ensure_future(c.proc.wait())
        try:
            await self._probe_until_ready(c, exited)
        finally:
            exited.cancel()

    async def _probe_until_ready(self, c: Child, exited: asyncio.Future) -> None:
        spec = c.spec
        deadline = time.monotonic() + spec.start_timeout_s
        while True:
            if c.proc is None or c.proc.returncode is not None or exited.done():
                raise await self._exit_failure(c)
            if spec.probe is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(exited), spec.settle_s)
                if c.proc.returncode is None and await self._owns_ports(c):
                    c.state = "ready"
                    c.ready_event.set()
                    return
                continue
            probe = asyncio.ensure_future(spec.probe())
            try:
                await asyncio.wait({probe, exited}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not probe.done():  # the child exited meanwhile (the loop's top says why), or this wait was cancelled
                    probe.cancel()
                    await asyncio.wait({probe})
            if exited.done():
                continue
            answered = not probe.cancelled() and probe.exception() is None and probe.result()
            if answered and await self._owns_ports(c):
                c.state = "ready"
                c.ready_event.set()
                return
            if time.monotonic() > deadline:
                raise StartFailed(
                    f"{spec.name} was not ready within {spec.start_timeout_s:g} s; last lines of "
                    f"{spec.log_path}:\n{_tail(spec.log_path)}"
                )
            await asyncio.sleep(probe_interval(time.monotonic() - c.started_at))

    async def _owns_ports(self, c: Child) -> bool:
        """True when each of the child's ports has a listener in its process group; raises a permanent
        StartFailed when another process listens on one (what answered the probe may be that process)."""
        if not c.spec.listen or c.proc is None:
            return True
        try:
            ours, foreign = await asyncio.to_thread(split_listeners, c.spec.listen, c.proc.pid)
        except psutil.Error as exc:  # sockets hidden from this user (not Linux): the probe is all we know
            log.debug("component=%s cannot list listening sockets (%s); trusting the probe", c.spec.name, exc)
            return True
        if foreign:
            raise StartFailed(self._port_message(c, foreign), permanent=True)
        return set(c.spec.listen) <= ours

    @staticmethod
    def _port_message(c: Child, foreign: dict) -> str:
        port, holders = next(iter(foreign.items()))
        pid = c.proc.pid if c.proc is not None else None
        return (
            f"{c.spec.name}: port {port} is held by {', '.join(h.describe() for h in holders)}, not by the "
            f"{c.spec.name} this stack started (pid {pid}); another stack on the same ports? Last lines of "
            f"{c.spec.log_path}:\n{_tail(c.spec.log_path)}"
        )

    async def _exit_failure(self, c: Child) -> StartFailed:
        """Why a child exited while starting; permanent when a restart cannot help."""
        spec = c.spec
        rc = c.proc.returncode if c.proc is not None else None
        if spec.listen:
            with contextlib.suppress(psutil.Error):
                _, foreign = await asyncio.to_thread(split_listeners, spec.listen, c.proc.pid if c.proc else -1)
                if foreign:
                    return StartFailed(self._port_message(c, foreign), permanent=True)
        if rc == USAGE_ERROR_EXIT:
            return StartFailed(
                f"{spec.name} exited with code {rc} while starting (a usage error: a bad flag or "
                f"setting; starting it again cannot help); last lines of {spec.log_path}:\n"
                f"{_tail(spec.log_path)}",
                permanent=True,
            )
        return StartFailed(
            f"{spec.name} exited with code {rc} while starting; last lines of {spec.log_path}:\n{_tail(spec.log_path)}"
        )

    async def start(
        self,
        progress: Callable[[str], None] = lambda msg: None,
        on_stage_ready: Callable[[list[str]], None] = lambda names: None,
    ) -> None:
        """Start every stage in order and begin watching; ``on_stage_ready`` gets the names of each stage once all
        of its children are ready. Raises StartFailed (everything started is stopped)."""
        try:
            for stage in self.stages:
                progress("starting " + ", ".join(c.spec.name for c in stage))
                for c in stage:
                    await self._spawn(c)
                await asyncio.gather(*(self._wait_ready(c) for c in stage))
                for c in stage:
                    self.on_event(c.spec.name, f"ready (pid {c.pid})")
                    self._watchers.append(asyncio.get_running_loop().create_task(self._watch(c)))
                on_stage_ready([c.spec.name for c in stage])
        except BaseException:
            await self.stop()
            raise

    async def _watch(self, c: Child) -> None:
        """Keep ``c`` running. Each end of its process is retried by tenacity: a restart after a wait that doubles
        from ``backoff_s`` to ``max_backoff_s``, the count starting over after a run of ``healthy_reset_s``. Failed
        restarts count too; one that cannot succeed, or ``max_start_failures`` in a row, give the child up."""
        failed = 0  # failed restarts in a row

        async def run_once() -> None:
            """(Re)start the child if its process is gone, then wait for it to end; raises :class:`_Exited` when
            that was early (retried), returns after a long run (the waits start over) or when stopping."""
            nonlocal failed
            if self.stopping:
                return
            if c.proc is None or c.proc.returncode is not None:
                c.restarts += 1
                try:
                    await self._spawn(c)
                    await self._wait_ready(c)
                except StartFailed as exc:
                    failed += 1
                    with contextlib.suppress(ProcessLookupError):
                        await self._kill_group(c, 0.0)
                    c.last_exit = f"start failed: {str(exc).splitlines()[0]}"
                    c.state = "backoff"
                    raise
                failed = 0
                self.on_event(c.spec.name, f"restarted (pid {c.pid}, restart #{c.restarts})")
            assert c.proc is not None
            rc = await c.proc.wait()
            if self.stopping:
                return
            up = time.monotonic() - c.started_at
            c.last_exit = f"exit code {rc}" if rc >= 0 else f"signal {signal.Signals(-rc).name}"
            c.state = "backoff"
            c.ready_event.clear()
            await self._kill_group(c, 0.0)  # whatever it left behind in its process group
            if up < self.healthy_reset_s:
                raise _Exited(f"exited ({c.last_exit}) after {up:.0f} s")
            self.on_event(c.spec.name, f"exited ({c.last_exit}) after {up:.0f} s; restarting in {self.backoff_s:g} s")

        def retryable(exc: BaseException) -> bool:
            return not self.stopping and (isinstance(exc, _Exited) or (isinstance(exc, StartFailed) and not exc.permanent))

        def announce(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            wait_s = state.next_action.sleep if state.next_action is not None else 0.0
            what = f"restart failed: {str(exc).splitlines()[0]}" if isinstance(exc, StartFailed) else str(exc)
            self.on_event(c.spec.name, f"{what}; restarting in {wait_s:g} s")

        retrying = AsyncRetrying(
            retry=retry_if_exception(retryable),
            reraise=True,
            stop=lambda state: failed >= self.max_start_failures,
            wait=wait_exponential(multiplier=self.backoff_s, max=self.max_backoff_s),
            before_sleep=announce,
        )
        while not self.stopping:
            try:
                await retrying(run_once)
            except _Exited:
                return  # stopping meanwhile
            except StartFailed as exc:
                first = str(exc).splitlines()[0]
                if not exc.permanent:
                    exc = StartFailed(
                        f"{c.spec.name} failed to start {failed} times in a row; giving up. Last: {exc}", permanent=True
                    )
                c.state = "failed"
                self.on_event(c.spec.name, f"failed for good, not restarting: {first}")
                if self.fatal is None:
                    self.fatal = exc
                    self.on_fatal(exc)
                return
            if not self.stopping:
                await asyncio.sleep(self.backoff_s)  # after a long run: the first wait again

    async def _kill_group(self, c: Child, grace_s: float) -> None:
        proc = c.proc
        if proc is None:
            return
        pgid = proc.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)  # the group: vLLM's engine-core and workers too
        with contextlib.suppress(ProcessLookupError):
            await proc.wait()
        if c.spec.after_exit is not None:
            try:
                c.spec.after_exit()
            except Exception:  # a clean-up that fails must not stop the stop or the restart
                log.exception("component=%s clean-up after its exit failed", c.spec.name)

    async def stop_child(self, name: str) -> None:
        """Stop one child now (SIGTERM, grace, SIGKILL), without restarting it."""
        c = self.child(name)
        c.state = "stopping"
        await self._kill_group(c, c.spec.stop_grace_s)
        c.state = "stopped"

    async def stop(self, order: list[str] | None = None) -> None:
        """Stop every child: those named in ``order`` first (one after another), then the rest in reverse
        start order, stage by stage (each stage in parallel)."""
        self.stopping = True
        for t in self._watchers:
            t.cancel()
        done: set[str] = set()
        for name in order or []:
            await self.stop_child(name)
            done.add(name)
        for stage in reversed(self.stages):
            left = [c for c in stage if c.spec.name not in done and c.proc is not None]
            await asyncio.gather(*(self.stop_child(c.spec.name) for c in left))
        for c in self.children:
            if c.state == "pending":
                c.state = "stopped"

    def snapshot(self) -> list[dict]:
        return [c.to_json() for c in self.children]
