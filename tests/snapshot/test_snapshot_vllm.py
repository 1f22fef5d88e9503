"""The vLLM backend against real vLLM 0.32 on CPU: level-2 discard, wake-up by tags, pause modes, the field
failures of issue 15 that a CPU build can show (a prefix-cache reset refused while requests hold blocks, the
semantic probe catching wrong weights after a level-2 reload, a request parked in a sleeping engine), and an
engine killed mid-sleep (``kills_vllm``: it kills the session's server, so it runs after every other test using it).

On the session's real vLLM server (``vllm_server`` in tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest

from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2 as xpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import snapshot_ext_pb2_grpc as xpb_grpc
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from llmd_timeslice.snapshot.backends.base import BackendError, EnginePaused, SuspendMode
from llmd_timeslice.snapshot.backends.vllm import ProbeMismatch, VllmBackend, parse_engine_metrics
from llmd_timeslice.snapshot.server import SidecarServer
from tests.support.vllm import restore_initial_weights

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

LONG = {"prompt": "the quick brown fox", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
LOAD_REQUESTS = 8  # = --max-num-seqs: all running, none queued
ATTEMPTS = 4  # vLLM CPU sometimes serves /sleep only after the running batch ended (then nothing is in flight)
LOAD_START_S = 20.0  # at most this long for the load to be running (a few tenths of a second on an idle machine)


async def test_level2_discard_then_wake_weights_reload_kv_cache(vllm_server):
    b = VllmBackend(vllm_server.url, memory_reader=lambda: None)
    try:
        await b.suspend(SuspendMode.DISCARD, [])
        assert (await b.metrics()).sleep_state == "discard_all"
        await b.resume(["weights"])  # + collective_rpc reload_weights
        assert await b.is_suspended(), "a weights-only wake leaves the engine asleep until kv_cache wakes"
        await b.resume(["kv_cache"])  # + reset_prefix_cache, verify awake, probe
        assert not await b.is_suspended() and (await b.metrics()).sleep_state == "awake"
        await b.suspend(SuspendMode.DISCARD, [])
        await b.resume([])  # the whole sequence in one call
        assert (await b.metrics()).sleep_state == "awake"
    finally:
        await b.close()


def _prefix_hits(text: str) -> float:
    """``vllm:prefix_cache_hits_total`` summed over its series (tokens served from the prefix cache; vLLM 0.32
    ``vllm/v1/metrics/loggers.py``)."""
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("vllm:prefix_cache_hits_total"))


async def test_a_level1_wake_resets_the_prefix_cache_and_a_repeated_prefix_is_served_right(vllm_server):
    """Issue 38 §4 (vllm-project/vllm#17103): level 1 frees the KV cache, so after the wake the backend resets the
    prefix cache (its POST seen on the wire, answered success) and a repeated prefix is recomputed, not read from
    blocks the sleep discarded: the same greedy tokens, and no prefix-cache hit for it."""
    b = VllmBackend(vllm_server.url, memory_reader=lambda: None)
    resets: list[httpx.Response] = []

    async def seen(r: httpx.Response) -> None:
        if r.request.url.path == "/reset_prefix_cache":
            await r.aread()
            resets.append(r)

    b._http.event_hooks["response"].append(seen)
    prompt = " ".join(f"word{i}" for i in range(96))  # several KV blocks of a shared prefix
    body = {"model": vllm_server.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    try:
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=120) as c:
            first = (await c.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]
            hits = _prefix_hits((await c.get("/metrics")).text)
            again = (await c.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]
            cached = _prefix_hits((await c.get("/metrics")).text) - hits
            assert again == first and cached > 0, "the engine caches prefixes (else this test shows nothing)"
            await b.suspend(SuspendMode.OFFLOAD, [])
            await b.resume([])
            assert [r.status_code for r in resets] == [200] and resets[0].json().get("success", True)
            hits = _prefix_hits((await c.get("/metrics")).text)
            after = (await c.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]
            assert after == first
            assert _prefix_hits((await c.get("/metrics")).text) - hits < cached, "a prefix cached before the sleep was hit"
    finally:
        await b.close()


async def _running(c: httpx.AsyncClient, url: str) -> float:
    """``vllm:num_requests_running`` now (the engine's scheduler gauge, updated every step)."""
    text = (await c.get(url + "/metrics")).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("vllm:num_requests_running"))


async def _until_engine(c: httpx.AsyncClient, url: str, pred, what: str, timeout_s: float = LOAD_START_S) -> None:
    """Poll until ``await pred(c, url)`` holds (the engine's own state, not a fixed sleep: a loaded machine is slow)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await pred(c, url):
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not seen in {timeout_s:g} s"
        await asyncio.sleep(0.02)


async def _load(c: httpx.AsyncClient, url: str, model: str) -> list[asyncio.Task]:
    """LOAD_REQUESTS long completions, all running at once (~2.5 s of work). Warm decode of the tiny
    model is fast (~1,500 tokens/s), so a single request would end before a sleep arrives. Returns
    once the engine runs all of them (its ``vllm:num_requests_running``), with the engine still busy. On a loaded
    machine the requests can trickle in so slowly that the first ends before the last starts: then the load is
    sent again (ATTEMPTS times)."""
    for _attempt in range(ATTEMPTS):
        tasks = [
            asyncio.create_task(c.post(url + "/v1/completions", json={"model": model, **LONG})) for _ in range(LOAD_REQUESTS)
        ]

        async def all_running(c, url, tasks=tasks) -> bool:
            return any(t.done() for t in tasks) or await _running(c, url) >= LOAD_REQUESTS

        await _until_engine(c, url, all_running, f"{LOAD_REQUESTS} requests running")
        if not any(t.done() for t in tasks):
            return tasks
        for r in await asyncio.gather(*tasks):
            assert r.status_code == 200, r.text
    raise AssertionError(f"never had {LOAD_REQUESTS} requests running at once in {ATTEMPTS} attempts")


async def _sleep_while_busy(url: str, model: str, mode: str) -> tuple[int, list[tuple[str, int]]]:
    """Sleep (drain fallback: no idle wait) under load; wake; return (requests done before the
    wake, [(finish_reason, completion tokens)] of all)."""
    b = VllmBackend(url, idle_timeout_s=0, pause_mode=mode, memory_reader=lambda: None)
    async with httpx.AsyncClient(timeout=120) as c:
        tasks = await _load(c, url, model)
        try:
            await b.suspend(SuspendMode.OFFLOAD, [])
            await asyncio.sleep(0.5)
            done_before_wake = sum(t.done() for t in tasks)
            await b.resume([])
        finally:
            await b.close()
        bodies = [(await t).json() for t in tasks]
    return done_before_wake, [(x["choices"][0]["finish_reason"], x["usage"]["completion_tokens"]) for x in bodies]


async def _until_mid_batch(url: str, model: str, mode: str, landed) -> tuple[int, list[tuple[str, int]]]:
    """Repeat the scenario until the sleep landed while requests were still decoding (``landed``)."""
    for _ in range(ATTEMPTS):
        done, results = await _sleep_while_busy(url, model, mode)
        if landed(done, results):
            break
    return done, results


async def test_pause_mode_abort_ends_requests_in_flight_with_finish_reason_abort(vllm_server):
    done, results = await _until_mid_batch(
        vllm_server.url, vllm_server.model_name, "abort", lambda d, rs: any(r == "abort" for r, _ in rs)
    )
    assert done == LOAD_REQUESTS, "abort: nothing is left in flight once the sleep returns"
    assert any(r == "abort" for r, _ in results), results
    assert all(n < LONG["max_tokens"] for r, n in results if r == "abort")


async def test_pause_mode_wait_finishes_requests_before_sleeping(vllm_server):
    done, results = await _sleep_while_busy(vllm_server.url, vllm_server.model_name, "wait")
    # the sleep returns after the running batch finished (with more requests than --max-num-seqs,
    # the ones still queued stayed queued while asleep and ran after the wake: seen with 32)
    assert done >= 1
    assert results == [("length", LONG["max_tokens"])] * LOAD_REQUESTS


async def test_pause_mode_keep_freezes_requests_until_wake(vllm_server):
    done, results = await _until_mid_batch(vllm_server.url, vllm_server.model_name, "keep", lambda d, rs: d < LOAD_REQUESTS)
    assert done < LOAD_REQUESTS, "keep: requests in flight stay frozen while the engine sleeps"
    assert results == [("length", LONG["max_tokens"])] * LOAD_REQUESTS, "and finish after the wake, no token lost"


async def test_prefix_cache_reset_answers_200_success_false_while_requests_hold_blocks(vllm_server):
    """Issue 15 item 1 on vLLM 0.32: the refusal is a 200 whose body says so; with running requests preempted the
    reset succeeds and the requests still finish in full (they recompute)."""
    url, model = vllm_server.url, vllm_server.model_name
    b = VllmBackend(url, memory_reader=lambda: None)
    async with httpx.AsyncClient(timeout=120) as c:
        assert parse_engine_metrics((await c.get(url + "/metrics")).text).sleep_states == {"0": "awake"}, (
            "one engine core, labelled engine=0"
        )
        for _attempt in range(ATTEMPTS):
            tasks = await _load(c, url, model)
            plain = await c.post(url + "/reset_prefix_cache")
            if not all(t.done() for t in tasks):
                break
        assert (plain.status_code, plain.json()) == (200, {"success": False}), plain.text
        await b._reset_prefix_cache()  # the backend's rule: refused -> reset_running_requests=true -> success
        results = [(await t).json()["choices"][0] for t in tasks]
    await b.close()
    assert [(r["finish_reason"], len(r["text"]) > 0) for r in results] == [("length", True)] * LOAD_REQUESTS


def _perturbed_copy(model_dir, dest):
    """A copy of the model directory whose weights carry noise: a 'version' that loads fine and answers wrong."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, dest, ignore=shutil.ignore_patterns(".*"))
    state = load_file(str(dest / "model.safetensors"))
    g = torch.Generator().manual_seed(15)
    noisy = {
        k: (v + torch.randn(v.shape, generator=g) * v.float().std().clamp(min=0.02)).to(v.dtype) if v.is_floating_point() else v
        for k, v in state.items()
    }
    save_file(noisy, str(dest / "model.safetensors"), metadata={"format": "pt"})


async def test_semantic_probe_catches_an_engine_that_reloaded_wrong_weights_after_a_level2_wake(vllm_server, tmp_path):
    """Issue 15 item 2 on vLLM 0.32 (greedy float32 is deterministic here): a level-2 reload of the same weights
    matches the reference; a reload that brings other weights under the same version (the version's files were
    replaced and re-checksummed) is awake, healthy and wrong: the probe fails it and puts it back to sleep."""
    import shutil

    from llmd_timeslice.weights.manifest import write_manifest
    from llmd_timeslice.weights.update import WeightUpdate

    good, bad = tmp_path / "v1", tmp_path / "bad"
    shutil.copytree(vllm_server.model_dir, good, ignore=shutil.ignore_patterns(".*"))
    write_manifest(good, 1)
    _perturbed_copy(vllm_server.model_dir, bad)
    b = VllmBackend(vllm_server.url, memory_reader=lambda: None)
    try:
        await b.suspend(SuspendMode.DISCARD, [])  # reference of the initial weights, recorded while they served
        await b.resume([])  # level-2 reload of the same weights: the probe matches (no false alarm)
        await b.suspend(SuspendMode.DISCARD, [])
        await b.resume_with_weights([], WeightUpdate(1, "files", str(good)))  # version 1 first serves: its reference
        assert set(b.probe_references) == {0, 1} and b.probe_references[1] == b.probe_references[0]
        await b.suspend(SuspendMode.DISCARD, [])
        shutil.copy(bad / "model.safetensors", good / "model.safetensors")  # replaced under the same version
        write_manifest(good, 1)
        with pytest.raises(ProbeMismatch, match="answers the probe prompts differently from weight version 1"):
            await b.resume([])
        assert await b.is_suspended(), "put back to sleep, out of service"
        shutil.copy(vllm_server.model_dir / "model.safetensors", good / "model.safetensors")
        write_manifest(good, 1)  # published again: a reload re-verifies the files against the manifest first
        await b.resume([])  # the next restore reloads the (repaired) files; the probe matches again
        assert not await b.is_suspended()
    finally:
        await b.close()
        await asyncio.to_thread(restore_initial_weights, vllm_server)


async def test_lora_adapters_keep_their_greedy_tokens_across_a_level1_and_a_level2_wake(vllm_server, tmp_path):
    """Issue 24 §3 on vLLM 0.32 with ``--enable-lora`` (the session's server serves two tiny adapters): the probe
    checks the base model and every adapter, each with its own greedy tokens, after a level-1 wake and after a level-2
    wake (``reload_weights`` resets vLLM's LoRA state, ``GPUModelRunner.reload_weights``: adapters load again from
    their directories on first use). An adapter whose directory changed while the engine slept answers differently
    after the reload: the probe names it and the engine is put back to sleep; with its files back, the next restore
    serves again."""
    import shutil

    from llmd_timeslice.engines.tiny_model import build_tiny_lora
    from tests.support.vllm import LORA_ADAPTERS

    if not vllm_server.lora_adapters:
        pytest.skip(
            f"vLLM {vllm_server.engine_version} cannot reload weights with --enable-lora (fixed in 0.28), so the "
            "session's server runs without adapters; the sidecar's fallback there: tests/snapshot/test_vllm_capabilities.py"
        )
    b = VllmBackend(vllm_server.url, memory_reader=lambda: None)
    adapter_b = Path(vllm_server.lora_adapters[LORA_ADAPTERS[1]])
    kept = tmp_path / "kept.safetensors"
    shutil.copy(adapter_b / "adapter_model.safetensors", kept)
    try:
        await b.suspend(SuspendMode.OFFLOAD, [])  # references: recorded while it served, before the sleep
        ref = b.probe_references[0]
        assert list(ref) == [vllm_server.model_name, *LORA_ADAPTERS], list(ref)
        assert len({str(tokens) for tokens in ref.values()}) == 3, "each adapter has tokens of its own"
        await b.resume([])  # level 1: the probe matches for the base model and both adapters
        await b.suspend(SuspendMode.DISCARD, [])
        await b.resume([])  # level 2: weights reloaded, LoRA state reset, adapters loaded again: matches
        await b.suspend(SuspendMode.DISCARD, [])
        other = build_tiny_lora(vllm_server.model_dir, tmp_path / "other", seed=7)
        shutil.copy(other / "adapter_model.safetensors", adapter_b / "adapter_model.safetensors")
        with pytest.raises(ProbeMismatch, match=f"through LoRA adapter '{LORA_ADAPTERS[1]}'"):
            await b.resume([])
        assert await b.is_suspended(), "put back to sleep, out of service"
        shutil.copy(kept, adapter_b / "adapter_model.safetensors")
        await b.resume([])  # the next restore reloads; the adapter loads from its own files again
        assert not await b.is_suspended()
    finally:
        shutil.copy(kept, adapter_b / "adapter_model.safetensors")
        await b.close()


async def test_a_pause_is_lifted_by_a_full_wake_and_one_made_after_it_keeps_the_engine_out_of_service(vllm_server):
    """Issue 24 §3 on vLLM 0.32: another client's ``POST /pause`` made while the engine sleeps is lifted by the full
    wake (``EngineCore.wake_up`` resumes the scheduler), so one seen after a wake was made after it. An engine paused
    while awake reports ``/is_sleeping`` true and ``/is_paused`` true with its sleep-state gauge ``awake``: the sidecar
    does not resume it (:class:`EnginePaused`, no ``/wake_up`` sent, which would lift the pause) until that client
    sends ``POST /resume``."""
    url = vllm_server.url
    b = VllmBackend(url, memory_reader=lambda: None)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            await b.suspend(SuspendMode.OFFLOAD, [])
            (await c.post("/pause", params={"mode": "keep"})).raise_for_status()  # another client, while asleep
            await b.resume([])  # lifted by the wake: verified awake, not paused, probe passed
            assert (await c.get("/is_paused")).json() == {"is_paused": False}
            (await c.post("/pause", params={"mode": "abort"})).raise_for_status()  # another client, while awake
            assert (await c.get("/is_sleeping")).json() == {"is_sleeping": True}
            assert (await b.metrics()).sleep_state == "awake"
            fresh = VllmBackend(url, memory_reader=lambda: None)  # e.g. a repair after the sidecar restarted
            try:
                with pytest.raises(EnginePaused, match="GET /is_paused: true"):
                    await fresh.resume([])
            finally:
                await fresh.close()
            assert (await c.get("/is_paused")).json() == {"is_paused": True}, "not resumed behind that client's back"
            (await c.post("/resume")).raise_for_status()
            await b.resume([])  # the repair after the client resumed it: awake, verified, probe passed
    finally:
        await b.close()
        httpx.post(url + "/resume", timeout=30)


async def test_request_sent_straight_to_a_sleeping_engine_is_aborted_not_left_hanging(vllm_server):
    """Issue 15 item 4 on vLLM 0.32: a request that reaches the engine while its sleep (mode=wait) is under way is
    queued by the pause and, without the rule, would wait inside the sleeping engine until the next wake. After the
    verified sleep the backend aborts it (finish_reason abort at once) and reports it."""
    url, model = vllm_server.url, vllm_server.model_name
    # The drain fallback (sleep while busy); no probe, so the sleep starts while the batch still runs.
    b = VllmBackend(url, idle_timeout_s=0, probe=False, memory_reader=lambda: None)
    try:
        async with httpx.AsyncClient(timeout=120) as c:
            for _attempt in range(ATTEMPTS):
                tasks = await _load(c, url, model)
                sleep = asyncio.create_task(b.suspend(SuspendMode.OFFLOAD, []))

                async def paused(c, url, sleep=sleep) -> bool:
                    return sleep.done() or (await c.get(url + "/is_paused")).json().get("is_paused") is True

                # the pause has begun (GET /is_paused): the running batch drains, new requests queue
                await _until_engine(c, url, paused, "the pause of the sleep")
                direct = asyncio.create_task(
                    c.post(
                        url + "/v1/completions", json={"model": model, "prompt": "sent straight to the engine", "max_tokens": 16}
                    )
                )
                res = await sleep
                finished = [(await t).json()["choices"][0]["finish_reason"] for t in tasks]
                if res.parked_requests == 1:  # only the direct one; a slow start may park more: try again
                    break
                await direct
                await b.resume([])
            assert (res.parked_requests, res.parked_action) == (1, "aborted"), "never caught a request parked"
            answer = await asyncio.wait_for(direct, 10)  # answered while the engine still sleeps
            assert await b.is_suspended()
            assert answer.json()["choices"][0]["finish_reason"] == "abort", answer.text
            assert finished == ["length"] * LOAD_REQUESTS, "the drained batch completed; only the parked one is aborted"
            await b.resume([])
    finally:
        await b.close()


@pytest.mark.kills_vllm
async def test_engine_killed_mid_sleep_fails_the_operation_and_stays_out_of_service(vllm_server):
    """Kills the session's server (it runs after every other test using it)."""
    srv = SidecarServer({"s": VllmBackend(vllm_server.url, idle_timeout_s=0, memory_reader=lambda: None)}, port=0)
    await srv.start()
    ch = __import__("grpc").aio.insecure_channel(f"127.0.0.1:{srv.port}")
    stub, ops = pb_grpc.SnapshotAgentServiceStub(ch), xpb_grpc.SnapshotOperationsServiceStub(ch)
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            for _attempt in range(4):  # vLLM CPU sometimes lets the sleep land after the batch: retry until mid-sleep
                tasks = await _load(c, vllm_server.url, vllm_server.model_name)
                op = (await stub.Snapshot(pb.SnapshotRequest(job_id="s"))).operation_id  # mode=wait: blocks on the load
                status = (await stub.GetOperation(pb.GetOperationRequest(operation_id=op))).status
                if status == pb.OPERATION_STATUS_PENDING:
                    break
                await asyncio.gather(*tasks, return_exceptions=True)
                await ops.WaitOperation(
                    xpb.WaitOperationRequest(
                        operation_id=(await stub.Restore(pb.RestoreRequest(job_id="s"))).operation_id, timeout_s=60
                    )
                )
            assert status == pb.OPERATION_STATUS_PENDING, "never caught the engine mid-sleep"
            os.killpg(vllm_server.pid, signal.SIGKILL)
            r = await ops.WaitOperation(xpb.WaitOperationRequest(operation_id=op, timeout_s=30))
            await asyncio.gather(*tasks, return_exceptions=True)
        assert r.status == pb.OPERATION_STATUS_FAILED
        assert "did not answer" in r.error and "restart the engine" in r.error, r.error
        assert srv.servicer.states["s"] == "FAULTED"
        op = (await stub.Restore(pb.RestoreRequest(job_id="s"))).operation_id
        r = await ops.WaitOperation(xpb.WaitOperationRequest(operation_id=op, timeout_s=30))
        assert r.status == pb.OPERATION_STATUS_FAILED and "out of service" in r.error
        assert srv.servicer.states["s"] == "FAULTED"
        with pytest.raises(BackendError):
            await srv.servicer.backends["s"].is_suspended()
    finally:
        await ch.close()
        await srv.stop()
