"""Proof that the samplers roll out with the policy the trainer just produced (real vLLM on CPU).

One training step of the tiny Llama with ``transformers`` (float32), published as weight version 1,
loaded by the switch back (orchestrator -> sidecar -> vLLM ``reload_weights``), served through Envoy
and the gate at that version: vLLM's greedy tokens for fixed prompts equal ``transformers`` greedy
decoding of the trained weights (first 8 tokens) and differ from version 0's.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import httpx
import pytest

from llmd_timeslice import protocol
from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from llmd_timeslice.weights.manifest import save_weight_version
from tests.support.router import start_router
from tests.support.vllm import restore_initial_weights
from tests.support.weight_status import weight_status_when

if TYPE_CHECKING:
    import torch  # imported where used: ~2 s of CPU in every pytest-xdist worker's collection otherwise

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPTS = ["the quick brown fox", "once upon a time", "hello world", "a small model"]
N_TOKENS = 8


async def _greedy_via_router(c: httpx.AsyncClient, url: str, model: str, min_version: int) -> list[tuple]:
    out = []
    for p in PROMPTS:
        r = await c.post(
            url + "/v1/completions",
            headers={protocol.MIN_WEIGHT_VERSION_HEADER: str(min_version)},
            json={
                "model": model,
                "prompt": p,
                "max_tokens": N_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert r.status_code == 200, r.text
        assert int(r.headers[protocol.WEIGHT_VERSION_HEADER]) >= min_version
        ch = r.json()["choices"][0]
        version = int(r.headers[protocol.WEIGHT_VERSION_HEADER])
        out.append((tuple(ch["prompt_token_ids"]), tuple(ch["token_ids"][:N_TOKENS]), version))
    return out


def _train_one_step(model_dir) -> torch.nn.Module:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    enc = tok(["zebra zebra zebra zebra zebra zebra"] * 2, return_tensors="pt")
    loss = model(**enc, labels=enc["input_ids"]).loss
    loss.backward()
    opt.step()
    return model.eval()


def _greedy_transformers(model, prompt_ids: tuple) -> tuple:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS, do_sample=False, pad_token_id=0
        )
    return tuple(out[0, len(prompt_ids) :].tolist())


async def test_rollout_after_the_switch_uses_the_weights_the_trainer_just_published(vllm_server, artifacts, tmp_path):
    engine = vllm_server.url.removeprefix("http://")
    sidecar = SidecarServer({"sampler-0": VllmBackend(vllm_server.url)}, port=0, token="t")
    await sidecar.start()
    inv = Inventory.model_validate(
        {
            "groups": [
                {
                    "group_id": "g",
                    "sleep_level_policy": "auto",
                    "samplers": [
                        {"pool": "default", "address": engine, "sidecar": f"127.0.0.1:{sidecar.port}", "job_id": "sampler-0"}
                    ],
                }
            ]
        }
    )
    orch = OrchestratorServer(inv, port=0, token="t")
    await orch.start()
    router = await start_router(artifacts, [engine], max_hold_s=120, orchestrator=f"127.0.0.1:{orch.port}", token="t")
    await asyncio.wait_for(router.gate.subscription.connected.wait(), 10)
    ts = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="g", token="t")
    model_dir = vllm_server.model_dir
    try:
        async with httpx.AsyncClient(timeout=120) as c:
            before = await _greedy_via_router(c, router.url, vllm_server.model_name, 0)
            assert {v for *_, v in before} == {0}
            await ts.acquire(timeout_sec=120)
            trained = await asyncio.to_thread(_train_one_step, model_dir)
            update = await asyncio.to_thread(save_weight_version, trained, tmp_path / "weights", 1)
            await ts.release(weights=update)
            # Sent at once: the gate holds them until the sampler serves version 1.
            after = await _greedy_via_router(c, router.url, vllm_server.model_name, 1)
        assert {v for *_, v in after} == {1}
        expected = [await asyncio.to_thread(_greedy_transformers, trained, ids) for ids, *_ in after]
        assert [toks for _, toks, _ in after] == expected, "vLLM serves exactly the published weights"
        assert [toks for _, toks, _ in after] != [toks for _, toks, _ in before], "and not version 0's"
        status = await weight_status_when(ts, "g", lambda s: s.serving_version == 1)
        assert status.serving_version == 1 and [s.in_service for s in status.samplers] == [True]
        # The engine audit reads the real engine's own label through the sidecar: version 1, awake, no fault.
        g = orch.orchestrator.groups["g"]
        readings = await orch.actions.read_engines(g.spec)
        assert readings[engine].weight_version == "1" and not readings[engine].sleeping
        assert orch.orchestrator.engine_faults(g, readings) == {}
    finally:
        await ts.close()
        await orch.stop()
        await sidecar.stop()
        await router.stop()
        await asyncio.to_thread(restore_initial_weights, vllm_server)  # the session's engine, as it was


def _train_from(model, text: str) -> torch.nn.Module:
    import torch

    """One more training step of ``model`` (in place) on ``text``; returns it in eval mode."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model.name_or_path)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    enc = tok([text] * 2, return_tensors="pt")
    model(**enc, labels=enc["input_ids"]).loss.backward()
    opt.step()
    return model.eval()


