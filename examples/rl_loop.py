"""A short GRPO-style RL loop against a running stack, using only the public client API.

    .venv/bin/llmd-timeslice up -f examples/cpu-stack.yaml            # in one shell
    .venv/bin/python examples/rl_loop.py --iterations 2                # in another

Per iteration: a rollout batch through the router (asking for the latest weight version), then the
trainer acquires the sampler group (samplers drain and sleep), trains, and yields. With ``--model-dir``
(a Hugging Face model directory, e.g. the stack's ``.llmd-timeslice/cpu/tiny-llama``) it really trains
that model one step with ``transformers`` and publishes the new weights as version N+1, which the
samplers load before serving again; without it, training is a sleep (``--step-s``, default 1 s) and no version is
published.

Router, orchestrator and token file: the flags, else the variables of the export line ``up`` prints
(``LLMD_TIMESLICE_ROUTER_URL``, ``TIMESLICE_ORCH_ADDR``, ``LLMD_TIMESLICE_TOKEN_FILE``), else the running stack
of ``--stack`` (default: the CPU example next to this script, via its ``stack.json``). With none of them it
stops (exit code 2) rather than guess a port that may be another stack's on a shared node. Exit code 0 when
every rollout request completed at the version it asked for.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx

from llmd_timeslice.client import TimeSliceError, TimeSliceOrchestratorClient
from llmd_timeslice.client.integrations import TimeSliceRollouts
from llmd_timeslice.local import find_stack
from llmd_timeslice.weights.manifest import save_weight_version

HERE = Path(__file__).resolve().parent

PROMPTS = ["the quick brown fox", "once upon a time", "hello world", "a small model"]


def rollout(router: str, model: str, min_version: int) -> list[dict]:
    """One batch through the router, asking for ``min_version``. ``TimeSliceRollouts``' client rides out the gate's
    refusals and the llm-d EPP's "wait" answers (a queue TTL that ran out, an empty pool) within its budget, and
    returns any other refusal at once, typed: each entry's ``refusal`` names who refused it and why."""
    rollouts = TimeSliceRollouts(router, min_weight_version=min_version, timeout_s=300)
    out = []
    with rollouts.http_client() as c:
        for p in PROMPTS:
            r = c.post(f"{rollouts.router_url}/v1/completions", json={"model": model, "prompt": p, "max_tokens": 8})
            refusal = rollouts.records[-1].refusal
            out.append(
                {
                    "status": r.status_code,
                    "text": r.json()["choices"][0]["text"] if r.status_code == 200 else r.text,
                    "weight_version": int(r.headers.get("x-llmd-timeslice-weight-version", -1)),
                    "refusal": str(refusal) if refusal is not None else None,
                }
            )
    return out


def train_step(model_dir: Path | None, state: dict, step_s: float = 1.0) -> None:
    if model_dir is None:
        time.sleep(step_s)  # stands in for a training step
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if "model" not in state:
        state["tok"] = AutoTokenizer.from_pretrained(model_dir)
        state["model"] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        state["opt"] = torch.optim.AdamW(state["model"].parameters(), lr=1e-3)
    enc = state["tok"](PROMPTS, return_tensors="pt", padding=True)
    loss = state["model"](**enc, labels=enc["input_ids"]).loss
    loss.backward()
    state["opt"].step()
    state["opt"].zero_grad()


def _versions(client: TimeSliceOrchestratorClient, group: str, weights_dir: Path) -> tuple[int, int]:
    """(the weight version the group serves, the next version to publish): the next one is newer than every version
    the group knows (serving, pending or rejected: the orchestrator refuses a version not newer than its latest) and
    than every ``v<N>`` already in ``weights_dir`` (published versions are immutable), so the loop can run again."""
    status = client.weight_status(group)
    known = [status.serving_version, status.pending.version, status.rejected.version]
    on_disk = [int(p.name[1:]) for p in weights_dir.glob("v*") if p.name[1:].isdigit()] if weights_dir.is_dir() else []
    return status.serving_version, max(known + on_disk) + 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    find_stack.add_arguments(ap, HERE / "cpu-stack.yaml")
    ap.add_argument("--job-id", default="trainer-0")
    ap.add_argument("--group", default="rollout-group", help="the sampler group the trainer time-slices with")
    ap.add_argument("--model", default="tiny", help="served model name")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--model-dir", type=Path, help="train this model for real and publish its weights")
    ap.add_argument("--weights-dir", type=Path, default=Path("rl-weights"), help="where weight versions are written")
    ap.add_argument("--step-s", type=float, default=1.0, help="without --model-dir: seconds the stand-in training step sleeps")
    a = ap.parse_args(argv)
    try:
        eps = find_stack.from_args(a)
    except ValueError as exc:  # StackNotFound, or an orchestrator that is not host:port
        print(f"rl_loop: {exc}", file=sys.stderr)
        return 2
    a.router, a.orchestrator, a.token_file = eps.router, eps.orchestrator, eps.token_file
    try:
        client = TimeSliceOrchestratorClient(
            a.orchestrator, job_id=a.job_id, group_id=a.group, token_file=a.token_file, token_file_source=eps.token_source
        )
    except (OSError, ValueError) as exc:
        print(f"rl_loop: token file: {exc}", file=sys.stderr)
        return 2
    state, ok = {}, True
    try:
        version, next_version = _versions(client, a.group, a.weights_dir)
        for it in range(a.iterations):
            recs = rollout(a.router, a.model, version)
            served = sorted({r["weight_version"] for r in recs})
            good = all(r["status"] == 200 and r["weight_version"] >= version for r in recs)
            ok &= good
            print(
                f"iteration {it}: rollout {sum(r['status'] == 200 for r in recs)}/{len(recs)} ok at weight "
                f"version(s) {served} (asked >= {version})",
                flush=True,
            )
            for r in recs:
                if r["refusal"]:
                    print(f"  refused: {r['refusal']}", flush=True)
            t = time.monotonic()
            res = client.acquire(timeout_sec=300)
            print(
                f"  acquired the group in {(time.monotonic() - t) * 1000:.0f} ms"
                + (f"; last weight sync failed: {res.weight_sync_error}" if res.weight_sync_error else ""),
                flush=True,
            )
            weights = None
            try:
                train_step(a.model_dir, state, a.step_s)
                if a.model_dir is not None:
                    weights = save_weight_version(state["model"], a.weights_dir, next_version)
            except BaseException:
                client.release()  # yield before failing: the samplers wake instead of waiting out the lease
                raise
            if weights is not None:
                version, next_version = next_version, next_version + 1
            client.release(weights=weights)
            print(f"  trained; yielded{f' with weight version {version}' if weights else ''}", flush=True)
        recs = rollout(a.router, a.model, version)
        ok &= all(r["status"] == 200 and r["weight_version"] >= version for r in recs)
        print(f"final rollout at weight version(s) {sorted({r['weight_version'] for r in recs})}", flush=True)
    except httpx.TransportError as exc:
        print(f"rl_loop: router {a.router}: {exc}: is the stack up? (`llmd-timeslice status -f FILE`)", file=sys.stderr)
        return 1
    except (TimeSliceError, httpx.HTTPError, OSError) as exc:
        print(f"rl_loop: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
