"""Fast unit tests of the RL rollout duty-cycle model (benchmarks/rl_model/) and the real run's helpers."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx
import pytest

from benchmarks import rl_model as m
from benchmarks.rl_real import bulk_state_rates, phase_delta, scrape_phases

pytestmark = pytest.mark.torch  # in the xdist worker that imports torch (tests/conftest.py)


def _inp(**values) -> dict[str, m.Input]:
    inp = m.default_inputs()
    for k, v in values.items():
        inp[k] = replace(inp[k], value=v)
    return inp


def _run(inp, name, **wl):
    workload = m.make_workload(inp, **wl)
    return m.simulate(m.make_strategy(name, inp, workload.model_b, workload.group_size), workload), workload


@pytest.mark.parametrize(("frac", "gap", "size"), [(0.5, 3.0, 7), (0.3, 10.0, 7), (0.7, 0.0, 14), (0.5, 25.0, 1.5)])
def test_dedicated_duty_cycle_equals_the_analytic_value(frac, gap, size):
    res, wl = _run(m.default_inputs(), "dedicated", rollout_fraction=frac, cpu_gap_s=gap, model_b=size)
    assert res["duty_cycle"] == pytest.approx(m.analytic_dedicated(wl), rel=1e-9)
    assert res["duty_cycle"] == pytest.approx((wl.rollout_s + wl.train_s) / (2 * (wl.rollout_s + wl.train_s + wl.gap_s)))
    assert res["training_step_s"] == pytest.approx(wl.train_s)  # never waits, never switches
    assert res["accelerators"] == 16  # two jobs, 4 + 4 accelerators each


@pytest.mark.parametrize("frac", [0.25, 0.4, 0.5, 0.6, 0.75])
def test_zero_cost_switch_reaches_the_ceiling(frac):
    res, wl = _run(m.default_inputs(), "ceiling", rollout_fraction=frac)
    assert res["duty_cycle"] == pytest.approx(m.analytic_ceiling(wl), rel=1e-3)
    # this project's strategy with every switch cost set to zero lands on the same ceiling
    zero = _inp(
        **{
            k: 0.0
            for k in (
                "ts_drain_s",
                "ts_sleep_control_s",
                "ts_wake_control_s",
                "ts_release_s",
                "ts_grant_s",
                "vllm_sleep_fixed_s",
                "vllm_wake_fixed_s",
            )
        },
        vllm_sleep_wake_gbps=1e12,
        pcie_gbps=1e12,
        device_checksum_gbps=1e12,
        device_checksum_fixed_s=0.0,
    )
    ours, _ = _run(zero, "llmd_timeslice", rollout_fraction=frac)
    assert ours["duty_cycle"] == pytest.approx(res["duty_cycle"], rel=1e-6)


def test_time_slicing_doubles_at_most_the_dedicated_duty_cycle():
    """Two jobs, phases keep their allotment: the ceiling is 2x dedicated (41% -> at most 82%)."""
    inp = m.default_inputs()
    gap = m.gap_for_dedicated_duty(inp, 0.41)
    ded, _ = _run(inp, "dedicated", cpu_gap_s=gap)
    ceil, _ = _run(inp, "ceiling", cpu_gap_s=gap)
    assert ded["duty_cycle"] == pytest.approx(0.41, abs=1e-6)
    assert ceil["duty_cycle"] == pytest.approx(0.82, abs=1e-3)


def _components(name, model_b, role, suspend=True, **values):
    inp = _inp(**values)
    s = m.make_strategy(name, inp, model_b, 4)
    return {c.name: c.seconds for c in (s.suspend(role) if suspend else s.resume(role))}


def test_byte_costs_scale_with_the_bytes_moved():
    small, big = _components("llmd_timeslice", 1.0, "trainer"), _components("llmd_timeslice", 2.0, "trainer")
    assert big["trainer offload: state/PCIe into reused pinned buffers"] == pytest.approx(
        2 * small["trainer offload: state/PCIe into reused pinned buffers"]
    )
    check, fixed = "trainer state checksum on the device (torch reductions)", 0.15
    assert big[check] - fixed == pytest.approx(2 * (small[check] - fixed))  # bytes part scales, per-tensor part fixed
    assert small[check] == pytest.approx(fixed + 1e9 * 16 / 4 / 1300e9)
    assert small["trainer offload: state/PCIe into reused pinned buffers"] == pytest.approx(1e9 * 16 / 4 / 50e9)
    # vLLM level-1 sleep: fixed part + weights / bandwidth
    s1, s2 = _components("llmd_timeslice", 1.0, "sampler"), _components("llmd_timeslice", 2.0, "sampler")
    key = "sampler vLLM level-1 sleep (fixed + weights/15 GB/s)"
    assert s2[key] - 0.9 == pytest.approx(2 * (s1[key] - 0.9))
    # doubling the PCIe bandwidth halves the transfer
    fast = _components("llmd_timeslice", 1.0, "trainer", pcie_gbps=100.0)
    assert fast["trainer offload: state/PCIe into reused pinned buffers"] == pytest.approx(
        small["trainer offload: state/PCIe into reused pinned buffers"] / 2
    )


def test_process_checkpoint_moves_the_whole_footprint_whatever_the_model():
    a, b = _components("reference", 1.5, "trainer"), _components("reference", 14, "trainer")
    assert a == b
    raw = a["trainer cuda-checkpoint checkpoint (process start + fixed + footprint/PCIe)"]
    assert raw == pytest.approx(2.7 + 1.0 + 0.9 * 80e9 / 50e9)
    assert a["trainer checkpoint: 1 s operation poll"] == pytest.approx(6.0 - raw)  # observed at the next 1 s poll


def test_device_resident_trainer_state_is_capped_by_the_footprint():
    by = m.Bytes(m.default_inputs(), 70, 4)
    assert not by.trainer_state_fits
    assert by.trainer_state == pytest.approx(0.9 * 80e9)
    assert m.Bytes(m.default_inputs(), 7, 4).trainer_state_fits


def test_poll_rounds_up_to_the_next_tick():
    assert m._poll(5.14, 1.0) == pytest.approx(6.0)
    assert m._poll(2.0, 1.0) == pytest.approx(2.0)
    assert m._poll(0.3, 0.0) == pytest.approx(0.3)


def test_training_step_is_dedicated_plus_one_handover_when_phases_are_balanced():
    inp = m.default_inputs()
    ours, wl = _run(inp, "llmd_timeslice")
    s = m.make_strategy("llmd_timeslice", inp, wl.model_b, wl.group_size)
    handover = sum(c.seconds for c in s.suspend("trainer") + s.resume("trainer"))
    assert ours["training_step_s"] == pytest.approx(wl.train_s + handover, rel=1e-6)
    assert ours["rollout_wait_s_mean"] >= 0


def test_strategies_order_and_targets_on_the_default_workload():
    cfg = m.run_config(m.default_inputs())
    r = {n: v["duty_cycle"] for n, v in cfg["results"].items()}
    assert r["dedicated"] < r["reference"] < r["llmd_timeslice"] < r["ceiling"] <= 1.0
    assert r["reference"] < r["reference_vllm_sleep"]  # checkpointing samplers costs more than sleeping them
    ours = cfg["results"]["llmd_timeslice"]
    assert ours["duty_cycle"] >= 0.90 and ours["training_step_vs_dedicated"] <= 1.05
    # the historical host-BLAKE2b verification misses the target by far: ~57 s per trainer handover at 7B
    old = cfg["results"]["llmd_timeslice_host_blake2b"]
    assert r["dedicated"] < old["duty_cycle"] < r["llmd_timeslice"] and old["training_step_vs_dedicated"] > 2
    assert cfg["results"]["dedicated"]["training_step_vs_dedicated"] == pytest.approx(1.0)


def test_with_measured_replaces_only_measured_inputs():
    real = {
        "run_id": "x",
        "model_inputs": {
            "ts_drain_s": {"value": 0.5},
            "pcie_gbps": {"value": 1.0},
            "cpu_checksum_gbps": {"value": 3.5},
            "blake2b_gbps_this_machine": {"value": 0.3},
        },
    }
    inp = m.with_measured(m.default_inputs(), real)
    assert inp["ts_drain_s"].value == 0.5 and "(x)" in inp["ts_drain_s"].source
    assert inp["cpu_checksum_gbps"].value == 3.5
    assert "blake2b_gbps_this_machine" not in inp  # unknown keys are ignored
    assert inp["device_checksum_gbps"].kind == "assumption"  # no accelerator here: the device rate is not measured
    assert inp["pcie_gbps"].value == 50  # published inputs are never overwritten
    assert all(i.kind in ("published", "measured here", "assumption") for i in inp.values())
    assert all(i.source for i in inp.values())


def test_model_cli_writes_json_with_provenance_and_png(tmp_path):
    from benchmarks.rl_rollout import main

    assert main(["--mode", "model", "--out", str(tmp_path), "--no-sweep"]) == 0
    rep = json.loads((tmp_path / "rl_model.json").read_text())
    assert set(rep["duty_cycle"]) == {"dedicated", "reference", "llmd_timeslice"}
    for key in ("rollout_throughput_req_per_s_per_8_acc", "training_step_s", "rollout_p99_latency_s"):
        assert set(rep[key]) == {"dedicated", "reference", "llmd_timeslice"}
    assert rep["provenance"]["published_inputs"] and rep["provenance"]["measured_here"]
    assert rep["inputs"]["probe_drain_s"]["kind"] == "published"
    assert "trace" not in rep["scenarios"]["default"]["results"]["reference"]
    assert (tmp_path / "rl_model.png").stat().st_size > 10_000


def test_model_cli_takes_the_measured_figures_of_a_real_run(tmp_path):
    from benchmarks.rl_rollout import main

    bulk = {"trainer_state_bytes": 1.07e9, "tensors": 20, "offload_gbps": 1.5, "restore_gbps": 0.9, "checksum_gbps": 2.5}
    real = {
        "run_id": "rl_real test",
        "summary": {"bulk_state": bulk},
        "model_inputs": {"ts_sleep_control_s": {"value": 0.5}, "cpu_checksum_gbps": {"value": 2.5}},
    }
    (tmp_path / "rl_real.json").write_text(json.dumps(real))
    assert main(["--mode", "model", "--out", str(tmp_path), "--no-sweep"]) == 0
    rep = json.loads((tmp_path / "rl_model.json").read_text())
    assert rep["provenance"]["measured_here"]["ts_sleep_control_s"] == 0.5
    assert rep["provenance"]["measured_here"]["cpu_checksum_gbps"] == 2.5
    assert rep["measured_here_cpu"]["offload_gbps"] == 1.5 and rep["measured_here_cpu"]["from"] == "rl_real test"
    assert rep["inputs"]["ts_sleep_control_s"]["source"].endswith("(rl_real test)")


def test_checksum_runs_on_the_device_before_copy_out_and_after_copy_in():
    """As implemented: checksum where the tensor lives, then PCIe out; PCIe in, then checksum."""
    inp = m.default_inputs()
    s = m.make_strategy("llmd_timeslice", inp, 7, 4)
    out, back = [c.name for c in s.suspend("trainer")], [c.name for c in s.resume("trainer")]
    assert out.index("trainer state checksum on the device (torch reductions)") < out.index(
        "trainer offload: state/PCIe into reused pinned buffers"
    )
    assert back.index("trainer restore: state/PCIe from pinned buffers") < back.index(
        "trainer state checksum on the device (torch reductions)"
    )
    handover = sum(c.seconds for c in s.suspend("trainer") + s.resume("trainer"))
    # 28 GB per rank: 2 x 0.56 s over PCIe + 2 x (0.15 + 28/1300) s of checksum + grant and release
    control = inp["ts_grant_s"].value + inp["ts_release_s"].value
    assert handover == pytest.approx(2 * 28 / 50 + 2 * (0.15 + 28 / 1300) + control, rel=1e-6)
    assert handover < 2.0
    # the historical variant hashes the host copy on one core: 28 s each way
    old = m.make_strategy("llmd_timeslice_host_blake2b", inp, 7, 4)
    parts = {c.name: c.seconds for c in old.suspend("trainer") + old.resume("trainer")}
    assert parts["trainer state checksum: BLAKE2b on one host core"] == pytest.approx(28.0)
    assert [c.name for c in old.resume("trainer")][-1] == "trainer restore: state/PCIe from pinned buffers"
    # the sampler side is the same in both
    assert [c.seconds for c in old.suspend("sampler")] == [c.seconds for c in s.suspend("sampler")]


def test_sensitivity_uses_the_cpu_checksum_rate_as_a_floor():
    inp = _inp(cpu_checksum_gbps=2.0)
    rep = m.build_report(inp, None, None, do_sweep=False)
    rows = {r["change"]: r for r in rep["sensitivity"] if r["strategy"] == "llmd_timeslice"}
    floor = next(r for c, r in rows.items() if c.startswith("floor"))
    assert floor["kind"] == "measured here" and "2.00 GB/s" in floor["change"]
    # 28 GB at 2 GB/s = 14 s per direction: far slower than the modelled device rate
    assert floor["training_step_vs_dedicated"] > rep["vs_dedicated"]["llmd_timeslice"]["training_step"] + 0.3
    slower = next(r for c, r in rows.items() if c.startswith("device checksum 10x slower"))
    assert rep["duty_cycle"]["llmd_timeslice"] > slower["duty_cycle"] > floor["duty_cycle"]
    assert rep["measured_here_cpu"]["from"].startswith("built-in defaults")
    assert rep["target"]["llmd_timeslice"]["met"] and not rep["target"]["llmd_timeslice_host_blake2b"]["met"]


def test_bulk_state_rates_measures_the_implemented_offloader():
    r = bulk_state_rates(8 * 2**20, reps=1)
    assert 8 * 2**20 <= r["trainer_state_bytes"] < 8 * 2**20 + 4096  # 4 parts of 2 MiB + Adam's step tensors
    assert r["tensors"] == 4 + 1  # param, grad, exp_avg, exp_avg_sq, step
    assert all(r[k] > 0.01 for k in ("checksum_gbps", "offload_gbps", "restore_gbps"))


def test_scrape_and_delta_of_the_orchestrator_histogram():
    name = "llmd_timeslice_orchestrator_switch_phase_seconds"

    def text(drain_sum, count):
        return (
            "# HELP llmd_timeslice_orchestrator_switch_phase_seconds Seconds per phase-switch step.\n"
            "# TYPE llmd_timeslice_orchestrator_switch_phase_seconds histogram\n"
            f'{name}_bucket{{group_id="rollout-group",phase="drain",le="+Inf"}} {count}\n'
            f'{name}_count{{group_id="rollout-group",phase="drain"}} {count}\n'
            f'{name}_sum{{group_id="rollout-group",phase="drain"}} {drain_sum}\n'
            f'{name}_count{{group_id="other",phase="drain"}} 9.0\n'
            f'{name}_sum{{group_id="other",phase="drain"}} 9.0\n'
        )

    pages = iter([text(0.5, 2.0), text(0.8, 3.0)])

    async def go():
        transport = httpx.MockTransport(lambda req: httpx.Response(200, text=next(pages)))
        async with httpx.AsyncClient(transport=transport) as c:
            return await scrape_phases(c, "http://x/metrics"), await scrape_phases(c, "http://x/metrics")

    before, after = asyncio.run(go())
    assert before["drain"] == [0.5, 2.0]
    assert phase_delta(before, after, "drain") == pytest.approx(0.3)
    assert phase_delta(before, after, "wake") is None
    assert phase_delta(after, after, "drain") is None


# ------------------------------------------------------------------ second traffic class (eval), issue 26
def _eval_sim(name="llmd_timeslice", inp=None, ev=None, layout="colocated", iterations=10):
    inp = inp or m.default_inputs()
    wl = m.make_workload(inp, layout=layout, iterations=iterations)
    return m.simulate_eval(m.make_strategy(name, inp, wl.model_b, wl.group_size), wl, ev), wl


@pytest.mark.parametrize("layout", ["colocated", "crossed"])
def test_without_eval_traffic_the_eval_model_is_the_duty_cycle_model(layout):
    inp = m.default_inputs()
    ours, wl = _eval_sim(inp=inp, layout=layout)
    s = m.make_strategy("llmd_timeslice", inp, wl.model_b, wl.group_size)
    plain = m.simulate(s, wl)
    # the same schedule, except that the release wakes the sampler at once: its wake leaves the rollout's path
    wake = sum(c.seconds for c in s.suspend("trainer") + s.resume("sampler"))
    assert plain["duty_cycle"] <= ours["duty_cycle"] <= plain["duty_cycle"] * (1 + wake / plain["iteration_s"]) + 1e-9
    assert ours["training_step_s"] == pytest.approx(plain["training_step_s"], rel=1e-9)
    assert ours["eval_requests"] == 0 and ours["yield_requests"]["sent"] == 0


def test_without_yield_requests_eval_waits_out_the_training_phase_and_training_is_untouched():
    inp = m.default_inputs()
    none, wl = _eval_sim(inp=inp)
    off, _ = _eval_sim(inp=inp, ev=m.eval_class(inp, yield_requests=False))
    assert off["duty_cycle"] == pytest.approx(none["duty_cycle"], rel=1e-9)  # nobody asks: same schedule
    assert off["yield_requests"]["sent"] == 0
    # a request that arrives as the trainer is granted waits the whole phase (+ the switches around it)
    assert wl.train_s < off["eval_hold_max_s"] < wl.train_s + 10
    assert off["eval_hold_p99_s"] > 0.9 * wl.train_s
    assert 0.3 < off["eval_held_fraction"] < 0.7  # about the share of time the trainer holds the group
    assert off["eval_failed"] == 0  # the band's longest hold (120 s) is above the phase


def test_with_free_switches_the_eval_hold_is_bounded_by_the_policy_and_safe_point_delays():
    """ceiling (zero-cost switches), min_training_s = 0: a held request waits at most fraction x deadline, the gate's
    report period, one heartbeat and one training step (plus its own service while the sampler drains)."""
    inp = m.default_inputs()
    ev = m.eval_class(inp, min_training_s=0.0, train_step_s=0.5, heartbeat_period_s=0.5, service_s=0.1)
    res, _ = _eval_sim("ceiling", inp=inp, ev=ev)
    bound = ev.fraction * ev.hold_deadline_s + ev.pressure_period_s + ev.heartbeat_period_s + ev.train_step_s + ev.service_s
    assert res["eval_hold_max_s"] <= bound + 1e-6
    assert res["eval_hold_p99_s"] <= ev.hold_deadline_s
    assert res["yield_requests"]["honoured"] > 0 and res["eval_failed"] == 0
    # every yield re-grants: the training phase is only cut, never shortened (the same compute is done)
    assert res["training_step_s"] >= m.make_workload(inp, layout="colocated").train_s


def test_min_training_bounds_the_yields_and_trades_eval_hold_for_duty_cycle():
    inp = m.default_inputs()
    rows = m.eval_tradeoff(inp, min_training=(0.0, 5.0, 20.0), steps=(2.0,), iterations=8)
    wl = m.make_workload(inp, layout="colocated")
    yields = [r["yields_per_iteration"] for r in rows]
    duty = [r["duty_cycle_vs_no_eval"] for r in rows]
    p99 = [r["eval_hold_p99_s"] for r in rows]
    assert yields[0] > yields[1] > yields[2] > 0
    assert duty[0] < duty[1] < duty[2] <= 1.0
    assert p99[0] < p99[1] < p99[2]
    for r in rows:  # at most one yield per min_training_s of training (+ the one at the phase's start)
        assert r["yields_per_iteration"] <= wl.train_s / max(r["min_training_s"], 1e-9) + 1


def test_run_eval_reports_the_benchmark_runs_side_by_side():
    rep = m.run_eval(m.default_inputs(), iterations=8, min_training_s=5.0)
    assert set(rep["runs"]) == set(m.EVAL_RUNS) and rep["deadline_s"] == 5.0
    on, off = rep["runs"]["yield_on"], rep["runs"]["yield_off"]
    assert rep["runs"]["no_eval"]["duty_cycle_vs_no_eval"] == 1.0
    assert on["eval_hold_p99_s"] < off["eval_hold_p99_s"]
    assert on["duty_cycle"] < off["duty_cycle"]  # each yield costs two handovers
    assert on["yield_requests"]["request_to_yield_s_mean"] > 0


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("hold_deadline_s", 0.0, "hold deadline must be in (0, max_hold_s=120.0], got 0.0"),
        ("hold_deadline_s", 500.0, "hold deadline must be in (0, max_hold_s=120.0], got 500.0"),
        ("fraction", 1.5, "yield request fraction must be in (0, 1], got 1.5"),
        ("rps", -1.0, "eval rps must be >= 0, got -1.0"),
        ("min_training_s", -2.0, "min_training_s must be >= 0, got -2.0"),
        ("train_step_s", 0.0, "train_step_s must be > 0, got 0.0"),
    ],
)
def test_bad_eval_class_inputs_are_refused_naming_the_value(field, value, words):
    with pytest.raises(ValueError) as err:
        m.eval_class(m.default_inputs(), **{field: value})
    assert words in str(err.value)


def test_eval_class_needs_a_layout_where_a_trainer_takes_the_samplers_group():
    inp = m.default_inputs()
    with pytest.raises(ValueError, match="layout 'interleaved' never lends"):
        _eval_sim(inp=inp, ev=m.eval_class(inp), layout="interleaved")
    with pytest.raises(ValueError, match="dedicated samplers never sleep"):
        _eval_sim("dedicated", inp=inp, ev=m.eval_class(inp))
