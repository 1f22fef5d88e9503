"""A verifiers-based GRPO loop, time-sliced: rollouts through the router, training on the samplers' accelerators.

    .venv/bin/llmd-timeslice up -f examples/cpu-stack.yaml                       # in one shell
    .venv/bin/python examples/verifiers_grpo.py --iterations 2 \\
        --model-dir examples/.llmd-timeslice/cpu/tiny-llama                         # in another

What a verifiers-based trainer changes to run behind the llm-d router (docs/integrations.md):

* the environment's client: ``verifiers_client(TimeSliceRollouts(router))`` instead of ``AsyncOpenAI(base_url=...)``;
  every rollout then asks the gate for the weight version the trainer published last, rides out the gate's
  refusals while the samplers train, and reports the version that served it;
* the phase callback around the loop's phases (``AsyncTimesliceCallback``; upstream's names): ``generate`` takes
  no lock (the router holds rollouts while the samplers sleep); ``train`` takes the group (samplers drain and
  sleep, the trainer gets their accelerators); ending ``train`` with the trained model publishes it as weight
  version N+1, and the samplers wake serving it.

The environment is a classic ``vf.SingleTurnEnv`` (verifiers 0.3.x) with a rubric; the update is a REINFORCE step
with group-normalised advantages (GRPO without clipping) on the tiny Llama, with ``transformers`` on CPU. The
group and the job come from the upstream environment contract (``TIMESLICE_JOB_ID``, ``TIMESLICE_ORCH_ADDR``,
``TIMESLICE_TRAINER_GROUP``, ``TIMESLICE_SAMPLER_GROUP``); defaults point at the running CPU stack, co-located
(trainer group = sampler group = ``rollout-group``). Exit code 0 when every rollout completed at the version it
asked for.

Router, orchestrator and token file: found as every example finds them (``llmd_timeslice/local/find_stack.py``): the
flags ``--router`` / ``--orchestrator`` / ``--token-file``, else the export line ``llmd-timeslice up`` prints
(``LLMD_TIMESLICE_ROUTER_URL``, ``TIMESLICE_ORCH_ADDR``, ``LLMD_TIMESLICE_TOKEN_FILE``), else the stack running from
``--stack``; with none it stops (exit code 2) rather than guess a port that may be another stack's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

TASKS = [
    ("Repeat: the cat sleeps", "the cat sleeps"),
    ("Repeat: hello world", "hello world"),
    ("Repeat: good morning", "good morning"),
    ("Repeat: the river waits", "the river waits"),
]


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return " ".join(_text(p.get("text", "") if isinstance(p, dict) else getattr(p, "text", "")) for p in content or [])


def _messages(msgs) -> list[dict]:
    """verifiers messages (dicts or pydantic models) as plain ``{"role", "content"}`` dicts."""
    out = []
    for m in msgs or []:
        role = m["role"] if isinstance(m, dict) else m.role
        content = m.get("content") if isinstance(m, dict) else m.content
        out.append({"role": role, "content": _text(content)})
    return out


def overlap_reward(completion, answer, **_) -> float:
    """Fraction of the answer's words that the completion contains (0..1)."""
    said = set(" ".join(m["content"] for m in _messages(completion)).lower().split())
    want = answer.lower().split()
    return sum(w in said for w in want) / len(want)


def build_env():
    """The classic verifiers environment of this example (a dataset of 'repeat after me' tasks)."""
    import verifiers as vf
    from datasets import Dataset

    data = Dataset.from_list([{"question": q, "answer": a} for q, a in TASKS])
    return vf.SingleTurnEnv(eval_dataset=data, rubric=vf.Rubric(funcs=[overlap_reward]))


class Policy:
    """The trainer's copy of the model: REINFORCE with group-normalised advantages."""

    def __init__(self, model_dir: Path, lr: float = 1e-3) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def step(self, outputs: list[dict]) -> float:
        """One update from verifiers rollout outputs (prompt, completion, reward, example_id); returns the loss."""
        torch = self.torch
        groups: dict = {}
        for o in outputs:
            groups.setdefault(o["example_id"], []).append(o["reward"] or 0.0)
        losses = []
        for o in outputs:
            rewards = groups[o["example_id"]]
            adv = (o["reward"] or 0.0) - sum(rewards) / len(rewards)
            prompt = self.tok.apply_chat_template(_messages(o["prompt"]), add_generation_prompt=True, tokenize=False)
            p_ids = self.tok(prompt, add_special_tokens=False).input_ids
            c_ids = self.tok(" ".join(m["content"] for m in _messages(o["completion"])), add_special_tokens=False).input_ids
            if not c_ids:
                continue
            ids = torch.tensor([p_ids + c_ids])
            logits = self.model(ids).logits[0, len(p_ids) - 1 : -1]
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c_ids)[:, None]).sum()
            losses.append(-(adv if adv else 1e-3) * logp)  # a tiny push even when a group's rewards tie
        loss = torch.stack(losses).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return float(loss.detach())


