"""Snapshot figures on a GPU: pinned host <-> device GB/s and TorchStateOffloader round trips.

    .venv/bin/python -m benchmarks.gpu.snapshot_gpu --out snapshot_gpu.json [--gb 4] [--params-m 500]

Measures, in one run (about 1-3 min on one H100/H200-class GPU with the defaults):

1. raw copy bandwidth with CUDA events: device -> pinned host, pinned host -> device, and
   device -> pageable host for contrast (``--gb`` GiB buffer, median of ``--reps``);
2. the offloader on a trainer of ``--params-m`` million parameters with AdamW state (~16 B per
   parameter): first cycle (pinned buffers allocated) and steady state, GB/s, ``ratio_to_copy``
   against a plain pinned copy of the same tensors (same as ``benchmarks.snapshot``), device memory
   freed by an offload (``torch.cuda.memory_allocated``), and a restore checksum check on every cycle
   (``restore()`` raises on a mismatch; the result records ``checksum_ok``);
3. the device memory an offload gives back to the driver (issue 15, item 6): after a training step
   (activations and gradients pass through PyTorch's caching allocator), offload with the cache released
   (the default) and, as the baseline in the same run, without; reports ``torch.cuda.memory_reserved()``
   and the driver's free memory (``torch.cuda.mem_get_info``, what another process such as a waking
   sampler can get) against the free memory before the trainer existed. Pass: reserved after the
   offload <= ``--max-reserved-mib`` (default 64 MiB) and the driver got back all but that much.

Without CUDA it prints why and exits 0, writing ``{"skipped": reason}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def copy_bandwidth(gib: float, reps: int) -> dict:
    n = int(gib * (1 << 30))
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.fill_(7)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8)
    out = {}
    for name, dst, src in (("d2h_pinned", pinned, dev), ("h2d_pinned", dev, pinned), ("d2h_pageable", pageable, dev)):
        times = []
        for _ in range(reps + 1):  # first is warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        out[name + "_gbps"] = n / statistics.median(times[1:]) / 1e9
    del dev, pinned, pageable
    torch.cuda.empty_cache()
    return out


def offloader_cycles(params_m: float, cycles: int) -> dict:
    from benchmarks.snapshot import build_trainer, plain_copy
    from llmd_timeslice.client.torch_offload import StateChecksumMismatch, TorchStateOffloader, _tensors

    model, opt = build_trainer(params_m, "cuda", width=4096)
    off = TorchStateOffloader(model, opt, pin_memory=True)
    tensors = _tensors(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    host = [torch.empty(t.numel(), dtype=t.dtype, pin_memory=True) for t in tensors]
    rows, checksum_ok = [], True
    for i in range(cycles):
        c_off, c_res = plain_copy(tensors, host, "cuda")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        o = off.offload()
        freed = before - torch.cuda.memory_allocated()
        try:
            r = off.restore()
        except StateChecksumMismatch:
            checksum_ok = False
            raise
        rows.append(
            {
                "cycle": i,
                "offload_s": o.seconds,
                "restore_s": r.seconds,
                "copy_d2h_s": c_off,
                "copy_h2d_s": c_res,
                "device_bytes_freed": freed,
            }
        )
    del host
    steady = rows[1:]
    med = {k: statistics.median(r[k] for r in steady) for k in ("offload_s", "restore_s", "copy_d2h_s", "copy_h2d_s")}
    return {
        "state_bytes": nbytes,
        "cycles": cycles,
        "checksum_ok": checksum_ok,
        "first_cycle": {"offload_gbps": nbytes / rows[0]["offload_s"] / 1e9, "restore_gbps": nbytes / rows[0]["restore_s"] / 1e9},
        "steady_state": {k.replace("_s", "_gbps"): nbytes / v / 1e9 for k, v in med.items()},
        "ratio_to_copy": {"offload": med["copy_d2h_s"] / med["offload_s"], "restore": med["copy_h2d_s"] / med["restore_s"]},
        "device_bytes_freed_by_offload": rows[-1]["device_bytes_freed"],
        "rows": rows,
    }


def reserved_after_offload(params_m: float, max_reserved_mib: float) -> dict:
    """Item 3 of the module doc: reserved and driver-free memory after an offload, released vs not (baseline)."""
    import gc

    from benchmarks.snapshot import build_trainer
    from llmd_timeslice.client.torch_offload import TorchStateOffloader

    out: dict = {}
    for release in (False, True):
        gc.collect()
        torch.cuda.empty_cache()
        free_before_trainer = torch.cuda.mem_get_info()[0]
        model, opt = build_trainer(params_m, "cuda", width=4096)  # includes one training step
        torch.cuda.synchronize()
        reserved_trained = torch.cuda.memory_reserved()
        off = TorchStateOffloader(model, opt, pin_memory=True, release_device_cache=release)
        off.offload()
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        free_after = torch.cuda.mem_get_info()[0]
        out["released" if release else "baseline_not_released"] = {
            "reserved_while_training_bytes": reserved_trained,
            "reserved_after_offload_bytes": reserved,
            "driver_free_before_trainer_bytes": free_before_trainer,
            "driver_free_after_offload_bytes": free_after,
            "not_given_back_bytes": free_before_trainer - free_after,
        }
        off.restore()
        del model, opt, off
    rel, base = out["released"], out["baseline_not_released"]
    out["passed"] = (
        rel["reserved_after_offload_bytes"] <= max_reserved_mib * 2**20
        and rel["not_given_back_bytes"] <= max_reserved_mib * 2**20
    )
    out["given_back_ratio"] = base["not_given_back_bytes"] / max(1, rel["not_given_back_bytes"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gb", type=float, default=4.0, help="GiB of the raw copy buffer")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--params-m", type=float, default=500.0, help="trainer parameters, millions (~16 B each)")
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument(
        "--max-reserved-mib",
        type=float,
        default=64.0,
        help="most device memory (MiB) the process may keep reserved after an offload",
    )
    a = ap.parse_args(argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        reason = f"CUDA is not available (torch {torch.__version__}); run this on a machine with an NVIDIA GPU"
        print(f"snapshot_gpu: skipped: {reason}")
        a.out.write_text(json.dumps({"skipped": reason}))
        return 0
    t0 = time.monotonic()
    res = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "copy": copy_bandwidth(a.gb, a.reps),
        "offloader": offloader_cycles(a.params_m, max(2, a.cycles)),
        "release": reserved_after_offload(a.params_m, a.max_reserved_mib),
    }
    res["seconds"] = time.monotonic() - t0
    a.out.write_text(json.dumps(res, indent=2))
    c, o = res["copy"], res["offloader"]
    print(
        f"{res['gpu']}: pinned d2h {c['d2h_pinned_gbps']:.1f} GB/s, h2d {c['h2d_pinned_gbps']:.1f} GB/s, "
        f"pageable d2h {c['d2h_pageable_gbps']:.1f} GB/s"
    )
    print(
        f"offloader on {o['state_bytes'] / 1e9:.2f} GB: steady offload {o['steady_state']['offload_gbps']:.1f} GB/s, "
        f"restore {o['steady_state']['restore_gbps']:.1f} GB/s; ratio_to_copy {o['ratio_to_copy']['offload']:.2f} / "
        f"{o['ratio_to_copy']['restore']:.2f}; checksum_ok {o['checksum_ok']}; freed {o['device_bytes_freed_by_offload']}"
    )
    rel = res["release"]
    mib = 2**20
    print(
        f"after an offload: reserved {rel['released']['reserved_after_offload_bytes'] / mib:.0f} MiB, not given back "
        f"to the driver {rel['released']['not_given_back_bytes'] / mib:.0f} MiB (without empty_cache: "
        f"{rel['baseline_not_released']['reserved_after_offload_bytes'] / mib:.0f} / "
        f"{rel['baseline_not_released']['not_given_back_bytes'] / mib:.0f} MiB, ratio "
        f"{rel['given_back_ratio']:.0f}x); {'PASS' if rel['passed'] else 'FAIL'} (<= {a.max_reserved_mib:g} MiB)"
    )
    print(f"wrote {a.out} in {res['seconds']:.0f} s")
    return 0 if rel["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
