"""benchmarks.gate_check_cost runs at a tiny size and writes what its docs promise; its figures are in
docs/benchmarks.md#gate-cpu-per-request, not asserted here (no timed assertions): only what must hold whatever the
machine's speed."""

from __future__ import annotations

import json

import pytest

from benchmarks import gate_check_cost


def test_gate_check_cost_tiny_run_completes_every_admission_and_writes_json_png_and_summary(tmp_path):
    out = tmp_path / "gate_check_cost.json"
    assert gate_check_cost.main(["--out", str(out), "--checks", "300", "--batch", "44", "--rounds", "2"]) == 0
    res = json.loads(out.read_text())
    assert res["checks"] == 300 and res["rounds"] == 2 and len(res["per_round"]) == 2
    for key in ("check_us", "completion_us", "floor_check_us", "total_us", "check_ratio_to_floor"):
        assert res[key] > 0, key
    assert res["total_us"] == pytest.approx(res["check_us"] + res["completion_us"])
    assert 300 < res["entry_bytes"] < 700, "entries of the size Envoy writes (~430 bytes)"
    assert out.with_suffix(".png").stat().st_size > 5_000
    assert "check_ratio_to_floor" in out.with_suffix(".txt").read_text()


def test_gate_check_cost_refuses_a_zero_size_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        gate_check_cost.main(["--out", str(tmp_path / "x.json"), "--checks", "0"])
    assert exc.value.code == 2
    assert "--checks, --batch and --rounds must be >= 1, got 0, 44, 5" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    ("out", "words"),
    [
        ("{tmp}", "is a directory; give the JSON file to write"),
        ("{tmp}/file.txt/x.json", "cannot create its folder"),
    ],
)
def test_gate_check_cost_refuses_an_unusable_out_before_it_runs(tmp_path, capsys, out, words):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(SystemExit) as exc:
        gate_check_cost.main(["--out", out.format(tmp=tmp_path), "--checks", "1", "--rounds", "1"])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err
