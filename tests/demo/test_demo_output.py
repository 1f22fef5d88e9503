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
