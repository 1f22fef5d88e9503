"""Rollouts by clients nobody here wrote, through real Envoy + gate + vLLM on CPU, while a trainer time-slices.

One stack for the module: the session's real vLLM (tiny Llama, with its chat template), its snapshot sidecar, the
orchestrator (group ``rollout``, the trainer co-located on the sampler: trainer group = sampler group) and the
router (Envoy, gate subscribed to the orchestrator, picker). The trainer side is the upstream-compatible
``TimesliceCallback`` (env contract), training the tiny model for real with ``transformers`` and publishing each
step as the next weight version. Checked for the official ``openai`` SDK (sync and async, streaming and not,
completions and chat), a ``verifiers`` environment (examples/verifiers_grpo.py) and TRL's ``GRPOTrainer`` with a
remote ``rollout_func`` (examples/trl_grpo_remote.py), each across two training phases: every rollout completes
and none is answered by an older weight version than it asked for.
"""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
import threading
from pathlib import Path

import pytest

from llmd_timeslice.client.integrations import TimesliceCallback, TimeSliceRollouts
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.server import SidecarServer
from tests.conftest import LoopThread
from tests.support.artifacts import ARTIFACTS
from tests.support.router import start_router
from tests.support.vllm import restore_initial_weights

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
TOKEN = "integrations-token"
GROUP = "rollout"


@pytest.fixture(scope="module")
def stack(vllm_server, tmp_path_factory):
    lt = LoopThread()
    engine = vllm_server.url.removeprefix("http://")
    sidecar = SidecarServer({"sampler-0": VllmBackend(vllm_server.url)}, port=0, token=TOKEN)
    lt.run(sidecar.start())
    inv = Inventory.model_validate(
        {
            "groups": [
                {
                    "group_id": GROUP,
                    "sleep_level_policy": "auto",
                    "samplers": [
                        {"pool": "default", "address": engine, "sidecar": f"127.0.0.1:{sidecar.port}", "job_id": "sampler-0"}
                    ],
                }
            ]
        }
    )
    orch = OrchestratorServer(inv, port=0, token=TOKEN)
    lt.run(orch.start())
    workdir = ARTIFACTS / "integrations-router"
    workdir.mkdir(parents=True, exist_ok=True)
    router = lt.run(start_router(workdir, [engine], max_hold_s=60, orchestrator=f"127.0.0.1:{orch.port}", token=TOKEN))
    lt.run(asyncio.wait_for(router.gate.subscription.connected.wait(), 10))
    model_dir = tmp_path_factory.mktemp("trainer") / "model"  # the trainer's own copy of the initial weights
    shutil.copytree(vllm_server.model_dir, model_dir)
    ns = type("Stack", (), {})()
    ns.router_url, ns.orchestrator, ns.model_dir, ns.model = router.url, f"127.0.0.1:{orch.port}", model_dir, "tiny"
    try:
        yield ns
    finally:
        lt.run(router.stop())
        lt.run(orch.stop())
        lt.run(sidecar.stop())
        lt.close()
        restore_initial_weights(vllm_server)  # the session's engine, as it was before the training steps


@pytest.fixture
def env(monkeypatch, stack, tmp_path):
    monkeypatch.setenv("TIMESLICE_JOB_ID", "trainer-0")
    monkeypatch.setenv("TIMESLICE_ORCH_ADDR", stack.orchestrator)
    monkeypatch.setenv("TIMESLICE_TRAINER_GROUP", GROUP)
    monkeypatch.setenv("TIMESLICE_SAMPLER_GROUP", GROUP)
    monkeypatch.setenv("LLMD_TIMESLICE_TOKEN", TOKEN)
    monkeypatch.setenv("LLMD_TIMESLICE_WEIGHTS_DIR", str(tmp_path / "weights"))
    return monkeypatch


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", REPO / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _train_step(state: dict, model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if "model" not in state:
        state["tok"] = AutoTokenizer.from_pretrained(model_dir)
        state["model"] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        state["opt"] = torch.optim.AdamW(state["model"].parameters(), lr=1e-2)
    enc = state["tok"](["the cat sleeps", "hello world"], return_tensors="pt", padding=True)
    loss = state["model"](**enc, labels=enc["input_ids"]).loss
    loss.backward()
    state["opt"].step()
    state["opt"].zero_grad()
    return state["model"]


