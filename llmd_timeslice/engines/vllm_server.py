"""Run a real vLLM OpenAI API server (CPU build) as a child process.

Design choice: plain ``subprocess.Popen`` + ``httpx`` polling of ``GET /health``
rather than ``mirakuru``. Reasons:

* the server must run in its *own process group* (vLLM starts an engine-core
  process, and with the ``mp`` executor a worker process); stopping has to signal the group,
  which ``Popen(start_new_session=True)`` + ``os.killpg`` does directly;
* on failure we want the *tail of the vLLM log* in the exception, and we want
  to notice immediately when the child exits during start-up instead of waiting
  for a generic readiness timeout;
* several servers must be started concurrently (:func:`start_many`), which is
  simplest with non-blocking ``Popen`` plus one polling thread per server.

The interpreter is ``<repo>/.venv-vllm/bin/python`` by default (the vLLM CPU
build lives in its own virtual environment), overridable with the environment
variable ``LLMD_TIMESLICE_VLLM_PYTHON`` or the ``python`` argument. The server
is started as ``python -m vllm.entrypoints.openai.api_server``.

Environment given to the server (on top of the caller's environment):

* ``VLLM_SERVER_DEV_MODE=1`` – exposes ``/sleep``, ``/wake_up``,
  ``/is_sleeping`` (on CPU, sleep pauses the scheduler; weights stay resident).
* ``VLLM_CPU_KVCACHE_SPACE=1`` – 1 GiB KV cache instead of an auto-sized one.
  Together with ``--enforce-eager`` this also lets vLLM skip its warm-up pass.
* ``VLLM_CPU_OMP_THREADS_BIND=nobind`` – vLLM's default ``auto`` pins the
  worker's OpenMP threads to fixed cores; with several servers on a 2-core box
  they would all pin to the same core.
* ``OMP_NUM_THREADS=1`` – avoids OpenMP oversubscription between servers.
* ``VLLM_LOGGING_LEVEL=INFO``, ``PYTHONUNBUFFERED=1`` – usable logs.
* ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``, ``VLLM_NO_USAGE_STATS=1``,
  ``DO_NOT_TRACK=1`` – no network access is attempted.
* ``TMPDIR``, ``VLLM_RPC_BASE_PATH`` → a private runtime directory
  (``tempfile.mkdtemp(prefix="vllm-<port>-")``) removed by :meth:`VllmServer.stop`.
  vLLM otherwise leaves ZMQ IPC sockets and ``vllm_dist_*`` files in ``/tmp``
  after every run.
* ``VLLM_CACHE_ROOT`` → :func:`vllm_cache_root`: ``vllm-cache/`` inside the
  vLLM virtual environment, kept between runs. It holds vLLM's model-class
  inspection cache (``modelinfos/``, vllm/model_executor/models/registry.py,
  keyed by the hash of the model module's source): on a miss vLLM inspects the
  class in a fresh Python process that imports vLLM again, on every start. A
  private cache would miss on every start. ``make setup`` fills it once
  (:func:`warm_caches`).
* ``TORCHINDUCTOR_CACHE_DIR`` → ``<that cache>/inductor`` (the private runtime
  directory when there is none). Even with ``--enforce-eager``, vLLM compiles one
  function with torch.compile the first time a request asks for logprobs
  (``batched_count_greater_than``, vllm/v1/sample/ops/logprobs.py); on CPU that
  runs the C++ compiler, on every start with a private cache. Kept, the compiled
  kernel is reused by later starts (that first request then only traces and
  loads it). ``make setup`` compiles it once (:func:`warm_caches`).
* ``TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0`` – torch keeps precompiled
  headers under the temporary directory (``tempfile.gettempdir()``, the private
  runtime directory here), not under ``TORCHINDUCTOR_CACHE_DIR``, so every start
  preprocessed and compiled the header again even on a cache hit.

With a :func:`vllm_cache_root`, both cache variables are set even when the
environment has them: torch writes ``TORCHINDUCTOR_CACHE_DIR`` into the
environment of any process that compiled something (its ``/tmp`` default,
torch/_inductor/runtime/cache_dir_utils.py), and a process that built the tiny
model has. ``$LLMD_TIMESLICE_VLLM_CACHE_ROOT`` or ``extra`` (a stack file's
``vllm.env``) choose other directories.

With the CPU defaults (``default_args``), also ``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
the engine core then runs the model in its own process (vLLM's ``uni`` executor,
the default for a one-GPU engine: vllm/config/parallel.py) instead of in one
more spawned worker process. The CPU platform switches one-device engines to the
``mp`` executor only so that it can set up OpenMP thread binding in the worker
(vllm/platforms/cpu.py, ``check_and_update_config``); with ``nobind`` and one
OpenMP thread there is nothing to set up. One Python process fewer importing
torch and vLLM.
The variable affects only the executor choice and vLLM's offline ``LLM`` class,
which the API server does not use. The engine's endpoints (sleep, wake-up tags,
pause, ``collective_rpc``) reach the same worker code either way.

``--enable-sleep-mode`` is deliberately not passed: the CPU platform rejects it.
On CPU, ``POST /sleep`` only pauses the scheduler (the CPU worker logs "sleep
mode is not supported on CPU, ignore it."); memory is not released.

What each choice saves in a start, and how long a start takes: docs/decisions/make-test-layout.md and
docs/benchmarks.md#code-figures.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Self

import httpx

#: Repository root (``<repo>/llmd_timeslice/engines/vllm_server.py`` → ``<repo>``).
REPO_ROOT = Path(__file__).resolve().parents[2]
#: Environment variable overriding the interpreter that runs vLLM.
PYTHON_ENV_VAR = "LLMD_TIMESLICE_VLLM_PYTHON"
#: Name under which the model is served (``"model"`` field of API requests).
SERVED_MODEL_NAME = "tiny"

#: Default CLI flags. ``--max-model-len 512`` matches the tiny model;
#: ``--max-num-seqs 8`` and ``--max-num-batched-tokens 512`` keep scheduler
#: buffers small; ``--enforce-eager`` skips torch.compile/inductor and, with a
#: fixed KV-cache size, the warm-up pass (about half the start-up on CPU:
#: docs/benchmarks.md#code-figures); ``--dtype float32`` matches the checkpoint (``auto``
#: logs "Downcasting torch.float32 to torch.bfloat16" on x86 CPUs; bfloat16
#: also works, float32 just avoids the conversion).
#: Override any of them through ``extra_args`` (``--no-enforce-eager`` exists).
DEFAULT_ARGS: tuple[str, ...] = (
    "--served-model-name",
    SERVED_MODEL_NAME,
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "512",
    "--dtype",
    "float32",
    "--enforce-eager",
)

_SERVER_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
}


#: Added with the CPU defaults (module doc): the ``uni`` executor, no separate worker process.
_CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
#: Environment variable overriding :func:`vllm_cache_root`.
CACHE_ENV_VAR = "LLMD_TIMESLICE_VLLM_CACHE_ROOT"


def default_python() -> str:
    """Interpreter for vLLM: ``$LLMD_TIMESLICE_VLLM_PYTHON`` or ``<repo>/.venv-vllm/bin/python``.

    The venv path is returned unresolved: resolving the ``bin/python`` symlink
    would escape the virtual environment.
    """
    return os.environ.get(PYTHON_ENV_VAR) or str(REPO_ROOT / ".venv-vllm" / "bin" / "python")


def engine_version(python: str | None = None) -> str | None:
    """The vLLM version installed for the interpreter ``python`` (:func:`default_python` when None), e.g. ``"0.27.0"``:
    the version of the distribution that provides the ``vllm`` package (``vllm-cpu`` or ``vllm``), read from its
    metadata in a child process (vLLM is not imported). None when the interpreter has no vLLM or cannot run.
    """
    code = "import importlib.metadata as m\nd = m.packages_distributions().get('vllm') or []\nprint(m.version(d[0]) if d else '')"
    try:
        out = subprocess.run(
            [python or default_python(), "-c", code], capture_output=True, text=True, timeout=60, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def vllm_cache_root(python: str) -> Path | None:
    """vLLM's cache directory (``VLLM_CACHE_ROOT``) for the interpreter ``python``.

    ``$LLMD_TIMESLICE_VLLM_CACHE_ROOT`` if set; else ``<venv>/vllm-cache`` when ``python`` is
    ``<venv>/bin/python`` of a virtual environment (a ``pyvenv.cfg`` beside ``bin/``: the cache then lives and dies
    with that vLLM install); else ``None`` (vLLM's own default, ``~/.cache/vllm``).
    """
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR])
    venv = Path(python).parent.parent
    return venv / "vllm-cache" if (venv / "pyvenv.cfg").is_file() else None


def _tail(path: Path, max_bytes: int = 8000) -> str:
    """Last ``max_bytes`` bytes of ``path`` decoded as text ('' if unreadable)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - max_bytes))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


