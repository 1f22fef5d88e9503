"""The RL model's figure (``rl_model.png``): duty cycles, switch costs by category, sweeps, the DES timeline."""

from __future__ import annotations

from benchmarks.rl_model.report import TARGET
from benchmarks.rl_model.schedule import (
    SWEEP_NAMES,
)

# --------------------------------------------------------------------------- plots
COLORS = {
    "dedicated": "#7f7f7f",
    "reference": "#ff7f0e",
    "llmd_timeslice": "#1f77b4",
    "llmd_timeslice_host_blake2b": "#aec7e8",
    "reference_vllm_sleep": "#ffbb78",
    "ceiling": "#000000",
}
LABELS = {
    "dedicated": "dedicated",
    "reference": "reference TS",
    "llmd_timeslice": "llmd-timeslice",
    "llmd_timeslice_host_blake2b": "llmd-timeslice (historical: host BLAKE2b)",
    "reference_vllm_sleep": "reference + vLLM sleep",
    "ceiling": "zero-cost ceiling",
}


CATEGORIES = {
    "drain": "#ffbb78",
    "process checkpoint / restore (cuda-checkpoint)": "#d62728",
    "vLLM level-1 sleep / wake": "#9467bd",
    "trainer state over PCIe": "#8c564b",
    "checksum of trainer state": "#bdbdbd",
    "1 s operation polls": "#17becf",
    "verification + control (measured here)": "#2ca02c",
}


def _category(component: str) -> str:
    if "drain" in component:
        return "drain"
    if "poll" in component:
        return "1 s operation polls"
    if "cuda-checkpoint" in component:
        return "process checkpoint / restore (cuda-checkpoint)"
    if "vLLM level-1" in component:
        return "vLLM level-1 sleep / wake"
    if "checksum" in component:
        return "checksum of trainer state"
    if "PCIe" in component:
        return "trainer state over PCIe"
    return "verification + control (measured here)"


