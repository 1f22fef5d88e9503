"""What `make demo` prints and draws: the README shows the summary in the demo's own form, the title says what each
duration measures, and the timeline's sampler lanes carry the samplers' names, not their random ports."""

from __future__ import annotations

import re
from pathlib import Path

from llmd_timeslice.demo.run import SUMMARY_LINES, _summary, summary_lines

REPO = Path(__file__).resolve().parents[2]
TITLE = re.compile(
    r"^llmd-timeslice demo: \d+ s in all = setup_s [\d.]+ \(tiny model, vLLM start-up, stack\) \+ "
    r"wall_s [\d.]+ \(stack up to the last answer: load and RL loop\) \+ stop$"
)


def _sample_summary() -> dict:
    records = [
        {"ok": True, "hold_ms": 0.0, "kind": "load", "stream": False, "weight_version": 0, "min_weight_version": 0},
        {"ok": True, "hold_ms": 2021.4, "kind": "rollout", "stream": True, "weight_version": 1, "min_weight_version": 1},
    ]
    iters = [{"switch_ms": 250, "rollout_weight_versions": [0]}, {"switch_ms": 300, "rollout_weight_versions": [1, 2]}]
    return _summary(records, iters, 6.0, wall_s=62.34, setup_s=45.06)


def _keys(line: str) -> list[str]:
    return [part.split(" ", 1)[0] for part in line.split(" · ")]


def test_summary_lines_title_says_what_each_duration_measures_then_figures_in_a_fixed_order():
    s = _sample_summary()
    lines = summary_lines(s, total_s=113.2)
    assert TITLE.match(lines[0]), lines[0]
    assert "113 s in all = setup_s 45.1" in lines[0] and "wall_s 62.3" in lines[0]
    assert [_keys(ln) for ln in lines[1:]] == [list(group) for group in SUMMARY_LINES]
    assert "rollout_weight_versions 0 1/2" in lines[3], "per iteration; several versions of one joined with '/'"
    assert "hold_ms_p50 2021" in lines[2] and "load_rps 6.0" in lines[4]
    assert "setup_s" in s["notes"] and "wall_s" in s["notes"], "summary.json says what each duration measures"


def test_readme_shows_the_demo_summary_in_the_demos_own_form():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"What `make demo` ends with.*?\n```\n(.*?)\n```", readme, re.DOTALL)
    assert block, "README: the demo summary block"
    lines = block.group(1).splitlines()
    assert TITLE.match(lines[0]), lines[0]
    assert [_keys(ln) for ln in lines[1:]] == [list(group) for group in SUMMARY_LINES], lines


def test_timeline_sampler_lanes_are_labelled_by_sampler_name(tmp_path, monkeypatch):
    from llmd_timeslice.demo import timeline  # matplotlib: imported by the test using it, not by every worker

    monitor = [
        {"t": 0.0, "held": 0, "endpoints": {"127.0.0.1:41873": "SERVING", "127.0.0.1:35011": "SERVING"}},
        {"t": 1.0, "held": 2, "endpoints": {"127.0.0.1:41873": "ASLEEP", "127.0.0.1:35011": "ASLEEP"}},
    ]
    names = {"127.0.0.1:41873": "sampler-0", "127.0.0.1:35011": "sampler-1"}
    assert timeline.sampler_lanes(monitor, names) == [("127.0.0.1:41873", "sampler-0"), ("127.0.0.1:35011", "sampler-1")]
    assert timeline.sampler_lanes(monitor) == [("127.0.0.1:35011", "127.0.0.1:35011"), ("127.0.0.1:41873", "127.0.0.1:41873")], (
        "no names: the address"
    )
    figures = []
    real_close = timeline.plt.close
    monkeypatch.setattr(timeline.plt, "close", lambda fig: (figures.append(fig), real_close(fig)))
    out = timeline.plot_timeline(
        tmp_path / "timeline.png",
        monitor,
        [(0.0, 1.0, "train")],
        [{"ok": True, "sent_at": 0.1, "done_at": 1.2, "hold_ms": 900.0}],
        names=names,
    )
    assert out.stat().st_size > 10_000
    labels = [t.get_text() for t in figures[0].axes[0].get_yticklabels()]
    assert labels == ["sampler-0", "sampler-1", "trainer"]


def test_timeline_shows_priority_bands_yields_and_eval_requests(tmp_path, monkeypatch):
    """With a second traffic class: one held line per band (highest first), the trainer's yields in its lane and
    the eval requests apart from the rest."""
    from llmd_timeslice.demo import timeline

    monitor = [
        {"t": 0.0, "held": 0, "endpoints": {"a": "SERVING"}, "bands": {}},
        {"t": 1.0, "held": 3, "endpoints": {"a": "ASLEEP"}, "bands": {"0": 2, "10": 1}},
        {"t": 2.0, "held": 0, "endpoints": {"a": "SERVING"}, "bands": {"0": 0, "10": 0}},
    ]
    figures = []
    real_close = timeline.plt.close
    monkeypatch.setattr(timeline.plt, "close", lambda fig: (figures.append(fig), real_close(fig)))
    timeline.plot_timeline(
        tmp_path / "timeline.png",
        monitor,
        [(0.0, 1.0, "train"), (1.0, 1.5, "yield"), (1.5, 2.0, "train")],
        yield_requests=[0.8],
        requests=[
            {"kind": "eval", "ok": True, "sent_at": 1.0, "done_at": 1.6, "hold_ms": 500},
            {"kind": "rollout", "ok": True, "sent_at": 0.1, "done_at": 2.1, "hold_ms": 1900},
        ],
    )
    lanes, held, latency = figures[0].axes
    assert [t.get_text() for t in held.get_legend().get_texts()] == ["all bands", "band 10", "band 0"]
    assert "yield request honoured" in [t.get_text() for t in lanes.get_legend().get_texts()]
    assert "yield requested" in [t.get_text() for t in lanes.get_legend().get_texts()]
    assert "eval (second traffic class)" in [t.get_text() for t in latency.get_legend().get_texts()]


