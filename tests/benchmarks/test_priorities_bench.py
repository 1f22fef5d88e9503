"""benchmarks.priorities runs end to end at tiny sizes (the stack of `llmd-timeslice up`: Envoy, gate, orchestrator,
sidecars as processes, on fake engines) and writes what its docs promise; its figures are in docs/benchmarks.md,
not asserted here (no timed assertions): only what must hold whatever the machine's speed."""

from __future__ import annotations

import json

import pytest

from benchmarks import priorities


def test_priorities_benchmark_tiny_run_writes_json_png_and_summary(tmp_path):
    # The machinery end to end, not its figures: each training phase (1 s) still spans the eval band's deadline
    # (0.6 s), so a held eval request reaches half of it (the yield-request fraction, 0.3 s) early in the phase and
    # asks the trainer to yield (heard on its heartbeat, every 0.2 s; honoured at a 0.1 s step boundary); rollouts
    # and evals are served in 0.05 s; one engine (one sidecar process): the switch over several engines is the
    # orchestrator's tests' matter, not this benchmark's.
    args = ["--out", str(tmp_path), "--iterations", "1", "--batch", "2", "--train-s", "1.0", "--step-s", "0.1"]
    args += ["--eval-rps", "6", "--deadline-s", "0.6", "--min-training-s", "0.2", "--lease-ttl-s", "0.6"]
    args += ["--rollout-service-s", "0.05", "--eval-service-s", "0.05", "--engines", "1"]
    assert priorities.main(args) == 0
    res = json.loads((tmp_path / "priorities.json").read_text())
    assert res["deadline_s"] == 0.6 and set(res["runs"]) == set(priorities.RUNS)
    assert 0 < res["runs"]["no_eval"]["duty_cycle"] < 1
    for name in ("yield_off", "yield_on"):
        r = res["runs"][name]
        for key in ("eval_hold_p99_s", "rollout_hold_p99_s", "duty_cycle", "requests_failed"):
            assert r[key] is not None, (name, key)
        assert r["requests_failed"] == 0, r["failures"]
        assert r["eval_requests"] > 0 and r["rollout_requests"] == 2
    assert res["runs"]["no_eval"]["eval_requests"] == 0
    # the opted-out trainer is never asked; the other one is, and yields at a step boundary
    assert res["runs"]["yield_off"]["yields"] == 0
    assert res["runs"]["yield_on"]["yields"] >= 1
    outcomes = res["yield_requests_by_outcome"]
    assert outcomes.get("honoured", 0) >= 1 and outcomes.get("suppressed", 0) >= 1, outcomes
    assert set(res["targets"]) == {
        "eval_p99_within_deadline_with_yield_on",
        "eval_p99_above_deadline_with_yield_off",
        "duty_cycle_within_10pct_of_no_eval",
        "zero_failed",
    }
    assert (tmp_path / "priorities.png").stat().st_size > 10_000
    assert "targets:" in (tmp_path / "priorities.txt").read_text()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--deadline-s", "50"], "--deadline-s 50.0 is above the eval band's longest hold 30.0"),
        (["--step-s", "20"], "--step-s 20.0 is longer than the training phase --train-s 10.0"),
        (["--eval-rps", "0"], "--eval-rps must be > 0, got 0.0"),
        (["--iterations", "0"], "iterations, batch and engines must be >= 1, got 0, 8, 2"),
    ],
)
def test_priorities_benchmark_refuses_bad_parameters_naming_them(tmp_path, capsys, args, words):
    with pytest.raises(SystemExit) as exc:
        priorities.main(["--out", str(tmp_path), *args])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "priorities.json").exists()
