"""``llmd-timeslice demo --eval-rps``: the stack it builds declares the eval class, its band and the yield-request
knobs; its summary computes the eval figures from the request records; the CLI shows and checks the options."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
from typer.testing import CliRunner

from llmd_timeslice.cli import app
from llmd_timeslice.demo.run import EVAL_SUMMARY_LINES, SUMMARY_LINES, _summary, eval_summary, summary_lines
from llmd_timeslice.demo.stack import EVAL_OBJECTIVE, EVAL_PRIORITY, demo_stack_file
from llmd_timeslice.domain.objectives import load_objectives_file
from llmd_timeslice.local.commands import StackCommands


def _model(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir(exist_ok=True)
    return tmp_path / "model"


def test_eval_stack_declares_the_objective_its_band_deadline_and_the_groups_yield_knobs(tmp_path):
    sf = demo_stack_file(tmp_path, _model(tmp_path), "g", eval_deadline_s=5.0)
    cmds = StackCommands(sf, tmp_path, tmp_path, tmp_path / "token")
    path = cmds.write_objectives()
    assert path is not None and "--objectives" in cmds.gate().args(), "the gate is given the objectives file"
    pool = load_objectives_file(path, max_hold_s=sf.stack.max_hold_s).for_pool("default", "default", sf.stack.max_hold_s)
    band = pool.band(EVAL_PRIORITY)
    assert EVAL_OBJECTIVE == "eval" and EVAL_PRIORITY == 10
    assert [(o.name, o.priority) for o in sf.objectives] == [("eval", 10)]
    assert band.hold_deadline_s == 5.0 and band.max_hold_s == sf.stack.max_hold_s
    group = sf.inventory().groups[0]
    assert group.min_training_s == 1.0 and group.yield_request_fraction == 0.4, "the orchestrator's inventory has the knobs"


def test_plain_demo_stack_has_no_objectives_and_the_default_group_knobs(tmp_path):
    sf = demo_stack_file(tmp_path, _model(tmp_path), "g")
    cmds = StackCommands(sf, tmp_path, tmp_path, tmp_path / "token")
    assert sf.gate_objectives() is None and cmds.write_objectives() is None
    assert "--objectives" not in cmds.gate().args()
    assert sf.groups[0].min_training_s == 10.0, "today's demo: the group setting's default"


@pytest.mark.parametrize(("deadline", "says"), [(0.0, "greater than 0"), (500.0, "above the band's max_hold_s 120")])
def test_eval_deadline_out_of_range_is_refused_naming_it(tmp_path, deadline, says):
    with pytest.raises(pydantic.ValidationError) as exc:
        demo_stack_file(tmp_path, _model(tmp_path), "g", eval_deadline_s=deadline)
    assert "priority_bands.0" in str(exc.value) and says in str(exc.value)


def _rec(kind: str, hold_ms: float, ok: bool = True) -> dict:
    return {"kind": kind, "ok": ok, "hold_ms": hold_ms, "stream": False, "weight_version": 1, "min_weight_version": 0}


def test_eval_summary_from_records_and_yields():
    records = [_rec("eval", h) for h in (0, 0, 1200, 3000, 6200)] + [_rec("eval", 0, ok=False), _rec("rollout", 9000)]
    yields = [{"asked_at": 10.0, "yielded_at": 11.5}, {"asked_at": 20.0, "yielded_at": 20.25}]
    s = eval_summary(records, yields, eval_rps=1.0, deadline_s=5.0)
    assert (s["eval_requests"], s["eval_failed"], s["eval_held"]) == (6, 1, 3), "rollout records are not eval ones"
    assert s["eval_hold_ms_p50"] == 1200 and s["eval_hold_ms_max"] == 6200
    assert 3000 < s["eval_hold_ms_p99"] <= 6200
    assert s["eval_deadline_misses"] == 1, "6.2 s > the 5 s deadline; 3 s is within"
    assert (s["yields_honoured"], s["request_to_yield_s_max"]) == (2, 1.5)
    none = eval_summary([_rec("load", 0)], [], eval_rps=1.0, deadline_s=5.0)
    assert (none["eval_requests"], none["eval_hold_ms_p99"], none["yields_honoured"]) == (0, 0.0, 0)


def test_summary_prints_the_eval_lines_only_with_an_eval_class():
    base = _summary([_rec("load", 0), _rec("eval", 2500)], [{"switch_ms": 200, "rollout_weight_versions": [0]}], 6.0, 30.0)
    assert len(summary_lines(base, 40.0)) == 1 + len(SUMMARY_LINES), "no eval figures: today's lines"
    lines = summary_lines(base | eval_summary([_rec("eval", 2500)], [], 1.0, 5.0), 40.0)
    assert len(lines) == 1 + len(SUMMARY_LINES) + len(EVAL_SUMMARY_LINES)
    assert "eval_hold_ms_p99 2500" in lines[-2] and "yields_honoured 0" in lines[-1]


def test_cli_demo_shows_the_eval_options_and_refuses_a_deadline_of_zero():
    r = CliRunner().invoke(app, ["demo", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "--eval-rps" in r.output and "--eval-deadline-s" in r.output, r.output
    r = CliRunner().invoke(app, ["demo", "--eval-rps", "1", "--eval-deadline-s", "0"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "--eval-deadline-s" in r.output, r.output
