"""benchmarks.scale runs end to end in its quick mode (real orchestrator, gates and sidecars as processes) and writes
the figures its docs promise; the full run's figures are in docs/benchmarks.md, not asserted here."""

from __future__ import annotations

import json


def test_scale_benchmark_quick_mode_writes_runs_with_the_documented_figures(tmp_path):
    from benchmarks import scale

    out = tmp_path / "scale.json"
    assert scale.main(["--quick", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    runs = res["runs"]
    assert {(r["samplers"], r["gates"]) for r in runs} == {(n, m) for n in scale.QUICK_SAMPLERS for m in scale.QUICK_GATES}
    for r in runs:
        assert r["switches"] == scale.QUICK_SWITCHES
        assert r["acquire_ms_p50"] > 0 and r["release_ms_p50"] > 0, r
        assert r["orchestrator_cpu_ms_per_switch"] >= 0 and r["gate_cpu_ms_per_switch"] >= 0
        assert r["endpoint_updates_per_gate_per_switch"] == 4 * r["samplers"], "DRAINING, ASLEEP, WAKING, SERVING each"
        assert 3 <= r["messages_per_gate_per_switch"] <= r["endpoints_changed_per_switch"] + 1, r
        assert r["engine_calls_per_sampler_switch"] > 0
    assert "marginal_orchestrator_cpu_ms_per_sampler" in res["summary"]
    floors = res["floors"]  # the do-nothing command floors, both transports, at N = 1 and the largest N
    assert {(f["transport"], f["samplers"]) for f in floors["runs"]} == {
        (t, n) for t in ("grpc", "tcp") for n in (min(scale.QUICK_SAMPLERS), max(scale.QUICK_SAMPLERS))
    }
    assert all(f["cpu_ms_per_switch"] > 0 for f in floors["runs"]), floors
    assert set(res["summary"]["floor_marginal_cpu_ms_per_sampler"]) == {"grpc", "tcp"}
    assert "grpc.aio floor" in out.with_suffix(".txt").read_text()
    assert out.with_suffix(".png").stat().st_size > 0 and "marginal orchestrator CPU" in out.with_suffix(".txt").read_text()
