"""The demo's pictures: phases of each sampler and the trainer over time, with held requests."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STATE_COLORS = {"SERVING": "#2ca02c", "DRAINING": "#ff7f0e", "ASLEEP": "#7f7f7f", "WAKING": "#1f77b4"}
TRAINER_COLORS = {
    "rollout": "#c7e9c0",
    "switch to trainer": "#e377c2",
    "train": "#d62728",
    "yield": "#ffbb78",  # yielded at a step boundary on a yield request: the samplers serve the held requests
    "idle": "#ffffff",
}
BAND_COLORS = ["#9467bd", "#17becf", "#bcbd22", "#8c564b"]


def _spans(samples: list[tuple[float, str]]) -> list[tuple[float, float, str]]:
    spans: list[tuple[float, float, str]] = []
    for (t, s), (t2, _) in zip(samples, [*samples[1:], (samples[-1][0] + 0.1, "")], strict=True):
        if spans and spans[-1][2] == s:
            spans[-1] = (spans[-1][0], t2, s)
        else:
            spans.append((t, t2, s))
    return spans


def sampler_lanes(monitor: list[dict], names: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """``(address, lane label)`` per sampler seen in ``monitor``, ordered by label: the sampler's name from
    ``names`` (``{address: job id}``), else its address."""
    names = names or {}
    addresses = {a for m in monitor for a in m["endpoints"]}
    return sorted(((a, names.get(a, a)) for a in addresses), key=lambda x: (x[1], x[0]))


def plot_timeline(
    path: Path,
    monitor: list[dict],
    trainer_phases: list[tuple[float, float, str]],
    requests: list[dict],
    names: dict[str, str] | None = None,
    yield_requests: list[float] | None = None,
) -> Path:
    """Write the PNG: a lane per sampler (gate endpoint state) and the trainer, held requests below.

    ``monitor``: samples ``{"t": s, "held": n, "endpoints": {address: state}}``, optionally ``"bands": {band:
    held}`` (the gate's priority bands: one line each); ``trainer_phases``: ``(start_s, end_s, phase)`` (phase
    ``yield``: the trainer yielded at a step boundary on a yield request); ``requests``: request records
    (``kind``, ``sent_at``, ``done_at``, ``hold_ms``, ``ok``; kind ``eval``: the second traffic class, drawn apart);
    ``names``: ``{address: sampler name}`` for the lane labels (see :func:`sampler_lanes`); ``yield_requests``:
    when the trainer learned each yield request (seconds), drawn as markers above its lane.
    """
    fig, (ax, ax2, ax3) = plt.subplots(3, 1, figsize=(13, 7.5), sharex=True, gridspec_kw={"height_ratios": [2.2, 1.2, 1.2]})
    samplers = sampler_lanes(monitor, names)
    addresses = [a for a, _ in samplers]
    lanes = [*(label for _, label in samplers), "trainer"]
    for i, a in enumerate(addresses):
        for start, end, state in _spans([(m["t"], m["endpoints"].get(a, "")) for m in monitor]):
            if state:
                ax.barh(i, end - start, left=start, color=STATE_COLORS.get(state, "k"), height=0.6)
    ti = len(addresses)
    for start, end, phase in trainer_phases:
        ax.barh(ti, end - start, left=start, color=TRAINER_COLORS.get(phase, "k"), height=0.6, edgecolor="k", linewidth=0.3)
    ax.set_yticks(range(len(lanes)), lanes)
    handles: list = [plt.Rectangle((0, 0), 1, 1, color=c) for c in STATE_COLORS.values()]
    yielded = any(p == "yield" for *_, p in trainer_phases)
    trainer_kinds = ["rollout", "switch to trainer", "train", *(["yield"] if yielded else [])]
    handles += [plt.Rectangle((0, 0), 1, 1, color=TRAINER_COLORS[k]) for k in trainer_kinds]
    labels = [*STATE_COLORS, *(k if k != "yield" else "yield request honoured" for k in trainer_kinds)]
    if yield_requests:
        handles.append(ax.scatter(yield_requests, [ti + 0.42] * len(yield_requests), marker="v", c="k", s=22, zorder=3))
        labels.append("yield requested")
    ax.legend(
        handles,
        labels,
        ncol=8,
        fontsize=8,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
    )
    fig.suptitle("llmd-timeslice demo: gate endpoint state per sampler, trainer phases, held requests, latency")
    ts = [m["t"] for m in monitor]
    bands = sorted({int(b) for m in monitor for b in m.get("bands", {})}, reverse=True)
    ax2.step(ts, [m["held"] for m in monitor], where="post", color="#7f7f7f", label="all bands" if bands else None)
    for i, b in enumerate(bands):
        held = [m.get("bands", {}).get(str(b), 0) for m in monitor]
        ax2.step(ts, held, where="post", color=BAND_COLORS[i % len(BAND_COLORS)], label=f"band {b}")
    if bands:
        ax2.legend(fontsize=8, loc="upper left")
    ax2.set_ylabel("held at gate")
    ok = [r for r in requests if r["ok"]]
    bad = [r for r in requests if not r["ok"]]
    evals = [r for r in ok if r.get("kind") == "eval"]
    ok = [r for r in ok if r.get("kind") != "eval"]
    for subset, color, label in (
        ([r for r in ok if not r["hold_ms"]], "#1f77b4", "completed"),
        ([r for r in ok if r["hold_ms"]], "#d62728", "completed, was held by the gate"),
        (evals, "#2ca02c", "eval (second traffic class)"),
    ):
        if not subset:
            continue
        ax3.scatter(
            [r["done_at"] for r in subset],
            [max(1.0, (r["done_at"] - r["sent_at"]) * 1000) for r in subset],
            s=6,
            c=color,
            label=label,
        )
    if bad:
        ax3.scatter([r["done_at"] for r in bad], [1000] * len(bad), marker="x", c="k", label="failed")
    ax3.set_yscale("log")
    ax3.set_ylabel("latency ms")
    ax3.set_xlabel("seconds since the stack was up (vLLM start-up not shown)")
    ax3.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
