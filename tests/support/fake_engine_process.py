"""A :class:`~tests.support.fake_engines.FakeVllm` in a process of its own, so a test can kill it with SIGKILL as a
dying engine is killed (the kernel then refuses new connections and resets the open ones).

``python -m tests.support.fake_engine_process PORT [COMPLETION_DELAY_S [HOST]]`` serves until killed; :class:`FakeVllmProcess`
starts it on a free loopback port and waits until it answers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import port_for

REPO = Path(__file__).resolve().parents[2]


class FakeVllmProcess:
    """``FakeVllm`` in a child process on a free loopback port; ``kill()`` sends SIGKILL."""

    def __init__(self, completion_delay_s: float = 0.0) -> None:
        self.port = port_for.select_random()
        self.completion_delay_s = completion_delay_s
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def start(self, timeout_s: float = 10.0) -> FakeVllmProcess:
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.fake_engine_process", str(self.port), str(self.completion_delay_s)],
            env=env,
            cwd=REPO,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake engine on port {self.port} exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"fake engine on port {self.port} did not answer within {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL, then reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    stop = kill


def main(argv: list[str]) -> None:
    from tests.support.fake_engines import FakeVllm

    engine = FakeVllm(port=int(argv[0]), host=argv[2] if len(argv) > 2 else "127.0.0.1")
    if len(argv) > 1:
        engine.completion_delay_s = float(argv[1])
    engine.start()
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1:])
