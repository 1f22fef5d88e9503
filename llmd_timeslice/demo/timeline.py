"""The demo's pictures: phases of each sampler and the trainer over time, with held requests."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STATE_COLORS = {"SERVING": "#2ca02c", "DRAINING": "#ff7f0e", "ASLEEP": "#7f7f7f", "WAKING": "#1f77b4"}
ROLLOUT_COLOR = "#c7e9c0"
"""The RL loop's rollout batches: drawn on a lane of their own (the trainer waits; the samplers generate)."""
TRAINER_COLORS = {
    "switch to trainer": "#e377c2",
    "train": "#d62728",
    "yield": "#ffbb78",  # yielded at a step boundary on a yield request: the samplers serve the held requests
    "idle": "#ffffff",
}
BAND_COLORS = ["#9467bd", "#17becf", "#bcbd22", "#8c564b"]
TIMELINE_DATA = "timeline.json"
"""What the demo writes beside ``timeline.png`` (monitor samples, trainer phases, lane names, yield requests), so
the picture can be drawn again from a finished run: ``python -m llmd_timeslice.demo.timeline demo-out``."""


SAMPLE_GAP_S = 0.5
"""Samples further apart than this leave their gap blank ("not sampled") instead of stretching the last state over
it: the monitor polls from the demo's own process, which a loaded machine can stall for a second or more."""


def _spans(samples: list[tuple[float, str]]) -> list[tuple[float, float, str]]:
    """``(start, end, state)`` runs of equal state; a gap between samples over :data:`SAMPLE_GAP_S` is a run of
    state ``""`` (not sampled) after one sampling period of the state before it."""
    spans: list[tuple[float, float, str]] = []
    for (t, s), (t2, _) in zip(samples, [*samples[1:], (samples[-1][0] + 0.1, "")], strict=True):
        if t2 - t > SAMPLE_GAP_S:
            spans += [(t, t + 0.1, s), (t + 0.1, t2, "")]
            continue
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


