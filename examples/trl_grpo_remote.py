"""TRL's GRPOTrainer with remote rollouts through the llm-d router, time-sliced on the samplers' accelerators.

    .venv/bin/llmd-timeslice up -f examples/cpu-stack.yaml                       # in one shell
    .venv/bin/python examples/trl_grpo_remote.py --max-steps 2 \\
        --model-dir examples/.llmd-timeslice/cpu/tiny-llama                         # in another

TRL (``trl`` 1.16, ``GRPOTrainer``) generates either with its own vLLM modes or with a user ``rollout_func(prompts,
trainer)`` returning ``prompt_ids``, ``completion_ids`` and ``logprobs`` (``trl/trainer/grpo_trainer.py``,
``_generate``). This example's ``rollout_func`` asks the router through the ``openai`` SDK (``TimeSliceRollouts``:
the gate's minimum-weight-version header, its refusals ridden out) for completions with their token ids and
logprobs (vLLM's ``return_token_ids`` and ``logprobs``). A ``transformers.TrainerCallback`` maps TRL's step to
the upstream phases (upstream guide, "Pattern B: trainer subclass / hooks"):

* in ``rollout_func``: ``generate`` (no lock: the router holds rollouts while the samplers sleep), then ``train``
  begins: the trainer takes the group (samplers drain and sleep, their accelerators go to the trainer);
* ``on_step_end``: ``train`` ends with the updated model in the context: it is published as weight version N+1
  and the group is yielded; the samplers wake serving N+1, which the next ``rollout_func`` asks for.

One generation per optimisation step (``steps_per_generation=1``, TRL's default with no gradient accumulation), so
every step's training runs while the group is held. Runs on CPU with the tiny Llama of the CPU stack (co-located:
trainer group = sampler group = ``rollout-group``); the upstream environment contract names them.

Router, orchestrator and token file: found as every example finds them (``llmd_timeslice/local/find_stack.py``): the
flags ``--router`` / ``--orchestrator`` / ``--token-file``, else the export line ``llmd-timeslice up`` prints
(``LLMD_TIMESLICE_ROUTER_URL``, ``TIMESLICE_ORCH_ADDR``, ``LLMD_TIMESLICE_TOKEN_FILE``), else the stack running from
``--stack``; with none it stops (exit code 2) rather than guess a port that may be another stack's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

PROMPTS = ["the cat", "a small bird", "good morning", "the river", "hello", "the engineer"]


def word_reward(completions, **_) -> list[float]:
    """Reward: how many distinct words a completion has (a stand-in for a task's verifier)."""
    texts = [c if isinstance(c, str) else " ".join(m["content"] for m in c) for c in completions]
    return [float(len(set(t.split()))) for t in texts]


def make_rollout_func(rollouts, callback, model: str = "tiny", max_tokens: int = 8):
    """TRL ``rollout_func``: completions through the router at the callback's weight version."""
    client = rollouts.openai()
    rollouts.min_weight_version = lambda: callback.weight_version
    timings: list[dict] = []

    def rollout_func(prompts: list, trainer) -> dict:
        t0 = time.monotonic()
        tok = trainer.processing_class
        texts = [
            tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) if isinstance(p, list) else p for p in prompts
        ]
        callback.on_phase_begin("generate", "sampler")
        out: dict = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "weight_version": []}
        try:
            for text in texts:
                with rollouts.rollout() as r:
                    resp = client.completions.create(
                        model=model,
                        prompt=text,
                        max_tokens=max_tokens,
                        logprobs=0,
                        extra_body={"return_token_ids": True, "add_special_tokens": False},
                    )
                ch = resp.choices[0]
                out["prompt_ids"].append(list(ch.prompt_token_ids))
                out["completion_ids"].append(list(ch.token_ids))
                out["logprobs"].append([float(x) for x in ch.logprobs.token_logprobs])
                out["weight_version"].append(r.served_weight_version)
        finally:
            callback.on_phase_end("generate", "sampler")
        t1 = time.monotonic()
        callback.on_phase_begin("train", "trainer")  # the rest of this step trains on the accelerators
        timings.append({"generate_s": round(t1 - t0, 3), "acquire_s": round(time.monotonic() - t1, 3)})
        return out

    rollout_func.timings = timings
    return rollout_func