def _figure_of(timeline, monkeypatch) -> list:
    figures: list = []
    real_close = timeline.plt.close
    monkeypatch.setattr(timeline.plt, "close", lambda fig: (figures.append(fig), real_close(fig)))
    return figures


def test_rollouts_have_a_lane_of_their_own_and_a_batch_sent_while_the_samplers_wake_says_why(tmp_path, monkeypatch):
    """The trainer's lane shows the trainer (switch, train); the rollout batches, which the samplers run, get their
    own lane; a batch sent right after a yield, while no sampler serves yet, is marked and explained (the yield
    returns at once; the gate holds that batch until a sampler is verified SERVING: its first answer). A gap in the
    monitor's samples is drawn as not sampled, not as the state before it."""
    from llmd_timeslice.demo import timeline

    monitor = [
        {"t": t, "held": 0, "endpoints": {"a": state, "b": state}}
        for t, state in ((0.0, "SERVING"), (1.0, "ASLEEP"), (3.0, "WAKING"), (3.1, "WAKING"), (5.6, "WAKING"), (5.7, "SERVING"))
    ]
    phases = [(0.0, 1.0, "rollout"), (1.0, 1.1, "switch to trainer"), (1.1, 3.0, "train"), (3.05, 6.5, "rollout")]
    requests = [
        {"kind": "rollout", "ok": True, "sent_at": 0.1, "done_at": 0.5, "hold_ms": 0},
        {"kind": "rollout", "ok": True, "sent_at": 3.05, "done_at": 5.75, "hold_ms": 2600},
    ]
    assert [(s, round(w, 3)) for s, w in timeline.rollout_waits(monitor, phases, requests)] == [(3.05, 2.7)]
    figures = _figure_of(timeline, monkeypatch)
    timeline.plot_timeline(tmp_path / "t.png", monitor, phases, requests, names={"a": "sampler-0", "b": "sampler-1"})
    lanes = figures[0].axes[0]
    assert [t.get_text() for t in lanes.get_yticklabels()] == ["sampler-0", "sampler-1", "rollouts", "trainer"]
    trainer_lane = len(lanes.get_yticklabels()) - 1
    on_trainer = [p for p in lanes.patches if abs(p.get_y() + p.get_height() / 2 - trainer_lane) < 0.01]
    assert on_trainer and timeline.ROLLOUT_COLOR not in {
        timeline.matplotlib.colors.to_hex(p.get_facecolor()) for p in on_trainer
    }, "no rollout on the trainer's lane"
    notes = [t.get_text() for t in lanes.texts]
    assert notes == ["sent right after the yield: held at the gate 2.7 s\nwhile the samplers wake with the new weights"]
    legend = [t.get_text() for t in lanes.get_legend().get_texts()]
    assert "rollout batch" in legend and "not sampled" in legend, "3.1 -> 5.6: a gap in the samples"
    assert timeline._spans([(0.0, "WAKING"), (0.1, "WAKING"), (2.0, "SERVING")]) == [
        (0.0, 0.1, "WAKING"),
        (0.1, 0.2, "WAKING"),
        (0.2, 2.0, ""),
        (2.0, 2.1, "SERVING"),
    ]


def test_the_all_bands_line_is_drawn_over_the_band_lines_so_one_band_holding_everything_hides_neither(tmp_path, monkeypatch):
    from llmd_timeslice.demo import timeline

    monitor = [
        {"t": 0.0, "held": 0, "endpoints": {"a": "SERVING"}, "bands": {"0": 0}},
        {"t": 1.0, "held": 4, "endpoints": {"a": "ASLEEP"}, "bands": {"0": 4}},
        {"t": 2.0, "held": 0, "endpoints": {"a": "SERVING"}, "bands": {"0": 0}},
    ]
    figures = _figure_of(timeline, monkeypatch)
    timeline.plot_timeline(tmp_path / "t.png", monitor, [(0.0, 2.0, "train")], [])
    held = figures[0].axes[1]
    total, band0 = (next(ln for ln in held.get_lines() if ln.get_label() == name) for name in ("all bands", "band 0"))
    assert list(total.get_ydata()) == list(band0.get_ydata()), "the case: the same values"
    assert (
        total.get_zorder() > band0.get_zorder()
        and total.get_linestyle() == "--"
        and band0.get_linewidth() > total.get_linewidth()
    )