class VllmServer:
    """One vLLM OpenAI-compatible server bound to ``host:port`` (default ``127.0.0.1``).

    Args:
        model_dir: Hugging Face model directory (e.g. from ``build_tiny_llama``).
        port: TCP port to listen on.
        log_path: file receiving the server's stdout+stderr (appended to).
        python: interpreter with vLLM installed; ``None`` → :func:`default_python`.
        extra_args: extra CLI flags appended after :data:`DEFAULT_ARGS` (later
            flags win in argparse, so they can override the defaults).
        default_args: False: only ``--served-model-name`` before ``extra_args`` (e.g. on a GPU, where
            the CPU-sized defaults do not fit).
        host: bind address (a stack across nodes binds each engine to its node's own address).

    Usable as a context manager: ``with VllmServer(...) as s:`` starts the
    server (default timeout) and always stops it on exit.
    """

    def __init__(
        self,
        model_dir: Path,
        port: int,
        log_path: Path,
        python: str | None = None,
        extra_args: Sequence[str] = (),
        default_args: bool = True,
        host: str = "127.0.0.1",
    ) -> None:
        self.host = host
        self.model_dir = Path(model_dir)
        self.port = int(port)
        self.log_path = Path(log_path)
        self.python = python or default_python()
        self.extra_args = list(extra_args)
        self.default_args = default_args
        self.proc: subprocess.Popen[bytes] | None = None
        #: Private TMPDIR/cache directory of the running server (see module doc).
        self.runtime_dir: Path | None = None
        #: Seconds from spawn until ``/health`` answered 200 (set by ``start``).
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        """Base URL without trailing slash, e.g. ``http://127.0.0.1:8000``."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """PID of the API-server process (also its process-group id)."""
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        """Full argv used to launch the server."""
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--host",
            self.host,
            "--port",
            str(self.port),
            *(DEFAULT_ARGS if self.default_args else ("--served-model-name", SERVED_MODEL_NAME)),
            *self.extra_args,
        ]

    def environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The server's environment (module doc); creates its private runtime directory (``runtime_dir``)."""
        self.runtime_dir = Path(tempfile.mkdtemp(prefix=f"vllm-{self.port}-"))
        env = {**os.environ, **_SERVER_ENV, **(_CPU_ENV if self.default_args else {})}
        env["TMPDIR"] = env["VLLM_RPC_BASE_PATH"] = str(self.runtime_dir)
        cache_root = vllm_cache_root(self.python)
        if cache_root is not None:
            env["VLLM_CACHE_ROOT"] = str(cache_root)
            env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root / "inductor")
        else:
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(self.runtime_dir / "inductor"))
        env.update(extra or {})
        return env

    def spawn(self) -> None:
        """Launch the process without waiting for readiness (no-op if running)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"no model directory (config.json) at {self.model_dir}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = self.environment()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group → killpg in stop()
            )
        self._spawned_at = time.monotonic()

    def wait_ready(self, timeout_s: float = 300) -> None:
        """Poll ``GET /health`` every 0.5 s until it returns 200.

        Raises:
            RuntimeError: the process exited, or ``timeout_s`` seconds elapsed;
                the message contains the tail of the log. On timeout the server
                is stopped before raising.
        """
        proc = self.proc
        if proc is None:
            raise RuntimeError("VllmServer.wait_ready() called before spawn()")
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self.proc is not proc:
                    raise RuntimeError(f"vLLM server on port {self.port} was stopped during start-up")
                rc = proc.poll()
                if rc is not None:
                    raise RuntimeError(
                        f"vLLM server on port {self.port} exited with code {rc} during "
                        f"start-up; log {self.log_path} ends with:\n{_tail(self.log_path)}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        self.startup_s = time.monotonic() - self._spawned_at
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"vLLM server on port {self.port} not healthy after {timeout_s:.0f} s; "
                        f"log {self.log_path} ends with:\n{_tail(self.log_path)}"
                    )
                time.sleep(0.5)

    def start(self, timeout_s: float = 300) -> Self:
        """Spawn the server and block until ``/health`` is 200 (how long: docs/benchmarks.md#code-figures).

        Raises:
            FileNotFoundError: ``model_dir`` has no ``config.json``.
            RuntimeError: see :meth:`wait_ready`.
        """
        self.spawn()
        self.wait_ready(timeout_s)
        return self

    def stop(self, grace_s: float = 15) -> None:
        """SIGTERM the whole process group, SIGKILL it after ``grace_s`` seconds.

        Idempotent. Also reaps the API-server process and removes the runtime
        directory. Measured: 1.5-2.5 s for an idle server (SIGTERM suffices).
        """
        proc, self.proc = self.proc, None
        if proc is None:
            self.remove_runtime_dir()
            return
        pgid = proc.pid  # start_new_session=True → pgid == pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(pgid):
                break
            time.sleep(0.1)
        else:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.remove_runtime_dir()

    def remove_runtime_dir(self) -> None:
        """Remove the private runtime directory of the last :meth:`environment` (no-op without one): once the
        server's process group is gone (:meth:`stop` calls it; ``llmd-timeslice up`` after each exit of the server)."""
        runtime_dir, self.runtime_dir = self.runtime_dir, None
        if runtime_dir is not None:
            shutil.rmtree(runtime_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"VllmServer(model_dir={str(self.model_dir)!r}, port={self.port}, pid={self.pid})"


def _group_alive(pgid: int) -> bool:
    """True while any process is left in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_many(servers: Iterable[VllmServer], timeout_s: float = 300) -> list[VllmServer]:
    """Start several servers concurrently and wait until all are healthy.

    All processes are spawned first, then readiness is awaited in parallel, so
    total wall time ≈ the slowest single start-up rather than the sum. If any
    server fails, every server in ``servers`` is stopped and the first error is
    re-raised.
    """
    servers = list(servers)
    pool = ThreadPoolExecutor(max_workers=max(1, len(servers)))
    try:
        for server in servers:
            server.spawn()
        futures = [pool.submit(s.wait_ready, timeout_s) for s in servers]
        for future in as_completed(futures):
            future.result()  # first failure raises here
    except BaseException:
        for server in servers:
            server.stop()  # makes the other wait_ready() calls return promptly
        raise
    finally:
        pool.shutdown(wait=True)
    return servers


def warm_caches(python: str | None = None, timeout_s: float = 400) -> Path | None:
    """Fill the kept vLLM caches (module doc: model-class inspection, the logprobs kernel) once, e.g. at set-up:
    starts one server on the tiny Llama and asks for one completion with logprobs (docs/benchmarks.md#code-figures).

    Returns the cache directory, or ``None`` (nothing started) when :func:`vllm_cache_root` has none to fill.

    Raises:
        RuntimeError: the server did not start (the tail of its log is in the message), or the completion failed.
    """
    import port_for

    from llmd_timeslice.engines.tiny_model import build_tiny_llama

    python = python or default_python()
    root = vllm_cache_root(python)
    if root is None:
        return None
    with tempfile.TemporaryDirectory(prefix="llmd-timeslice-warm-") as tmp:
        model = build_tiny_llama(Path(tmp) / "tiny-llama")
        server = VllmServer(model, port_for.select_random(), Path(tmp) / "vllm.log", python=python)
        try:
            server.start(timeout_s)
            body = {"model": SERVED_MODEL_NAME, "prompt": "warm", "max_tokens": 2, "logprobs": 0}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=timeout_s)
            if r.status_code != 200:
                raise RuntimeError(f"warm-up completion answered {r.status_code}: {r.text[:500]}")
        finally:
            server.stop()
    return root


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m llmd_timeslice.engines.vllm_server",
        description="Fill the vLLM caches that later server starts reuse (run by `make setup`).",
    )
    ap.add_argument("--warm-caches", action="store_true", required=True, help="start one tiny server, ask once, stop")
    ap.parse_args()
    print(f"vLLM caches filled in {warm_caches()}")
