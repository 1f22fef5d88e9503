"""One real vLLM CPU server for a test module (tiny Llama built locally, log under test-artifacts/)."""

from __future__ import annotations

from collections.abc import Iterator

import port_for

from tests.conftest import ARTIFACTS


def running_vllm(log_name: str) -> Iterator:
    """Generator for a module-scoped fixture: yields a started ``VllmServer`` with ``model_name`` set."""
    from llmd_timeslice.demo.tiny_model import build_tiny_llama
    from llmd_timeslice.demo.vllm_server import SERVED_MODEL_NAME, VllmServer

    ARTIFACTS.mkdir(exist_ok=True)
    model = build_tiny_llama(ARTIFACTS / "tiny-llama")
    server = VllmServer(model, port_for.select_random(), ARTIFACTS / log_name)
    server.start(timeout_s=400)
    server.model_name = SERVED_MODEL_NAME
    try:
        yield server
    finally:
        server.stop()
