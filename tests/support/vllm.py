"""The real vLLM CPU server of a test session (tiny Llama built locally, log under test-artifacts/).

One server serves every test that does not need an engine of its own (``vllm_server`` in tests/conftest.py), with
two tiny LoRA adapters beside the base model (:data:`LORA_ADAPTERS`; requests for the base model are unchanged):
it starts on first use (~22 s on 2 cores: two Python processes importing torch and vLLM, with the caches of
llmd_timeslice/engines/vllm_server.py) and stops at the end of the session. Sharing it rests on each test leaving it
as it found it, which :func:`restore_initial_weights` and :meth:`SharedVllm.make_usable` (before each test) see to:

* weights: a test that loads other weights reloads the initial ones and resets the weight version label when done;
* sleep: an engine left asleep by a failed test is woken before the next one;
* life: a test that kills the engine (``@pytest.mark.kills_vllm``) runs after every other test using it (tests/conftest.py
  orders them), and a dead server is started again before the next test that needs it.

Under pytest-xdist every test using it runs in one worker (``xdist_group`` added in tests/conftest.py): one
server per run, and no two tests drive the same engine at once.
"""

from __future__ import annotations

import httpx
import port_for

from tests.support.artifacts import ARTIFACTS

SHARED_GROUP = "vllm-shared"
"""xdist group of the tests using the session's server (tests/conftest.py adds the mark)."""


LORA_ADAPTERS = ("tiny-lora-a", "tiny-lora-b")
"""LoRA adapters the session's server serves besides the base model (``--lora-modules``; built by
:func:`~llmd_timeslice.engines.tiny_model.build_tiny_lora`, seeds 1 and 2). Requests for the base model are unchanged;
measured: the server starts as fast with them (19.6 s to ``/health`` here, against ~22 s without)."""


def lora_args(adapter_dirs: dict[str, str]) -> list[str]:
    """vLLM 0.32 flags serving ``adapter_dirs`` (name -> PEFT directory) beside the base model: ``--enable-lora``,
    ``--max-lora-rank 8`` (the tiny adapters' rank), ``--max-loras`` = their count (every adapter in a slot at once)."""
    return [
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        str(len(adapter_dirs)),
        "--lora-modules",
        *(f"{name}={path}" for name, path in adapter_dirs.items()),
    ]


def _start(log_name: str):
    """The session's server: with :data:`LORA_ADAPTERS` where the engine reloads weights with LoRA enabled (vLLM 0.28
    and later, :func:`~llmd_timeslice.snapshot.backends.vllm_capabilities.reloads_with_lora`); on an older vLLM
    (``make test-vllm-older``) without them, so that its level-2 and weight-loading tests run on that engine: the
    sidecar's refusal with LoRA there is tested on a server of its own (tests/snapshot/test_vllm_capabilities.py)."""
    from llmd_timeslice.engines.tiny_model import build_tiny_llama, build_tiny_lora
    from llmd_timeslice.engines.vllm_server import SERVED_MODEL_NAME, VllmServer, engine_version
    from llmd_timeslice.snapshot.backends.vllm_capabilities import reloads_with_lora

    ARTIFACTS.mkdir(exist_ok=True)
    model = build_tiny_llama(ARTIFACTS / "tiny-llama")
    version = engine_version()
    adapters = {}
    if reloads_with_lora(version):
        adapters = {name: str(build_tiny_lora(model, ARTIFACTS / name, seed=seed)) for seed, name in enumerate(LORA_ADAPTERS, 1)}
    extra = lora_args(adapters) if adapters else []
    server = VllmServer(model, port_for.select_random(), ARTIFACTS / log_name, extra_args=extra)
    server.start(timeout_s=400)
    server.model_name = SERVED_MODEL_NAME
    server.lora_adapters = adapters
    server.engine_version = version
    return server


class SharedVllm:
    """The session's server, started on first use: a started ``VllmServer`` with ``model_name``,
    ``initial_weight_version`` (the label ``GET /weight_info`` reported after the start), ``lora_adapters``
    (:data:`LORA_ADAPTERS` -> their directories; empty on a vLLM before 0.28, see :func:`_start`) and
    ``engine_version`` (the installed vLLM's, e.g. ``"0.32.0"``) set."""

    def __init__(self, log_name: str = "vllm-shared.log") -> None:
        self.log_name = log_name
        self.server = None
        self.starts = 0

    def get(self):
        """The running server: started on first use, or started again (same object and port) after a test killed
        it; ~22 s either way."""
        if self.server is None:
            self.server = _start(self.log_name)
        elif self.server.proc is None or self.server.proc.poll() is not None:
            self.server.stop()  # reaps what is left of the killed one
            self.server.start(timeout_s=400)
        else:
            return self.server
        self.starts += 1
        r = httpx.get(self.server.url + "/weight_info", timeout=30)
        self.server.initial_weight_version = r.json()["weight_version"]
        return self.server

    def make_usable(self) -> None:
        """Before a test: a running, awake engine with its initial weights (a failed test may have left it dead, or
        asleep with other weights)."""
        server = self.get()
        with httpx.Client(base_url=server.url, timeout=60) as c:
            asleep = c.get("/is_sleeping").json().get("is_sleeping")
        if asleep:
            httpx.post(server.url + "/wake_up", timeout=60).raise_for_status()
            restore_initial_weights(server)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def restore_initial_weights(server) -> None:
    """Reload the model directory's own weights into ``server`` and set its weight version label back to the one it
    started with: for a test that loaded other weights into the shared engine. Blocking (call it with
    ``asyncio.to_thread`` from a coroutine)."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(server.model_dir)}})
        r.raise_for_status()
        label = getattr(server, "initial_weight_version", None)
        if label is not None:
            c.post("/update_weight_version", json={"new_version": str(label)}).raise_for_status()