def timeslice_trainer_callback(callback):
    """A ``transformers.TrainerCallback`` ending the ``train`` phase (publishing the model) after each step."""
    from transformers import TrainerCallback

    class TimeSliceTrainerCallback(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            callback.on_phase_end("train", "trainer", {"model": model, "rollout_id": state.global_step})

        def on_train_end(self, args, state, control, **kw):
            callback.on_phase_end("train", "trainer")  # nothing held any more, unless training stopped mid-step

    return TimeSliceTrainerCallback()


def run(
    router: str,
    model_dir: Path,
    max_steps: int = 2,
    weights_dir: Path | None = None,
    output_dir: Path | None = None,
    model: str = "tiny",
) -> dict:
    """Train ``max_steps`` GRPO steps; returns a summary (published versions, rollout records)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from llmd_timeslice.client.integrations import TimesliceCallback, TimeSliceRollouts

    cb = TimesliceCallback(weights_dir=weights_dir)
    rollouts = TimeSliceRollouts(router)
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])
    args = GRPOConfig(
        output_dir=str(output_dir or tempfile.mkdtemp(prefix="trl-grpo-")),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=max_steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
    )
    rollout_func = make_rollout_func(rollouts, cb, model)
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[word_reward],
        args=args,
        train_dataset=data,
        processing_class=tok,
        rollout_func=rollout_func,
        callbacks=[timeslice_trainer_callback(cb)],
    )
    try:
        trainer.train()
    finally:
        cb.close()
    records = rollouts.records
    return {
        "steps": trainer.state.global_step,
        "published_weight_version": cb.weight_version,
        "rollouts": len(records),
        "failed": len(rollouts.failed()),
        # Who refused the failed requests and why (the gate's reason or the llm-d EPP's dropped reason, typed):
        "refused": sorted({str(r.refusal) for r in rollouts.failed() if r.refusal is not None}),
        "below_requested": len(rollouts.below_requested()),
        "served_weight_versions": sorted({r.served_weight_version for r in records if r.served_weight_version is not None}),
        "asked_weight_versions": sorted({r.min_weight_version for r in records if r.min_weight_version is not None}),
        "steps_timing": rollout_func.timings,
        "held_ms_max": max((r.hold_ms or 0 for r in records), default=0),
    }


def main(argv: list[str] | None = None) -> int:
    from llmd_timeslice.local import find_stack

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    find_stack.add_arguments(ap, HERE / "cpu-stack.yaml")
    ap.add_argument("--model-dir", type=Path, required=True, help="the served model's directory (trained here)")
    ap.add_argument("--weights-dir", type=Path, default=Path("rl-weights"), help="where weight versions are written")
    ap.add_argument("--max-steps", type=int, default=2)
    a = ap.parse_args(argv)
    try:
        eps = find_stack.from_args(a)
    except ValueError as exc:  # StackNotFound, or an orchestrator that is not host:port
        print(f"trl_grpo_remote: {exc}", file=sys.stderr)
        return 2
    eps.export()  # the phase callback reads the upstream variables (TIMESLICE_ORCH_ADDR, ...)
    os.environ.setdefault("TIMESLICE_JOB_ID", "trainer-0")
    os.environ.setdefault("TIMESLICE_TRAINER_GROUP", "rollout-group")
    os.environ.setdefault("TIMESLICE_SAMPLER_GROUP", "rollout-group")
    summary = run(eps.router, a.model_dir, a.max_steps, a.weights_dir)
    print(summary, flush=True)
    ok = summary["steps"] == a.max_steps and not summary["failed"] and not summary["below_requested"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