def rollout_waits(
    monitor: list[dict], trainer_phases: list[tuple[float, float, str]], requests: list[dict], min_s: float = 0.3
) -> list[tuple[float, float]]:
    """``(start_s, seconds)`` of each rollout batch sent while no sampler served, for how long it waited: ``release``
    (the yield) returns at once, so the next batch is sent while the samplers wake and load the new weight version,
    and the gate holds it until a sampler is verified SERVING (the wait ends at the batch's first answer). Waits under
    ``min_s`` are left out."""
    out = []
    for start, end, phase in trainer_phases:
        if phase != "rollout":
            continue
        before = [m for m in monitor if m["t"] <= start]
        if not before or "SERVING" in before[-1]["endpoints"].values():
            continue
        done = [r["done_at"] for r in requests if r.get("kind") == "rollout" and start <= r["sent_at"] <= end and r["ok"]]
        if done and min(done) - start >= min_s:
            out.append((start, min(done) - start))
    return out


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
    gaps = False
    samplers = sampler_lanes(monitor, names)
    addresses = [a for a, _ in samplers]
    rollouts = [(s, e) for s, e, p in trainer_phases if p == "rollout"]
    lanes = [*(label for _, label in samplers), *(["rollouts"] if rollouts else []), "trainer"]
    for i, a in enumerate(addresses):
        for start, end, state in _spans([(m["t"], m["endpoints"].get(a, "")) for m in monitor]):
            if state:
                ax.barh(i, end - start, left=start, color=STATE_COLORS.get(state, "k"), height=0.6)
            else:
                ax.barh(i, end - start, left=start, color="white", height=0.6, hatch="..", edgecolor="#bbbbbb", lw=0)
                gaps = True
    ri = len(addresses)  # the rollout lane: the RL loop's batches, sent through the router to the samplers
    for start, end in rollouts:
        ax.barh(ri, end - start, left=start, color=ROLLOUT_COLOR, height=0.6, edgecolor="k", linewidth=0.3)
    for k, (start, waited) in enumerate(rollout_waits(monitor, trainer_phases, requests)):
        ax.barh(ri, waited, left=start, color="none", height=0.6, hatch="///", edgecolor=STATE_COLORS["WAKING"], lw=0)
        if k == 0:  # said once, where it first happens
            ax.annotate(
                f"sent right after the yield: held at the gate {waited:.1f} s\nwhile the samplers wake with the new weights",
                (start + waited, ri),
                xytext=(8, 0),
                textcoords="offset points",
                va="center",
                fontsize=7.5,
                bbox={"boxstyle": "round", "fc": "white", "ec": "0.6", "lw": 0.5},
                zorder=4,
            )
    ti = len(lanes) - 1
    for start, end, phase in trainer_phases:
        if phase != "rollout":
            ax.barh(ti, end - start, left=start, color=TRAINER_COLORS.get(phase, "k"), height=0.6, edgecolor="k", lw=0.3)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(-0.5, len(lanes) - 0.5)
    handles: list = [plt.Rectangle((0, 0), 1, 1, color=c) for c in STATE_COLORS.values()]
    labels = [*STATE_COLORS]
    if gaps:
        handles.append(plt.Rectangle((0, 0), 1, 1, fc="white", hatch="..", ec="#bbbbbb", lw=0))
        labels.append("not sampled")
    if rollouts:
        handles.append(plt.Rectangle((0, 0), 1, 1, color=ROLLOUT_COLOR))
        labels.append("rollout batch")
    yielded = any(p == "yield" for *_, p in trainer_phases)
    trainer_kinds = ["switch to trainer", "train", *(["yield"] if yielded else [])]
    handles += [plt.Rectangle((0, 0), 1, 1, color=TRAINER_COLORS[k]) for k in trainer_kinds]
    labels += [k if k != "yield" else "yield request honoured" for k in trainer_kinds]
    if yield_requests:
        handles.append(ax.scatter(yield_requests, [ti + 0.42] * len(yield_requests), marker="v", c="k", s=22, zorder=3))
        labels.append("yield requested")
    ax.legend(
        handles,
        labels,
        ncol=min(len(handles), 10),
        fontsize=8,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
    )
    fig.suptitle("llmd-timeslice demo: gate endpoint state per sampler, trainer phases, held requests, latency")
    ts = [m["t"] for m in monitor]
    bands = sorted({int(b) for m in monitor for b in m.get("bands", {})}, reverse=True)
    for i, b in enumerate(bands):
        held = [m.get("bands", {}).get(str(b), 0) for m in monitor]
        ax2.step(ts, held, where="post", color=BAND_COLORS[i % len(BAND_COLORS)], lw=2.4, label=f"band {b}")
    # The total last, dashed, on top: where one band holds everything the two lines coincide and both stay visible.
    total_style = {"color": "k", "lw": 1.0, "ls": (0, (4, 3)), "zorder": 3} if bands else {"color": "#7f7f7f"}
    ax2.step(ts, [m["held"] for m in monitor], where="post", label="all bands", **total_style)
    if bands:
        handles2, labels2 = ax2.get_legend_handles_labels()
        ax2.legend([handles2[-1], *handles2[:-1]], [labels2[-1], *labels2[:-1]], fontsize=8, loc="upper left")
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
    if ax3.get_legend_handles_labels()[1]:  # no requests, no legend (matplotlib warns on an empty one)
        ax3.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def redraw(out: Path) -> Path:
    """Draw ``out/timeline.png`` again from ``out/timeline.json`` and ``out/requests.json`` of a finished demo."""
    import json

    data = json.loads((out / TIMELINE_DATA).read_text())
    requests = json.loads((out / "requests.json").read_text())
    phases = [tuple(p) for p in data["trainer_phases"]]
    return plot_timeline(
        out / "timeline.png", data["monitor"], phases, requests, names=data["names"], yield_requests=data["yield_requests"]
    )


if __name__ == "__main__":
    import sys

    print(redraw(Path(sys.argv[1] if len(sys.argv) > 1 else "demo-out")))