async def test_a_damaged_weight_version_leaves_the_pool_serving_the_last_good_one(vllm_server, artifacts, tmp_path):
    import torch

    """Issue 15 item 9 on real vLLM: versions 1 and 2 (a training step each) are served in turn; version 3, whose
    file is damaged after its manifest was written, is rejected at the switch back. The sampler (slept at level 2:
    weights discarded) reloads version 2 from its files and keeps serving exactly version 2's greedy tokens; the
    publisher reads the rejection in the weight status without acquiring; the next switches never retry
    version 3; version 4 is served as usual."""
    import copy

    from transformers import AutoModelForCausalLM

    engine = vllm_server.url.removeprefix("http://")
    sidecar = SidecarServer({"sampler-0": VllmBackend(vllm_server.url)}, port=0, token="t")
    await sidecar.start()
    inv = Inventory.model_validate(
        {
            "groups": [
                {
                    "group_id": "g",
                    "sleep_level_policy": "auto",
                    "samplers": [
                        {"pool": "default", "address": engine, "sidecar": f"127.0.0.1:{sidecar.port}", "job_id": "sampler-0"}
                    ],
                }
            ]
        }
    )
    orch = OrchestratorServer(inv, port=0, token="t")
    await orch.start()
    router = await start_router(artifacts, [engine], max_hold_s=120, orchestrator=f"127.0.0.1:{orch.port}", token="t")
    await asyncio.wait_for(router.gate.subscription.connected.wait(), 10)
    ts = AsyncTimeSliceOrchestratorClient(f"127.0.0.1:{orch.port}", job_id="trainer", group_id="g", token="t")
    model_dir = vllm_server.model_dir
    root = tmp_path / "weights"
    torch.manual_seed(0)
    model = await asyncio.to_thread(AutoModelForCausalLM.from_pretrained, model_dir, dtype=torch.float32)
    expected: dict[int, list] = {}
    try:
        async with httpx.AsyncClient(timeout=120) as c:
            for version, text in ((1, "zebra zebra zebra zebra"), (2, "apple banana apple banana")):
                await ts.acquire(timeout_sec=120)
                await asyncio.to_thread(_train_from, model, text)
                update = await asyncio.to_thread(save_weight_version, model, root, version)
                await ts.release(weights=update)
                served = await _greedy_via_router(c, router.url, vllm_server.model_name, version)
                expected[version] = [await asyncio.to_thread(_greedy_transformers, model, ids) for ids, *_ in served]
                assert [toks for _, toks, _ in served] == expected[version], f"version {version} served exactly"
            assert expected[1] != expected[2]
            good = copy.deepcopy(model)
            await ts.acquire(timeout_sec=120)
            await asyncio.to_thread(_train_from, model, "cherry cherry cherry cherry")
            bad = await asyncio.to_thread(save_weight_version, model, root, 3)
            shard = next(p for p in (root / "v3").iterdir() if p.suffix == ".safetensors")
            raw = bytearray(shard.read_bytes())
            raw[len(raw) // 2] ^= 0xFF  # damaged after the manifest was written
            shard.write_bytes(bytes(raw))
            await ts.release(weights=bad)
            status = await ts.weight_status("g")
            for _ in range(600):
                if status.rejected.version == 3:
                    break
                await asyncio.sleep(0.1)
                status = await ts.weight_status("g")
            assert status.rejected.version == 3 and "does not match its xxh3_128" in status.rejected.error, status
            served = await _greedy_via_router(c, router.url, vllm_server.model_name, 2)
            assert {v for *_, v in served} == {2}
            assert [toks for _, toks, _ in served] == expected[2], "the pool serves version 2's content"
            status = await ts.weight_status("g")
            assert status.serving_version == 2 and [s.in_service for s in status.samplers] == [True]
            # Not retried: a plain switch back keeps version 2 (the engine reloads it after its level-2 sleep).
            res = await ts.acquire(timeout_sec=120)
            assert "weight version 3 was rejected" in res.weight_sync_error
            await ts.release()
            served = await _greedy_via_router(c, router.url, vllm_server.model_name, 2)
            assert [toks for _, toks, _ in served] == expected[2] and {v for *_, v in served} == {2}
            # Recovery as usual: version 4 (the good weights trained once more) loads and serves.
            await ts.acquire(timeout_sec=120)
            await asyncio.to_thread(_train_from, good, "cherry cherry cherry cherry")
            update = await asyncio.to_thread(save_weight_version, good, root, 4)
            await ts.release(weights=update)
            served = await _greedy_via_router(c, router.url, vllm_server.model_name, 4)
            assert [toks for _, toks, _ in served] == [
                await asyncio.to_thread(_greedy_transformers, good, ids) for ids, *_ in served
            ]
        status = await weight_status_when(ts, "g", lambda s: s.serving_version == 4)
        assert status.serving_version == 4 and status.rejected.version == 0
    finally:
        await ts.close()
        await orch.stop()
        await sidecar.stop()
        await router.stop()
        await asyncio.to_thread(restore_initial_weights, vllm_server)
