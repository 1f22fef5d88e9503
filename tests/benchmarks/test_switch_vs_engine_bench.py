"""The switch-vs-engine benchmark's accounting (the run itself needs real vLLM: benchmarks/switch_vs_engine.py)."""

from __future__ import annotations

import pytest

from benchmarks.switch_vs_engine import CallLog, _summary, breakdown


def _row(acquire_ms: float, release_ms: float, raw_sleep: float, raw_wake: float) -> dict:
    calls = {
        "engine_action": 5.0,
        "verification": 20.0,
        "probe": 0.0,
        "calls": 6.0,
        "backend_op": 40.0,
        "paths_ms": {"/sleep": 5.0},
    }
    wake = {
        "engine_action": 3.0,
        "verification": 8.0,
        "probe": 10.0,
        "calls": 5.0,
        "backend_op": 30.0,
        "paths_ms": {"/wake_up": 3.0},
    }
    row = {
        "raw_sleep_ms": raw_sleep,
        "raw_wake_ms": raw_wake,
        "acquire_ms": acquire_ms,
        "release_ms": release_ms,
        "to_job_phases_ms": {"publish_draining": 1.0, "drain": 2.0, "sleep": 50.0},
        "to_samplers_phases_ms": {"wake": 35.0},
        "acquire_calls_ms": calls,
        "release_calls_ms": wake,
    }
    row["breakdown_ms"] = breakdown(row)
    return row


def test_breakdown_adds_up_to_the_measured_acquire_and_release():
    row = _row(60.0, 40.0, 5.0, 5.0)
    b = row["breakdown_ms"]
    acquire = ("drain_barrier", "sleep_engine_call", "sleep_verification", "sleep_control", "grant")
    assert sum(b[k] for k in acquire) == pytest.approx(60.0)
    assert sum(v for k, v in b.items() if k not in acquire) == pytest.approx(40.0)
    assert b["sleep_control"] == pytest.approx(10.0) and b["grant"] == pytest.approx(7.0)
    assert b["wake_probe"] == 10.0 and b["wake_control_and_publish"] == pytest.approx(5.0)


def test_ratio_to_raw_is_the_whole_switch_over_the_raw_calls_with_its_spread():
    res = _summary([_row(60.0, 40.0, 5.0, 5.0), _row(90.0, 30.0, 10.0, 10.0), _row(60.0, 40.0, 5.0, 5.0)], engines=2)
    assert res["ratio_to_raw"] == pytest.approx(100.0 / 10.0)
    assert res["ratio_to_raw_spread"] == pytest.approx([6.0, 10.0])
    assert res["engine_calls_per_sampler_ms_p50"]["release"]["paths_ms"] == {"/wake_up": 3.0}


def test_call_log_sorts_engine_calls_into_action_probe_and_verification():
    log = CallLog(("/sleep", "/wake_up"))
    log.calls = [("p", "e1", "/sleep", 0.010), ("p", "e1", "/metrics", 0.004), ("p", "e2", "/v1/completions", 0.006)]
    got = log.per_sampler_ms("p", ["e1", "e2"])
    assert got["engine_action"] == pytest.approx(5.0) and got["verification"] == pytest.approx(2.0)
    assert got["probe"] == pytest.approx(3.0) and got["calls"] == 1.5
