"""Control-plane overhead of a phase switch, with instantaneous (no-op) switch actions.

Measures, over real gRPC on loopback, the time from the holder's ``Yield`` call to the moment the
next job's blocked ``Acquire`` returns, for 2 and 20 contending jobs, and switches per second.
Baseline measured in the same run: one plain unary round-trip (``ListGroups``) on the same channel.

    .venv/bin/python -m benchmarks.phase_switch --out phase_switch.json

With ``--engines vllm`` it measures the whole switch on real vLLM CPU engines against the engines' own sleep and
wake instead (:mod:`benchmarks.switch_vs_engine`; ``--vllm-engines N``, ``--rounds R``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from pathlib import Path

from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.orchestrator.switch import SwitchActions


class NoOpActions(SwitchActions):
    async def suspend_samplers(self, spec, record) -> None:
        return None

    async def resume_samplers(self, spec, record) -> None:
        return None


def _pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def _start_server() -> tuple[OrchestratorServer, asyncio.AbstractEventLoop]:
    inv = Inventory.model_validate({"groups": [{"group_id": "g"}]})
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    srv = OrchestratorServer(inv, port=0, actions=NoOpActions(), token="bench")
    asyncio.run_coroutine_threadsafe(srv.start(), loop).result(30)
    return srv, loop


async def _run(target: str, jobs: int, switches: int) -> dict:
    clients = [AsyncTimeSliceOrchestratorClient(target, job_id=f"job-{i}", group_id="g", token="bench") for i in range(jobs)]
    yielded_at: list[float] = []
    overheads: list[float] = []
    done = asyncio.Event()
    count = 0

    async def worker(c: AsyncTimeSliceOrchestratorClient) -> None:
        nonlocal count
        while not done.is_set():
            await c.acquire(timeout_sec=60)
            t = time.perf_counter()
            if yielded_at and not done.is_set():
                overheads.append(t - yielded_at[-1])
            count += 1
            if count >= switches:
                done.set()
            yielded_at.append(time.perf_counter())
            await c.release()  # always: the group must be free for the next configuration

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(worker(c)) for c in clients]
    await done.wait()
    wall = time.perf_counter() - t0
    await asyncio.gather(*tasks)  # queued workers get one more grant each, then release and stop
    for c in clients:
        await c.close()
    # The first grants happen with nobody yielding; measured overheads start once the queue is full.
    steady = overheads[jobs:] or overheads
    return {
        "jobs": jobs,
        "switches": count,
        "control_overhead_ms_p50": _pct(steady, 50) * 1000,
        "control_overhead_ms_p99": _pct(steady, 99) * 1000,
        "switches_per_s": count / wall,
    }


async def _baseline(target: str, n: int = 300) -> float:
    from llmd_timeslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as pb

    c = AsyncTimeSliceOrchestratorClient(target, job_id="b", group_id="g", token="bench")
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        await c._stub.ListGroups(pb.ListGroupsRequest())
        lat.append(time.perf_counter() - t)
    await c.close()
    return _pct(lat, 50) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write.")
    ap.add_argument("--switches", type=int, default=500, help="Switches per configuration.")
    ap.add_argument(
        "--engines", choices=("noop", "vllm"), default="noop", help="noop: control overhead; vllm: benchmarks.switch_vs_engine"
    )
    ap.add_argument("--vllm-engines", type=int, default=2, help="with --engines vllm: real vLLM CPU engines")
    ap.add_argument("--rounds", type=int, default=8, help="with --engines vllm: switches to the trainer and back")
    args = ap.parse_args()
    if args.engines == "vllm":
        from benchmarks import switch_vs_engine

        switch_vs_engine.main(["--out", str(args.out), "--engines", str(args.vllm_engines), "--rounds", str(args.rounds)])
        return
    srv, loop = _start_server()
    target = f"127.0.0.1:{srv.port}"
    base_ms = asyncio.run(_baseline(target))
    runs = [asyncio.run(_run(target, jobs, args.switches)) for jobs in (2, 20)]
    asyncio.run_coroutine_threadsafe(srv.stop(), loop).result(30)
    result = {
        "control_overhead_ms_p50": runs[0]["control_overhead_ms_p50"],
        "control_overhead_ms_p99": runs[0]["control_overhead_ms_p99"],
        "switches_per_s": runs[0]["switches_per_s"],
        "grpc_roundtrip_ms_p50": base_ms,
        "ratio_to_grpc_roundtrip": runs[0]["control_overhead_ms_p50"] / base_ms,
        "runs": runs,
        "measured_here": True,
        "note": "No-op switch actions: this is the orchestrator's own cost (gRPC + FIFO + driver), not drain or sleep.",
    }
    args.out.write_text(json.dumps(result, indent=1))
    for r in runs:
        print(
            f"{r['jobs']:>3} jobs: p50 {r['control_overhead_ms_p50']:.2f} ms, p99 {r['control_overhead_ms_p99']:.2f} ms, "
            f"{r['switches_per_s']:.0f} switches/s"
        )
    print(f"baseline gRPC round-trip p50 {base_ms:.2f} ms; switch overhead = {result['ratio_to_grpc_roundtrip']:.1f}x it")


if __name__ == "__main__":
    main()