def plot_model(path, report: dict) -> None:
    """Duty cycles against the published points, switch breakdowns, model-size sweep, win maps and a
    DES timeline of the default workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(15, 19))
    gs = fig.add_gridspec(4, 2, height_ratios=[1, 1, 1, 0.9])
    names = ("dedicated", "reference", "llmd_timeslice_host_blake2b", "llmd_timeslice", "ceiling")

    # (a) duty cycle, default workload and the workload calibrated to the published 41% baseline
    ax = fig.add_subplot(gs[0, 0])
    scen = report["scenarios"]
    width = 0.38
    for k, (sname, off) in enumerate((("default", -width / 2), ("published_baseline", width / 2))):
        res = scen[sname]["results"]
        vals = [res[n]["duty_cycle"] for n in names]
        bars = ax.bar(
            [i + off for i in range(len(names))],
            vals,
            width,
            color=[COLORS[n] for n in names],
            alpha=1.0 if k == 0 else 0.45,
            edgecolor="k",
            linewidth=0.4,
        )
        for b, v in zip(bars, vals, strict=True):
            ax.text(b.get_x() + b.get_width() / 2, v + 0.01, f"{v:.2f}", ha="center", fontsize=7)
    pub = report["published_points"]
    for i, n in enumerate(names):
        if n in pub["duty_cycle"]:
            ax.plot(i, pub["duty_cycle"][n], marker="D", color="k", ms=6)
    ax.axhline(report["target"]["duty_cycle_min"], color="#2ca02c", ls="--", lw=1)
    ax.text(-0.45, report["target"]["duty_cycle_min"] + 0.01, "target 0.90", fontsize=7, ha="left")
    ax.set_xticks(range(len(names)), [LABELS[n].replace(" (", "\n(").replace(" + ", "\n+ ") for n in names], fontsize=7)
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("two-job duty cycle")
    ax.set_title(
        "duty cycle (model): solid = default workload, faded = gap calibrated to the published 41%;\n"
        "black diamonds = published (llm-d: 41% standalone, 71% two jobs, ~95% peak)",
        fontsize=8,
    )

    # (b) switch cost breakdown at the default workload, components grouped by kind
    ax = fig.add_subplot(gs[0, 1])
    res = scen["default"]["results"]
    rows = []
    for n in ("reference", "reference_vllm_sleep", "llmd_timeslice"):  # historical variant: see the JSON (57 s)
        for kind in ("handover_to_sampler", "handover_to_trainer"):
            comps: dict[str, float] = {}
            for c, secs in res[n]["switch_breakdown_s"].get(kind, {}).items():
                cat = _category(c)
                comps[cat] = comps.get(cat, 0.0) + secs
            rows.append((f"{LABELS[n]}\n{'sampler' if kind.endswith('sampler') else 'trainer'} group handover", comps))
    for y, (_, comps) in enumerate(rows):
        left = 0.0
        for cat, color in CATEGORIES.items():
            if comps.get(cat):
                ax.barh(y, comps[cat], left=left, color=color, edgecolor="k", linewidth=0.2)
                left += comps[cat]
        ax.text(left + 0.3, y, f"{left:.1f} s", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per handover (suspend the resident worker + resume the incoming one)")
    ax.legend(
        [plt.Rectangle((0, 0), 1, 1, color=c) for c in CATEGORIES.values()], list(CATEGORIES), fontsize=7, loc="lower right"
    )
    ax.set_title(f"switch cost breakdown, {scen['default']['workload']['model_b']:g}B, default workload", fontsize=9)

    # (c, d) model-size sweep at rollout fraction 0.5, default (interleaved) layout
    if not report["sweep"]:
        ax = fig.add_subplot(gs[1:3, :])
        ax.text(0.5, 0.5, "sweep skipped (--no-sweep)", ha="center", va="center")
        ax.axis("off")
    sw = [r for r in report["sweep"] if abs(r["rollout_fraction"] - 0.5) < 1e-9]
    sizes = [r["model_b"] for r in sw]
    for col, key, ylabel in (
        (0, "duty_cycle", "two-job duty cycle"),
        (1, "training_step_vs_dedicated", "training step time / dedicated"),
    ):
        if not sw:
            break
        ax = fig.add_subplot(gs[1, col])
        for n in SWEEP_NAMES:
            ax.plot(
                range(len(sizes)),
                [r["by_layout"]["interleaved"][n][key] for r in sw],
                marker="o",
                color=COLORS[n],
                label=LABELS[n],
            )
        ax.set_xticks(range(len(sizes)), [f"{s:g}B" for s in sizes])
        ax.set_xlabel("model size (phases scale linearly with parameters; rollout = training)")
        ax.set_ylabel(ylabel)
        if key == "duty_cycle":
            ax.axhline(0.9, color="#2ca02c", ls="--", lw=1)
        else:
            ax.axhline(1.05, color="#2ca02c", ls="--", lw=1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title(f"sweep over model size: {ylabel}", fontsize=9)

    # (e) win map over model size x rollout fraction; (f) llmd-timeslice against the target per cell
    fracs = sorted({r["rollout_fraction"] for r in report["sweep"]})
    all_sizes = sorted({r["model_b"] for r in report["sweep"]})
    for col in (0, 1):
        if not report["sweep"]:
            break
        ax = fig.add_subplot(gs[2, col])
        for r in report["sweep"]:
            x, y = all_sizes.index(r["model_b"]), fracs.index(r["rollout_fraction"])
            if col == 0:
                w = r["winner"]
                color = COLORS[w]
                lay = "" if w == "dedicated" else f"\n({r['layout'][w]})"
                text = f"{LABELS[w].split(' (')[0]}\n{r['duty_cycle'][w]:.2f}{lay}"
            else:
                duty, step = r["duty_cycle"]["llmd_timeslice"], r["training_step_vs_dedicated"]["llmd_timeslice"]
                step_ok = step <= TARGET["training_step_vs_dedicated_max"]
                color = "#2ca02c" if step_ok and duty >= TARGET["duty_cycle_min"] else "#ffdd71" if step_ok else "#ff9896"
                text = f"duty {duty:.2f}\nstep {step:.3f}x\n({r['layout']['llmd_timeslice']})"
            ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, color=color, alpha=0.75))
            ax.text(x, y, text, ha="center", va="center", fontsize=6.5)
        ax.set_xlim(-0.5, len(all_sizes) - 0.5)
        ax.set_ylim(-0.5, len(fracs) - 0.5)
        ax.set_xticks(range(len(all_sizes)), [f"{s:g}B" for s in all_sizes])
        ax.set_yticks(range(len(fracs)), [f"{f:.3g}" for f in fracs])
        ax.set_xlabel("model size")
        ax.set_ylabel("rollout / (rollout + training)")
        if col == 0:
            ax.set_title(
                "winner (dedicated / reference / llmd-timeslice): highest duty cycle with training step\n"
                "<= 1.05x dedicated (best of the interleaved / crossed layouts)",
                fontsize=9,
            )
        else:
            ax.set_title(
                "llmd-timeslice per cell (best layout) against the target: green meets it;\n"
                "yellow: step <= 1.05x but duty < 0.90; red: step > 1.05x dedicated",
                fontsize=9,
            )

    # (g) DES timeline: reference, the historical host-BLAKE2b variant and this project, default workload
    ax = fig.add_subplot(gs[3, :])
    lanes = []
    for n in ("reference", "llmd_timeslice_host_blake2b", "llmd_timeslice"):
        tr = scen["default"]["results"][n]["trace"]
        a = scen["default"]["results"][n]["window_s"][0]
        for g in tr["groups"]:
            lanes.append((f"{LABELS[n]}: {'samplers' if g['name'] == 'g0' else 'trainers'}", g, a))
    horizon = 3.2 * scen["default"]["results"]["llmd_timeslice"]["iteration_s"]
    for y, (_, g, a) in enumerate(lanes):
        for s, e, kind, job in g["busy"]:
            if s < a + horizon and e > a:
                ax.barh(
                    y,
                    min(e, a + horizon) - max(s, a),
                    left=max(s, a) - a,
                    height=0.6,
                    color="#c7e9c0" if kind == "rollout" else "#fcbba1",
                    edgecolor="k",
                    linewidth=0.3,
                    hatch="" if job == 0 else "..",
                )
        for s, e, _ in g["switches"]:
            if s < a + horizon and e > a:
                ax.barh(y, min(e, a + horizon) - max(s, a), left=max(s, a) - a, height=0.6, color="#ff7f0e")
    ax.set_yticks(range(len(lanes)), [lab for lab, _, _ in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, horizon)
    ax.set_xlabel("seconds (steady state of the default workload; job A plain, job B dotted)")
    ax.legend(
        [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#c7e9c0", "#fcbba1", "#ff7f0e")],
        ["rollout", "training", "switch (not busy)"],
        fontsize=7,
        loc="lower right",
    )
    ax.set_title("DES timeline per accelerator group (4 accelerators each)", fontsize=9)
    fig.suptitle("RL rollout duty cycle model: one 8-accelerator node, two GRPO jobs (simpy discrete-event model)", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=90)
    plt.close(fig)
