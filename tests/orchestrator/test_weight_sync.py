"""Weight versions through the real gRPC path (client -> orchestrator -> sidecar -> engine HTTP), with a
vLLM HTTP look-alike: publish, load during the switch back, SERVING at the version on the gate, failures
kept out of service and told to the publisher, per-job sleep level. The proof against real vLLM is in
tests/snapshot/test_vllm_weight_sync.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import types

import grpc
import pytest

from epp_plugin.gate.pool_state import EndpointState
from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2_grpc as xpb_grpc
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import weights_pb2
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as spb
from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient, LeaseError, TimeSliceOrchestratorClient
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.phases import GroupPhase
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.snapshot.backends.base import BackendError, SuspendMode
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.backends.vllm_weights import WeightTransferLoader
from llmd_timeslice.snapshot.server import SidecarServer
from llmd_timeslice.weights.manifest import MANIFEST_NAME, WeightManifestError, save_weight_version, verify_weights
from llmd_timeslice.weights.update import InvalidWeightUpdate, WeightUpdate
from tests.support.fake_engines import FakeSglang, FakeVllm
from tests.support.one_sampler import one_sampler
from tests.support.waits import until as _until
from tests.support.weight_status import weight_status_when

pytestmark = pytest.mark.torch  # in the xdist worker that imports torch (tests/conftest.py)

TOKEN = "t"


def _weights(root, version: int, seed: int = 0) -> WeightUpdate:
    import torch  # here, not at the top: ~2 s of CPU in every pytest-xdist worker's collection

    g = torch.Generator().manual_seed(seed + version)
    return save_weight_version({"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}, root, version)


# ----------------------------------------------------------------------------------------------- manifest
def test_saved_version_verifies_and_reports_its_bytes(tmp_path):
    update = _weights(tmp_path, 3)
    assert update == WeightUpdate(3, "files", str(tmp_path / "v3"))
    assert verify_weights(update.location, 3) > 64 * 64 * 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary directory is left"
    with pytest.raises(FileExistsError):
        _weights(tmp_path, 3)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("flip_byte", "does not match its xxh3_128"),
        ("flip_header_byte", "is not a readable safetensors file"),
        ("truncate", "the manifest says"),
        ("delete_file", "missing"),
        ("delete_manifest", "weights-manifest.json does not exist"),
        ("bad_manifest_json", "cannot be read"),
        ("wrong_version", "is version 1, the update says 2"),
    ],
)
def test_damaged_weight_directory_is_refused_naming_the_problem(tmp_path, damage, message):
    d = tmp_path / "v1"
    _weights(tmp_path, 1)
    f = d / "model.safetensors"
    expect_version = 1
    if damage == "flip_byte":
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0xFF
        f.write_bytes(bytes(raw))
    elif damage == "flip_header_byte":  # same size, the JSON header damaged: caught before any hashing
        raw = bytearray(f.read_bytes())
        raw[9] ^= 0xFF
        f.write_bytes(bytes(raw))
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:-10])
    elif damage == "delete_file":
        f.unlink()
    elif damage == "delete_manifest":
        (d / MANIFEST_NAME).unlink()
    elif damage == "bad_manifest_json":
        (d / MANIFEST_NAME).write_text("{not json")
    elif damage == "wrong_version":
        expect_version = 2
    with pytest.raises(WeightManifestError, match=message):
        verify_weights(d, expect_version)


def test_a_version_with_a_sha256_manifest_still_verifies_and_its_damage_is_caught(tmp_path):
    """Versions published before the manifest moved to XXH3-128 name sha256: they verify as before."""
    import json

    from llmd_timeslice.weights.manifest import write_manifest

    d = tmp_path / "v1"
    _weights(tmp_path, 1)
    write_manifest(d, 1, algorithm="sha256")
    entry = json.loads((d / MANIFEST_NAME).read_text())["files"]["model.safetensors"]
    assert set(entry) == {"bytes", "sha256"}
    assert verify_weights(d, 1) == entry["bytes"]
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[-1] ^= 0x01
    (d / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(WeightManifestError, match="does not match its sha256"):
        verify_weights(d, 1)


def test_manifest_with_an_unknown_checksum_algorithm_is_refused(tmp_path):
    import json

    d = tmp_path / "v1"
    _weights(tmp_path, 1)
    m = json.loads((d / MANIFEST_NAME).read_text())
    m["algorithm"] = "md5"
    (d / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(WeightManifestError, match="unsupported checksum algorithm 'md5'"):
        verify_weights(d, 1)


def test_missing_weight_directory_is_refused(tmp_path):
    with pytest.raises(WeightManifestError, match="does not exist"):
        verify_weights(tmp_path / "nowhere", 1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"version": 0, "location": "/w"}, "weight version must be"),
        ({"version": -4, "location": "/w"}, "weight version must be"),
        ({"version": True, "location": "/w"}, "weight version must be"),
        ({"version": 1, "source": "s3", "location": "/w"}, "unknown weight source 's3'"),
        ({"version": 1, "source": "files"}, "needs a location"),
        ({"version": 1, "source": "vllm_weight_transfer"}, "needs update_info"),
    ],
)
def test_malformed_weight_update_is_refused(kwargs, message):
    with pytest.raises(InvalidWeightUpdate, match=message):
        WeightUpdate(**kwargs)


def test_update_info_that_is_not_a_json_object_is_refused():
    for raw in ("{oops", "[1, 2]"):
        with pytest.raises(InvalidWeightUpdate, match="update_info_json"):
            WeightUpdate.from_pb(weights_pb2.WeightUpdate(version=1, source="vllm_weight_transfer", update_info_json=raw))


# ------------------------------------------------------------------------------------------------ backend
async def test_backend_sync_order_is_wake_weights_load_version_kv_cache_reset(tmp_path):
    engine = FakeVllm().start()
    backend = VllmBackend(engine.url, idle_timeout_s=1)
    try:
        await backend.suspend(SuspendMode.DISCARD, [])
        engine.calls.clear()
        update = _weights(tmp_path, 1)
        await backend.resume_with_weights([], update)
        posts = [(p, b) for m, p, b in engine.calls if m == "POST"]
        order = [p for p, _ in posts]
        assert order[:5] == ["/wake_up", "/collective_rpc", "/update_weight_version", "/wake_up", "/reset_prefix_cache"]
        assert posts[0][1] == {"tags": "weights"} and posts[3][1] == {"tags": "kv_cache"}
        assert posts[1][1] == {"method": "reload_weights", "kwargs": {"weights_path": update.location}}
        assert engine.weight_version == "1" and engine.level == 0
        assert backend.weight_version == 1 and backend.last_sync["bytes"] > 0
    finally:
        await backend.close()
        engine.stop()


async def test_backend_never_hands_a_corrupt_version_to_vllm_and_recovers_with_the_last_good_one(tmp_path):
    engine = FakeVllm().start()
    backend = VllmBackend(engine.url, idle_timeout_s=1)
    try:
        good = _weights(tmp_path, 1)
        await backend.suspend(SuspendMode.DISCARD, [])
        await backend.resume_with_weights([], good)
        bad = _weights(tmp_path, 2)
        (tmp_path / "v2" / "model.safetensors").write_bytes(b"\0" * 10)
        await backend.suspend(SuspendMode.DISCARD, [])
        engine.calls.clear()
        with pytest.raises(BackendError, match=r"weight version 2 failed.*last good version 1"):
            await backend.resume_with_weights([], bad)
        assert engine.level != 0, "the engine stays asleep (out of service)"
        assert not [c for c in engine.calls if c[1] == "/collective_rpc"], "vLLM never saw the corrupt directory"
        # A plain wake afterwards reloads the last good version before serving (never a mix).
        engine.calls.clear()
        await backend.resume([])
        reloads = [b for m, p, b in engine.calls if p == "/collective_rpc"]
        assert reloads == [{"method": "reload_weights", "kwargs": {"weights_path": good.location}}]
        assert engine.level == 0 and backend.weight_version == 1
    finally:
        await backend.close()
        engine.stop()


async def test_a_same_size_file_with_a_damaged_safetensors_header_never_reaches_vllm(tmp_path):
    """What kills vLLM 0.32's engine core on a reload (an unreadable safetensors file) is checked before the reload,
    even when the size still matches the manifest."""
    engine = FakeVllm().start()
    backend = VllmBackend(engine.url, idle_timeout_s=1)
    try:
        bad = _weights(tmp_path, 1)
        f = tmp_path / "v1" / "model.safetensors"
        raw = bytearray(f.read_bytes())
        raw[12] = ord("}")  # inside the JSON header
        f.write_bytes(bytes(raw))
        await backend.suspend(SuspendMode.DISCARD, [])
        engine.calls.clear()
        with pytest.raises(BackendError, match=r"weight version 1 failed.*is not a readable safetensors file"):
            await backend.resume_with_weights([], bad)
        assert not [c for c in engine.calls if c[1] == "/collective_rpc"], "vLLM never saw the damaged file"
        assert engine.level != 0
    finally:
        await backend.close()
        engine.stop()


async def test_a_version_whose_bytes_fail_the_check_while_loading_is_rolled_back_to_the_last_good_one(tmp_path):
    """The checksum runs alongside vLLM's reload: a version damaged in place (same size, a data byte flipped) reaches
    the engine, fails the check, and the wake stops before the kv cache (never served); the next plain wake reloads
    the last good version."""
    engine = FakeVllm().start()
    backend = VllmBackend(engine.url, idle_timeout_s=1)
    try:
        good = _weights(tmp_path, 1)
        await backend.suspend(SuspendMode.DISCARD, [])
        await backend.resume_with_weights([], good)
        bad = _weights(tmp_path, 2)
        f = tmp_path / "v2" / "model.safetensors"
        raw = bytearray(f.read_bytes())
        raw[-5] ^= 0x10
        f.write_bytes(bytes(raw))
        await backend.suspend(SuspendMode.DISCARD, [])
        engine.calls.clear()
        with pytest.raises(BackendError, match=r"weight version 2 failed.*last good version 1.*does not match its xxh3_128"):
            await backend.resume_with_weights([], bad)
        posts = [(p, b) for m, p, b in engine.calls if m == "POST"]
        assert ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": bad.location}}) in posts
        assert {"tags": "kv_cache"} not in [b for _, b in posts], "the kv cache was never woken on the damaged weights"
        assert engine.level != 0 and backend.weight_version == 1
        engine.calls.clear()
        await backend.resume([])
        reloads = [b for m, p, b in engine.calls if p == "/collective_rpc"]
        assert reloads == [{"method": "reload_weights", "kwargs": {"weights_path": good.location}}]
        assert engine.level == 0 and backend.weight_version == 1
    finally:
        await backend.close()
        engine.stop()


async def test_last_good_version_whose_files_changed_since_it_loaded_is_not_reloaded(tmp_path):
    """A level-2 wake reloads the last good version from its directory: if those files were rewritten since it
    loaded (a trainer reusing the directory), vLLM never sees them (a failed reload kills vLLM 0.32's engine core);
    the wake fails naming the change and the engine stays asleep (out of service)."""
    engine = FakeVllm().start()
    backend = VllmBackend(engine.url, idle_timeout_s=1)
    try:
        good = _weights(tmp_path, 1)
        await backend.suspend(SuspendMode.DISCARD, [])
        await backend.resume_with_weights([], good)
        await backend.suspend(SuspendMode.DISCARD, [])
        (tmp_path / "v1" / "model.safetensors").write_bytes(b"\0" * 10)  # rewritten after it loaded
        engine.calls.clear()
        with pytest.raises(BackendError, match=r"last good weight version's files changed since it loaded"):
            await backend.resume([])
        assert not [c for c in engine.calls if c[1] == "/collective_rpc"], "vLLM never saw the changed directory"
        assert engine.level != 0, "the engine stays asleep (out of service)"
    finally:
        await backend.close()
        engine.stop()


async def test_weight_transfer_loader_follows_vllms_start_update_finish_sequence():
    engine = FakeVllm().start()
    loader = WeightTransferLoader({"master_address": "10.0.0.1", "master_port": 29500, "world_size": 2})
    backend = VllmBackend(engine.url, idle_timeout_s=1, weight_loaders={"vllm_weight_transfer": loader})
    info = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4, 4]]}
    try:
        await backend.suspend(SuspendMode.OFFLOAD, [])
        for v in (1, 2):
            await backend.resume_with_weights([], WeightUpdate(v, "vllm_weight_transfer", update_info=info))
            await backend.suspend(SuspendMode.OFFLOAD, [])
        paths = [p for m, p, _ in engine.calls if m == "POST" and "weight" in p]
        assert paths == [
            "/init_weight_transfer_engine",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/update_weight_version",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/update_weight_version",
        ]
        assert engine.transfer_updates == [info, info] and engine.weight_version == "2"
        with pytest.raises(BackendError, match="no loader for weight source 'files'"):
            await backend.resume_with_weights([], WeightUpdate(3, "files", "/w"))
    finally:
        await backend.close()
        engine.stop()


# ----------------------------------------------------------------------------------------- through gRPC
@pytest.fixture
async def stack(tmp_path):
    engines = [FakeVllm().start(), FakeVllm().start()]
    sidecars = [
        SidecarServer({f"sampler-{i}": VllmBackend(e.url, idle_timeout_s=1)}, port=0, token=TOKEN) for i, e in enumerate(engines)
    ]
    for s in sidecars:
        await s.start()
    addrs = [e.url.removeprefix("http://") for e in engines]
    inv = Inventory.model_validate(
        {
            "groups": [
                {
                    "group_id": "g",
                    "sleep_level_policy": "auto",
                    "samplers": [
                        {"pool": "default", "address": a, "sidecar": f"127.0.0.1:{s.port}", "job_id": f"sampler-{i}"}
                        for i, (a, s) in enumerate(zip(addrs, sidecars, strict=True))
                    ],
                },
                {"group_id": "trainers"},
            ]
        }
    )
    orch = OrchestratorServer(inv, port=0, token=TOKEN)
    await orch.start()
    gate = GateServer(GateConfig(ext_proc_port=0, control_port=0, orchestrator=f"127.0.0.1:{orch.port}", token=TOKEN))
    await gate.start()
    await asyncio.wait_for(gate.subscription.connected.wait(), 10)
    client = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="g", token=TOKEN)
    yield engines, addrs, orch, gate, client, sidecars
    await client.close()
    await gate.stop()
    await orch.stop()
    for s in sidecars:
        await s.stop()
    for e in engines:
        e.stop()


async def test_yield_with_a_weight_version_wakes_samplers_serving_that_version(stack, tmp_path):
    engines, addrs, orch, gate, client, _ = stack
    pool = gate.pools["default"]
    await client.acquire(timeout_sec=30)
    assert all(e.level == 1 for e in engines), "first grant: nothing published yet -> level 1"
    await client.release(weights=_weights(tmp_path, 1))
    await _until(lambda: pool.serving(min_version=1) == tuple(addrs))
    assert [e.weight_version for e in engines] == ["1", "1"]
    assert all(e.weights_path == str(tmp_path / "v1") for e in engines)
    # auto policy: the job published, so its next grant discards the weights (level 2) ...
    await client.acquire(timeout_sec=30)
    assert all(e.level == 2 for e in engines)
    await client.release(weights=_weights(tmp_path, 2))
    await _until(lambda: pool.serving(min_version=2) == tuple(addrs))
    # ... and a grant without publishing goes back to level 1 at the next one.
    await client.acquire(timeout_sec=30)
    await client.release()
    await _until(lambda: pool.serving() == tuple(addrs))
    assert pool.serving(min_version=2) == tuple(addrs), "a yield without weights keeps the version"
    await client.acquire(timeout_sec=30)
    assert all(e.level == 1 for e in engines)
    await client.release()
    await _until(lambda: pool.serving() == tuple(addrs))
    sync = TimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="g", token=TOKEN)
    try:
        status = await asyncio.to_thread(sync.weight_status, "g")  # the sync client, off the server's loop
    finally:
        sync.close()
    assert status.serving_version == 2 and not status.HasField("pending")
    assert [(s.version, s.in_service) for s in status.samplers] == [(2, True), (2, True)]


async def test_a_rejected_weight_version_leaves_the_pool_serving_the_last_good_one(stack, tmp_path):
    """Issue 15 item 9: a version damaged after its manifest was written is refused by every sampler. They are
    woken with their last good version and keep serving it (never out of service, never a mix), the publisher
    learns it from the weight status without acquiring again, the version is not retried at later wakes, and a
    newer version is loaded as usual."""
    engines, addrs, orch, gate, client, _ = stack
    pool = gate.pools["default"]
    await client.acquire(timeout_sec=30)
    await client.release(weights=_weights(tmp_path, 1))
    await _until(lambda: pool.serving(min_version=1) == tuple(addrs))
    bad = _weights(tmp_path, 2)
    (tmp_path / "v2" / "model.safetensors").write_bytes(b"corrupt")  # damaged after the manifest was written
    await client.acquire(timeout_sec=30)
    await client.release(weights=bad)
    statuses: list = []

    async def poll() -> bool:
        statuses.append(await client.weight_status("g"))
        return statuses[-1].rejected.version == 2

    deadline = asyncio.get_running_loop().time() + 30  # a bound on a loaded CI machine, not a speed target
    while not await poll() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    status = statuses[-1]
    assert status.rejected.version == 2 and "the manifest says" in status.rejected.error, status
    await _until(lambda: pool.serving() == tuple(addrs) and orch.orchestrator.groups["g"].state.value == "IDLE")
    assert {pool.endpoints[a].weight_version for a in addrs} == {1}, "serving the last good version"
    assert [e.weight_version for e in engines] == ["1", "1"] and all(e.level == 0 for e in engines)
    assert all(e.weights_path == str(tmp_path / "v1") for e in engines), "version 1's weights reloaded"
    status = await client.weight_status("g")
    assert status.serving_version == 1 and not status.HasField("pending")
    assert [(s.version, s.in_service) for s in status.samplers] == [(1, True), (1, True)]
    # Not retried: later wakes target the last good version; vLLM never sees version 2's directory.
    for e in engines:
        e.calls.clear()
    res = await client.acquire(timeout_sec=30)
    assert "weight version 2 was rejected by 2 of 2" in res.weight_sync_error
    assert "the manifest says" in res.weight_sync_error
    await client.release()
    await _until(lambda: pool.serving(min_version=1) == tuple(addrs))
    assert not [b for e in engines for _, p, b in e.calls if p == "/collective_rpc" and str(tmp_path / "v2") in json.dumps(b)]
    # Recover as usual: publish a good version.
    await client.acquire(timeout_sec=30)
    await client.release(weights=_weights(tmp_path, 3))
    await _until(lambda: pool.serving(min_version=3) == tuple(addrs))
    status = await weight_status_when(client, "g", lambda s: s.serving_version == 3)  # the switch's record may lag the gate
    assert status.rejected.version == 0
    res = await client.acquire(timeout_sec=30)
    assert res.weight_sync_error == ""
    await client.release()


async def test_a_wake_that_fails_for_another_reason_keeps_that_sampler_out_of_service(stack, tmp_path):
    """A load that the engine does not survive is not a rejected version: that sampler stays out of service at
    its old version (published ASLEEP), the other serves the new one, and the publisher is told."""
    engines, addrs, orch, gate, client, _ = stack
    pool = gate.pools["default"]
    await client.acquire(timeout_sec=30)
    engines[0].lie_on_wake = True  # 200 on /wake_up, still asleep
    await client.release(weights=_weights(tmp_path, 1))
    await _until(lambda: pool.serving(min_version=1) == (addrs[1],))
    await _until(lambda: orch.orchestrator.groups["g"].state.value == "IDLE")
    assert pool.endpoints[addrs[0]].state is EndpointState.ASLEEP and pool.endpoints[addrs[0]].weight_version == 0
    status = await client.weight_status("g")
    assert status.rejected.version == 0 and {s.address: (s.version, s.in_service) for s in status.samplers} == {
        addrs[0]: (0, False),
        addrs[1]: (1, True),
    }
    engines[0].lie_on_wake = False
    res = await client.acquire(timeout_sec=30)
    assert "weight version 1 did not load on 1 of 2" in res.weight_sync_error
    await client.release()
    await _until(lambda: pool.serving(min_version=1) == tuple(addrs))


async def test_publish_is_refused_with_a_reason(stack, tmp_path):
    _, _, orch, _, client, _ = stack
    with pytest.raises(LeaseError, match="does not hold group 'g'"):
        await client.publish_weights(_weights(tmp_path, 1))
    await client.acquire(timeout_sec=30)
    await client.publish_weights(_weights(tmp_path, 5))
    with pytest.raises(LeaseError, match=r"FAILED_PRECONDITION.*not newer"):
        await client.publish_weights(WeightUpdate(5, "files", str(tmp_path / "v5")))
    with pytest.raises(LeaseError, match="unknown group 'nope'"):
        await client.publish_weights(_weights(tmp_path, 6), group_id="nope")
    await client.release()
    other = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="trainers", token=TOKEN)
    try:
        await other.acquire(timeout_sec=30)
        with pytest.raises(LeaseError, match=r"INVALID_ARGUMENT.*no samplers"):
            await other.publish_weights(_weights(tmp_path, 7))
        await other.release()
    finally:
        await other.close()


async def test_sidecar_refuses_a_weight_sync_it_cannot_do(stack):
    _, _, _, _, _, sidecars = stack
    engine = FakeSglang().start()
    from llmd_timeslice.snapshot.backends.sglang import SglangBackend

    side = SidecarServer({"sg": SglangBackend(engine.url)}, port=0, token=TOKEN)
    await side.start()
    from llmd_timeslice import auth

    try:
        for target, job, weights, message in [
            (side.port, "sg", weights_pb2.WeightUpdate(version=1, source="files", location="/w"), "cannot load weights"),
            (
                sidecars[0].port,
                "sampler-0",
                weights_pb2.WeightUpdate(version=0, source="files", location="/w"),
                "weight version must be",
            ),
            (
                sidecars[0].port,
                "sampler-0",
                weights_pb2.WeightUpdate(version=1, source="ftp", location="/w"),
                "unknown weight source",
            ),
        ]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{target}", interceptors=auth.client_interceptors(TOKEN)) as ch:
                stub = xpb_grpc.SnapshotOperationsServiceStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await stub.RestoreWithWeights(
                        xpb.RestoreWithWeightsRequest(restore=spb.RestoreRequest(job_id=job, group="g"), weights=weights),
                        timeout=10,
                    )
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert message in ei.value.details()
    finally:
        await side.stop()
        engine.stop()


async def test_weight_versions_survive_an_orchestrator_restart(tmp_path):
    engine, addr, sidecar, inv = await one_sampler(TOKEN)
    state = tmp_path / "state.json"
    from llmd_timeslice.orchestrator.persistence import FileStateStore

    orch = OrchestratorServer(inv, port=0, token=TOKEN, state_store=FileStateStore(state))
    await orch.start()
    client = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="g", token=TOKEN)
    try:
        await client.acquire(timeout_sec=30)
        await client.release(weights=_weights(tmp_path / "w", 4))
        await _until(lambda: orch.orchestrator.groups["g"].serving_version == 4)
        await orch.stop()
        saved = json.loads(state.read_text())["groups"]["g"]
        assert saved["sampler_versions"] == {addr: 4} and saved["weights"]["version"] == 4
        orch = OrchestratorServer(inv, port=orch.port, token=TOKEN, state_store=FileStateStore(state))
        await orch.start()
        assert orch.hub.state["default"][addr][1] == 4, "republished SERVING at version 4"
        await client.acquire(timeout_sec=30)
        with pytest.raises(LeaseError, match="not newer"):
            await client.publish_weights(WeightUpdate(3, "files", str(tmp_path / "w" / "v4")))
        await client.release()
    finally:
        await client.close()
        await orch.stop()
        await sidecar.stop()
        engine.stop()


@contextlib.asynccontextmanager
async def _audited_sampler_at_v1(tmp_path, audit_interval_s: float):
    """One fake vLLM + sidecar, an orchestrator auditing every ``audit_interval_s`` s, a subscribed gate, and a
    trainer that published version 1, which the sampler serves. Yields a namespace; ``engine`` may be replaced
    (the one there at the end is stopped)."""
    engine, addr, sidecar, inv = await one_sampler(TOKEN)
    orch = OrchestratorServer(inv, port=0, token=TOKEN, engine_audit_interval_s=audit_interval_s)
    await orch.start()
    gate = GateServer(GateConfig(ext_proc_port=0, control_port=0, orchestrator=f"127.0.0.1:{orch.port}", token=TOKEN))
    await gate.start()
    client = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="g", token=TOKEN)
    st = types.SimpleNamespace(
        engine=engine, addr=addr, pool=gate.pools["default"], g=orch.orchestrator.groups["g"], client=client, orch=orch
    )
    try:
        await asyncio.wait_for(gate.subscription.connected.wait(), 10)
        await client.acquire(timeout_sec=30)
        await client.release(weights=_weights(tmp_path, 1))
        await _until(lambda: st.pool.serving(min_version=1) == (addr,))
        yield st
    finally:
        await client.close()
        await gate.stop()
        await orch.stop()
        await sidecar.stop()
        st.engine.stop()


async def test_engine_that_restarts_on_its_own_is_caught_by_the_audit_and_reloaded(tmp_path):
    """A sampler engine restarts by itself (a pod restart) after loading version 1: it serves its initial
    weights again while the orchestrator and the gate still say version 1. The engine audit reads the engine's
    own label, takes it out of service and loads version 1 again; an engine put to sleep behind the
    orchestrator's back is woken the same way. Both show in the engine-fault counter."""
    from llmd_timeslice.orchestrator.service import ENGINE_FAULTS

    faults = {r: ENGINE_FAULTS.labels(group_id="g", reason=r) for r in ("restarted", "asleep")}
    before = {r: c._value.get() for r, c in faults.items()}
    async with _audited_sampler_at_v1(tmp_path, 0.5) as st:
        engine, addr, pool, g = st.engine, st.addr, st.pool, st.g
        assert engine.weight_version == "1"

        engine.restart()
        engine.wake_delay_s = 0.4  # keeps the out-of-service window wide enough to be seen
        await _until(lambda: pool.serving(min_version=1) == (), timeout_s=5)  # out of service first ...
        await _until(lambda: pool.serving(min_version=1) == (addr,) and engine.weight_version == "1", timeout_s=10)
        assert engine.weights_path == str(tmp_path / "v1"), "... then version 1 loaded again"
        # counted when the repair record closes, just after the pool serves again (a loaded machine shows the gap)
        await _until(lambda: faults["restarted"]._value.get() == before["restarted"] + 1, timeout_s=10)
        repair = [r for r in g.history if r.kind == "repair"][-1]
        assert repair.ok and repair.engine_faults == {addr: "restarted"} and not g.sampler_errors

        engine.wake_delay_s = 0.0
        engine.level, engine.asleep_tags = 1, {"weights", "kv_cache"}  # slept behind the orchestrator's back
        await _until(lambda: faults["asleep"]._value.get() == before["asleep"] + 1, timeout_s=5)
        await _until(lambda: engine.level == 0 and pool.serving(min_version=1) == (addr,), timeout_s=10)
        assert g.sampler_versions[addr] == 1 and not g.sampler_errors
        assert engine.completions_while_asleep == 0


async def test_engine_audit_leaves_healthy_and_unreadable_engines_alone(tmp_path):
    """Engines that serve what is recorded, engines without the weight-version route and samplers whose
    sidecar does not answer are never taken out of service by the audit."""
    from llmd_timeslice.domain.switches import EngineReading

    engine, addr, sidecar, inv = await one_sampler(TOKEN)
    orch = OrchestratorServer(inv, port=0, token=TOKEN, engine_audit_interval_s=0.3)
    await orch.start()
    g = orch.orchestrator.groups["g"]
    try:
        core = orch.orchestrator
        g.sampler_versions[addr] = 3
        assert core.engine_faults(g, {addr: EngineReading("3", False)}) == {}
        assert core.engine_faults(g, {addr: EngineReading(None, False)}) == {}, "no label: cannot judge the version"
        assert core.engine_faults(g, {}) == {}, "sidecar did not answer: no reading, no verdict"
        assert "restarted" in core.engine_faults(g, {addr: EngineReading("default", False)})[addr]
        assert "sleeps" in core.engine_faults(g, {addr: EngineReading(None, True)})[addr]
        assert "refuses connections" in core.engine_faults(g, {addr: EngineReading(None, False, "refused")})[addr]
        g.sampler_versions[addr] = 0
        assert core.engine_faults(g, {addr: EngineReading("default", False)}) == {}, "never synced: initial weights"
        await sidecar.stop()  # unreadable from now on
        await asyncio.sleep(1.0)  # three audits
        assert not g.sampler_errors and not [r for r in g.history if r.kind == "repair"]
    finally:
        await orch.stop()
        engine.stop()


async def test_engine_that_dies_while_serving_is_taken_out_of_service_and_comes_back_by_itself(tmp_path, caplog):
    """Between switches, a sampler's engine dies (its sidecar lives): the audit sees it refuse connections and
    takes it out of service, so the gate stops steering to it; once an engine listens at that address again,
    the audit sees it answer and the repair runs at once (not at the end of its back-off): it wakes the engine,
    loads the group's version and serves it."""
    from llmd_timeslice.orchestrator.service import ENGINE_FAULTS

    unreachable = ENGINE_FAULTS.labels(group_id="g", reason="unreachable")
    before = unreachable._value.get()
    async with _audited_sampler_at_v1(tmp_path, 0.3) as st:
        engine, addr, pool, g = st.engine, st.addr, st.pool, st.g
        # The repair's back-off starts at 30 s: longer than the test waits below, so only the audit's reading of the
        # engine that answers again can repair it in time (and its log line says so).
        st.orch.orchestrator.start_repair(first_s=30.0, max_s=60.0, audit_interval_s=0.3)
        port = int(addr.rsplit(":", 1)[1])
        engine.kill()
        await _until(lambda: pool.serving() == (), timeout_s=5)
        await _until(lambda: unreachable._value.get() == before + 1 and addr in g.sampler_errors, timeout_s=5)
        # The repair the audit started at once failed (the engine is down: its load too); the back-off runs.
        await _until(lambda: g.phase is GroupPhase.OUT_OF_SERVICE, timeout_s=10, what="the first repair failed")
        with caplog.at_level(logging.WARNING, logger="llmd_timeslice.orchestrator.group"):
            engine = st.engine = FakeVllm(port=port).start()  # the engine is back (its initial weights)
            # the gate serves the engine as soon as it is verified; the group records the repair's outcome after
            await _until(lambda: pool.serving(min_version=1) == (addr,) and not g.sampler_errors, timeout_s=20)
        assert engine.weight_version == "1" and engine.weights_path == str(tmp_path / "v1") and not g.sampler_errors
        assert "its engine answers again; repairing now" in caplog.text
        # The load failed while the engine was down, and the repair fixed it before the publisher's next acquire: that
        # acquire warns about nothing (it printed a warning about the fault already repaired: issue 38 §5).
        with caplog.at_level(logging.INFO, logger="llmd_timeslice.orchestrator.group"):
            res = await st.client.acquire(timeout_sec=30)
        assert res.weight_sync_error == "", res
        assert f"weight-version problems of job trainer on ['{addr}'] were repaired before its next acquire" in caplog.text
        await st.client.release()
