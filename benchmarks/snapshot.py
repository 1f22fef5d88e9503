"""Trainer-state offload/restore throughput (TorchStateOffloader) vs a plain torch copy of the same bytes.

    .venv/bin/python -m benchmarks.snapshot --out snapshot.json [--params-m 32] [--cycles 6]

The trainer is a stack of Linear layers with AdamW state (parameters + gradients + two moments:
about 16 bytes per parameter in float32). Per cycle it times ``offload()`` and ``restore()``
(copy + checksum on the device + freeing / re-allocating the working storage) and, on the same
tensors in the same run (order alternating per cycle), the baseline: plain ``copy_`` into
preallocated host buffers and freeing the working storage (offload direction), fresh allocation
and ``copy_`` back (restore direction) -- the same memory traffic without the checksums. Figures: GB/s of the
first cycle (host buffers allocated then) and of the steady state (median of the later cycles),
and ``ratio_to_copy`` = offloader GB/s / plain-copy GB/s (target >= 0.9).

On a machine without CUDA the "device" is the CPU (host -> host copies); on a GPU run
``benchmarks/gpu/snapshot_gpu.py`` for pinned host <-> device figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.report import number, prepare_out
from llmd_timeslice.client.torch_offload import TorchStateOffloader, _tensors


def build_trainer(params_m: float, device: str, width: int = 2048) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, width, device=device)).pow(2).mean().backward()
    opt.step()  # creates exp_avg / exp_avg_sq
    return model, opt


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def plain_copy(tensors: list[torch.Tensor], host: list[torch.Tensor], device: str) -> tuple[float, float]:
    """The baseline on the same tensors: plain ``copy_`` out to preallocated host buffers and free the
    working storage, then allocate fresh storage and ``copy_`` back (what the offloader does, minus
    its checksums and bookkeeping). Returns seconds of (out, back); the state is left as it was."""
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for t, h in zip(tensors, host, strict=True):
            h.copy_(t.detach().reshape(-1), non_blocking=h.is_pinned())
        _sync(device)
        shapes = [(t.shape, t.device) for t in tensors]
        for t in tensors:
            t.set_(torch.empty(0, dtype=t.dtype, device=t.device))
        t1 = time.perf_counter()
        fresh = []
        for (shape, dev), t, h in zip(shapes, tensors, host, strict=True):
            f = torch.empty(shape, dtype=t.dtype, device=dev)
            f.view(-1).copy_(h, non_blocking=h.is_pinned())
            fresh.append(f)
        _sync(device)
        for t, f in zip(tensors, fresh, strict=True):
            t.set_(f)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def _ratio(rows: list[dict], mine: str, base: str) -> float:
    """Plain-copy time / offloader time, position-matched: the allocator state depends on what ran
    just before (on CPU the second fresh allocation of a cycle often page-faults), so the offloader
    running first is compared with the copy running first, and second with second; geometric mean
    of the two medians."""
    ratios = []
    for first in (True, False):
        me = [r[mine] for r in rows if r["offloader_first"] == first]
        cp = [r[base] for r in rows if r["offloader_first"] != first]
        if me and cp:
            ratios.append(statistics.median(cp) / statistics.median(me))
    return statistics.geometric_mean(ratios)


def run(params_m: float, cycles: int, device: str) -> dict:
    model, opt = build_trainer(params_m, device)
    off = TorchStateOffloader(model, opt)
    tensors = _tensors(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    host = [torch.empty(t.numel(), dtype=t.dtype, pin_memory=off.pin_memory) for t in tensors]
    rows = []
    for i in range(cycles):
        if i % 2:  # alternate the order so neither side always meets a warmer allocator
            o, r = off.offload(), off.restore()  # restore raises on a checksum mismatch
            c_off, c_res = plain_copy(tensors, host, device)
        else:
            c_off, c_res = plain_copy(tensors, host, device)
            o, r = off.offload(), off.restore()
        rows.append(
            {
                "cycle": i,
                "offloader_first": bool(i % 2),
                "offload_s": o.seconds,
                "restore_s": r.seconds,
                "copy_d2h_s": c_off,
                "copy_h2d_s": c_res,
                "host_buffers_allocated": o.allocated_buffers,
            }
        )

    def gbps(s: float) -> float:
        return nbytes / s / 1e9

    steady = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in steady) for k in ("offload_s", "restore_s", "copy_d2h_s", "copy_h2d_s")}
    first = rows[0]
    out = {
        "device": device,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "pinned": off.pin_memory,
        "state_bytes": nbytes,
        "tensors": len(tensors),
        "cycles": cycles,
        "first_cycle": {
            "offload_gbps": gbps(first["offload_s"]),
            "restore_gbps": gbps(first["restore_s"]),
            "copy_d2h_gbps": gbps(first["copy_d2h_s"]),
            "copy_h2d_gbps": gbps(first["copy_h2d_s"]),
        },
        "steady_state": {
            "offload_gbps": gbps(med["offload_s"]),
            "restore_gbps": gbps(med["restore_s"]),
            "copy_d2h_gbps": gbps(med["copy_d2h_s"]),
            "copy_h2d_gbps": gbps(med["copy_h2d_s"]),
        },
        "ratio_to_copy": {
            "offload": _ratio(steady, "offload_s", "copy_d2h_s"),
            "restore": _ratio(steady, "restore_s", "copy_h2d_s"),
        },
        "target_ratio": 0.9,
        "host_buffers_allocated_after_first_cycle": rows[0]["host_buffers_allocated"],
        "host_buffers_allocated_at_end": rows[-1]["host_buffers_allocated"],
        "rows": rows,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.snapshot", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON output file")
    ap.add_argument(
        "--params-m",
        type=number(float, 1e-6, 1e5, " million parameters"),
        default=32.0,
        help="trainer parameters, millions (state ~16 B each; rounded to whole 2048 x 2048 layers, at least one)",
    )
    ap.add_argument(
        "--cycles",
        type=number(int, 3, what=" (the first cycle, then both orders of the steady state)"),
        default=6,
        help="offload/restore cycles, >= 3 (first + steady state)",
    )
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the trainer state lives: cpu, or cuda[:N] where CUDA is available (default: cuda if available)",
    )
    a = ap.parse_args(argv)
    try:
        device = torch.device(a.device)
    except RuntimeError as exc:
        ap.error(f"--device {a.device}: {exc}")
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        ap.error(f"--device {a.device}: this machine has {'CUDA' if torch.cuda.is_available() else 'no CUDA'}; use cpu")
    prepare_out(ap, a.out, "snapshot.json")
    res = run(a.params_m, a.cycles, a.device)
    a.out.write_text(json.dumps(res, indent=2))
    f, s, r = res["first_cycle"], res["steady_state"], res["ratio_to_copy"]
    print(f"state {res['state_bytes'] / 1e9:.2f} GB on {res['device']} ({res['tensors']} tensors, pinned={res['pinned']})")
    print(
        f"first cycle : offload {f['offload_gbps']:.2f} GB/s  restore {f['restore_gbps']:.2f} GB/s  "
        f"(plain copy {f['copy_d2h_gbps']:.2f} / {f['copy_h2d_gbps']:.2f})"
    )
    print(
        f"steady state: offload {s['offload_gbps']:.2f} GB/s  restore {s['restore_gbps']:.2f} GB/s  "
        f"(plain copy {s['copy_d2h_gbps']:.2f} / {s['copy_h2d_gbps']:.2f})"
    )
    print(f"ratio_to_copy: offload {r['offload']:.2f}  restore {r['restore']:.2f}  (target >= {res['target_ratio']})")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
