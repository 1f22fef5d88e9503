"""RL rollout benchmark: duty cycle, switch-cost breakdown and rollout request latency, with plots.

    .venv/bin/python -m benchmarks.rl_rollout --mode real --out DIR    # local stack, real vLLM on CPU (~1.5 min)
    .venv/bin/python -m benchmarks.rl_rollout --mode model --out DIR   # discrete-event model of an 8-accelerator node

``--mode real`` writes ``DIR/rl_real.json`` and ``DIR/rl_real.png`` (see :mod:`benchmarks.rl_real`).
``--mode model`` writes ``DIR/rl_model.json`` and ``DIR/rl_model.png`` (see :mod:`benchmarks.rl_model`); it
takes the figures measured here from ``DIR/rl_real.json`` when present (or ``--real-json``), otherwise from
built-in defaults measured by an earlier real run. Both print their key figures and a ratio against the
dedicated baseline computed in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _model(args) -> int:
    from benchmarks import rl_model

    real_path = Path(args.real_json) if args.real_json else args.out / "rl_real.json"
    real = json.loads(real_path.read_text()) if real_path.exists() else None
    inp = rl_model.with_measured(rl_model.default_inputs(), real)
    t = time.perf_counter()
    report = rl_model.build_report(inp, real, str(real_path) if real else None, do_sweep=not args.no_sweep)
    args.out.mkdir(parents=True, exist_ok=True)
    rl_model.plot_model(args.out / "rl_model.png", report)
    for res in report["scenarios"]["default"]["results"].values():
        res.pop("trace", None)
    (args.out / "rl_model.json").write_text(json.dumps(report, indent=1))
    rl_model.print_report(report)
    print(f"measured-here inputs from: {report['provenance']['measured_here_from']}")
    print(f"wrote {args.out / 'rl_model.json'} and {args.out / 'rl_model.png'} ({time.perf_counter() - t:.1f} s)")
    return 0


def _real(args) -> int:
    from benchmarks.rl_real import run_real

    t = time.monotonic()
    result = run_real(
        args.out,
        iterations=args.iterations,
        batch=args.batch,
        train_steps=args.train_steps,
        max_tokens=args.max_tokens,
        log=lambda m: print(m, flush=True),
    )
    s = result["summary"]
    m = s["median_s"]
    print(
        f"real run ({time.monotonic() - t:.0f} s): {s['iterations']} iterations, {s['requests_sent']} requests, "
        f"{s['requests_failed']} failed, {s['rollout_requests_held']} held (hold p50 {s['hold_ms_p50']:.0f} ms, "
        f"max {s['hold_ms_max']} ms)"
    )
    print("median per iteration: " + ", ".join(f"{k[:-2]} {v * 1000:.0f} ms" for k, v in m.items() if v is not None))
    print(
        f"rollout latency p50/p99 {s['rollout_latency_s_p50']:.2f}/{s['rollout_latency_s_p99']:.2f} s "
        f"(dedicated baseline {s['dedicated_rollout_latency_s_p50']:.2f}/{s['dedicated_rollout_latency_s_p99']:.2f} s)"
    )
    print(
        f"iteration {s['iteration_s_mean']:.2f} s vs dedicated {s['dedicated_iteration_s']:.2f} s "
        f"({s['iteration_vs_dedicated']:.2f}x); training phase {s['train_s_vs_dedicated']:.2f}x dedicated; "
        f"useful {s['useful_fraction']:.1%}, switch {s['switch_fraction']:.1%} of the time-sliced iterations"
    )
    bulk = s["bulk_state"]
    print(
        f"trainer state {s['trainer_state_bytes'] / 1e6:.1f} MB: offload {s['offload_gbps_cpu']:.2f} GB/s, restore "
        f"{s['restore_gbps_cpu']:.2f} GB/s (CPU, checksum included), host buffers allocated {s['host_buffers_allocated']}; "
        f"{bulk['trainer_state_bytes'] / 1e9:.2f} GB of state on this CPU: offload {bulk['offload_gbps']:.2f} GB/s, "
        f"restore {bulk['restore_gbps']:.2f} GB/s, checksum alone {bulk['checksum_gbps']:.2f} GB/s"
    )
    print(f"wrote {args.out / 'rl_real.json'} and {args.out / 'rl_real.png'}")
    return 0 if s["requests_failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rl_rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("real", "model"), required=True)
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--iterations", type=int, default=4, help="real: time-sliced iterations (after 1 dedicated)")
    p.add_argument("--batch", type=int, default=16, help="real: rollout requests per iteration")
    p.add_argument("--train-steps", type=int, default=8, help="real: optimizer steps per training phase")
    p.add_argument("--max-tokens", type=int, default=16, help="real: tokens per rollout completion")
    p.add_argument("--real-json", help="model: rl_real.json to take the measured figures from (default OUT/rl_real.json)")
    p.add_argument("--no-sweep", action="store_true", help="model: skip the model-size x ratio sweep")
    args = p.parse_args(argv)
    return _real(args) if args.mode == "real" else _model(args)


if __name__ == "__main__":
    sys.exit(main())