def _every_kind(rollouts: TimeSliceRollouts, sync, model: str, tag: str) -> list[str]:
    """One rollout of each kind: {sync, async} x {completions, chat} x {stream, not}; returns their texts."""
    msgs = [{"role": "user", "content": "hello world"}]
    texts: list[str] = []

    def sync_kinds() -> None:
        for stream in (False, True):
            with rollouts.rollout(f"{tag}-sync-completions-{stream}"):
                r = sync.completions.create(model=model, prompt="the quick brown fox", max_tokens=6, stream=stream)
                texts.append("".join(c.choices[0].text for c in r) if stream else r.choices[0].text)
            with rollouts.rollout(f"{tag}-sync-chat-{stream}"):
                r = sync.chat.completions.create(model=model, messages=msgs, max_tokens=6, stream=stream)
                texts.append(
                    "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream else r.choices[0].message.content
                )

    async def async_kinds() -> None:
        aio = rollouts.async_openai()  # an asyncio client belongs to its event loop: one per asyncio.run

        async def one(kind: str, stream: bool) -> str:
            with rollouts.rollout(f"{tag}-async-{kind}-{stream}"):
                if kind == "completions":
                    r = await aio.completions.create(model=model, prompt="once upon a time", max_tokens=6, stream=stream)
                    return "".join([c.choices[0].text async for c in r]) if stream else r.choices[0].text
                r = await aio.chat.completions.create(model=model, messages=msgs, max_tokens=6, stream=stream)
                if stream:
                    return "".join([c.choices[0].delta.content or "" async for c in r if c.choices])
                return r.choices[0].message.content

        texts.extend(await asyncio.gather(*(one(k, s) for k in ("completions", "chat") for s in (False, True))))
        await aio.close()

    t = threading.Thread(target=sync_kinds)
    t.start()
    asyncio.run(async_kinds())
    t.join()
    return texts


def test_openai_sdk_rollouts_across_two_training_phases_are_never_older_than_asked(stack, env):
    import openai

    from llmd_timeslice import protocol

    cb = TimesliceCallback()  # the upstream environment contract
    assert cb.locks.router_mode
    base = cb.weight_version
    rollouts = TimeSliceRollouts(stack.router_url, min_weight_version=lambda: cb.weight_version)
    sync = rollouts.openai()
    state: dict = {}
    try:
        for it in range(2):
            cb.on_phase_begin("generate", "sampler", {"rollout_id": it})
            texts = _every_kind(rollouts, sync, stack.model, f"it{it}")
            cb.on_phase_end("generate", "sampler", {"rollout_id": it})
            assert len(texts) == 8 and all(isinstance(t, str) for t in texts)
            cb.on_phase_begin("train", "trainer", {"rollout_id": it})
            # The samplers sleep now: rollouts for the next version wait at the gate, not on a sleeping engine.
            nxt = base + it + 1
            held: list = []

            def send_early(n: int = nxt, out: list = held) -> None:
                early = openai.OpenAI(base_url=rollouts.base_url, api_key="x", max_retries=0, http_client=rollouts.http_client())
                out.append(
                    early.with_raw_response.completions.create(
                        model=stack.model,
                        prompt="held while training",
                        max_tokens=4,
                        extra_headers={protocol.MIN_WEIGHT_VERSION_HEADER: str(n)},
                    )
                )

            waiter = threading.Thread(target=send_early)
            waiter.start()
            model = _train_step(state, stack.model_dir)
            cb.on_phase_end("train", "trainer", {"rollout_id": it, "model": model})
            assert cb.weight_version == nxt
            waiter.join(120)
            (raw,) = held
            assert int(raw.headers[protocol.WEIGHT_VERSION_HEADER]) == nxt and int(raw.headers[protocol.HOLD_MS_HEADER]) > 0
        _every_kind(rollouts, sync, stack.model, "final")
    finally:
        cb.close()
    assert not rollouts.failed(), [r for r in rollouts.failed()]
    assert not rollouts.below_requested(), rollouts.below_requested()
    by = rollouts.by_rollout()
    assert {r.served_weight_version for name, recs in by.items() if name and name.startswith("final") for r in recs} == {
        base + 2
    }, "after two training phases every rollout is served by the second published version"
    assert {r.served_weight_version for name, recs in by.items() if name and name.startswith("it1") for r in recs} == {base + 1}
    assert len([n for n in by if n]) == 24, "8 kinds x 3 rounds, each recorded under its rollout"


def test_verifiers_environment_rollouts_across_two_training_phases(stack, env, tmp_path):
    mod = _example("verifiers_grpo")
    summary = asyncio.run(mod.run(stack.router_url, stack.model_dir, iterations=2, rollouts_per_example=2, model=stack.model))
    its = summary["iterations"]
    assert summary["ok"], summary
    assert [r["rollouts"] for r in its] == [8, 8, 8] and all(r["failed"] == 0 for r in its)
    base = its[0]["asked_weight_version"]
    assert [r["served_weight_versions"] for r in its] == [[base], [base + 1], [base + 2]]
    assert [r["published_weight_version"] for r in its[:2]] == [base + 1, base + 2]


def test_trl_grpo_trainer_with_a_remote_rollout_func_across_two_steps(stack, env, tmp_path):
    mod = _example("trl_grpo_remote")
    summary = mod.run(stack.router_url, stack.model_dir, max_steps=2, output_dir=tmp_path / "out", model=stack.model)
    assert summary["steps"] == 2 and summary["failed"] == 0 and summary["below_requested"] == 0, summary
    base = summary["asked_weight_versions"][0]
    assert summary["asked_weight_versions"] == [base, base + 1] == summary["served_weight_versions"]
    assert summary["published_weight_version"] == base + 2