async def run(
    router: str,
    model_dir: Path,
    iterations: int = 2,
    rollouts_per_example: int = 2,
    model: str = "tiny",
    max_tokens: int = 8,
    weights_dir: Path | None = None,
) -> dict:
    """The loop; returns a summary (per iteration: rollouts, failures, served versions, asked version)."""
    from llmd_timeslice.client.integrations import AsyncTimesliceCallback, TimeSliceRollouts
    from llmd_timeslice.client.integrations.verifiers import verifiers_client

    env = build_env()
    cb = await AsyncTimesliceCallback.from_env(weights_dir=weights_dir)
    rollouts = TimeSliceRollouts(router, min_weight_version=lambda: cb.weight_version)
    client = verifiers_client(rollouts, api="chat")
    policy = await asyncio.to_thread(Policy, model_dir)
    summary: dict = {"iterations": []}
    try:
        for it in range(iterations + 1):  # the last round only rolls out (with the last published version)
            asked = cb.weight_version
            await cb.on_phase_begin("generate", "sampler", {"rollout_id": it})
            res = await env.evaluate(
                client=client,
                model=model,
                sampling_args={"max_tokens": max_tokens},
                rollouts_per_example=rollouts_per_example,
                state_columns=["trajectory_id"],
                on_progress=lambda *a, **k: None,
            )
            await cb.on_phase_end("generate", "sampler", {"rollout_id": it})
            outputs = res["outputs"]
            per_rollout = rollouts.by_rollout()
            served = {
                o["trajectory_id"]: min(
                    (
                        r.served_weight_version if r.served_weight_version is not None else -1
                        for r in per_rollout.get(o["trajectory_id"], [])
                    ),
                    default=-1,
                )
                for o in outputs
            }
            row = {
                "iteration": it,
                "asked_weight_version": asked,
                "rollouts": len(outputs),
                "failed": sum(1 for o in outputs if o.get("error")),
                "served_weight_versions": sorted(set(served.values())),
                "below_asked": sum(1 for v in served.values() if v < asked),
                "mean_reward": sum(o["reward"] or 0.0 for o in outputs) / max(1, len(outputs)),
            }
            if it < iterations:
                await cb.on_phase_begin("train", "trainer", {"rollout_id": it})
                row["loss"] = await asyncio.to_thread(policy.step, outputs)
                await cb.on_phase_end("train", "trainer", {"rollout_id": it, "model": policy.model})
                row["published_weight_version"] = cb.weight_version
            summary["iterations"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        await cb.close()
        await client.close()
    summary["failed_requests"] = len(rollouts.failed())
    # Who refused the failed requests and why (the gate's reason or the llm-d EPP's dropped reason, typed).
    summary["refused"] = sorted({str(r.refusal) for r in rollouts.failed() if r.refusal is not None})
    summary["below_requested"] = len(rollouts.below_requested())
    summary["ok"] = (
        not summary["failed_requests"]
        and not summary["below_requested"]
        and all(not r["failed"] and not r["below_asked"] for r in summary["iterations"])
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    from llmd_timeslice.local import find_stack

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    find_stack.add_arguments(ap, HERE / "cpu-stack.yaml")
    ap.add_argument("--model-dir", type=Path, required=True, help="the served model's directory (trained here)")
    ap.add_argument("--weights-dir", type=Path, default=Path("rl-weights"), help="where weight versions are written")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--rollouts-per-example", type=int, default=2)
    ap.add_argument("--model", default="tiny", help="served model name")
    a = ap.parse_args(argv)
    try:
        eps = find_stack.from_args(a)
    except ValueError as exc:  # StackNotFound, or an orchestrator that is not host:port
        print(f"verifiers_grpo: {exc}", file=sys.stderr)
        return 2
    eps.export()  # the phase callback reads the upstream variables (TIMESLICE_ORCH_ADDR, ...)
    os.environ.setdefault("TIMESLICE_JOB_ID", "trainer-0")
    os.environ.setdefault("TIMESLICE_TRAINER_GROUP", "rollout-group")
    os.environ.setdefault("TIMESLICE_SAMPLER_GROUP", "rollout-group")
    router = eps.router
    summary = asyncio.run(run(router, a.model_dir, a.iterations, a.rollouts_per_example, a.model, weights_dir=a.weights_dir))
    print(
        f"verifiers_grpo: {'ok' if summary['ok'] else 'FAILED'}: {summary['failed_requests']} failed requests, "
        f"{summary['below_requested']} served below the version asked for"
        + "".join(f"\n  refused: {why}" for why in summary.get("refused", [])),
        flush=True,
    )
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
