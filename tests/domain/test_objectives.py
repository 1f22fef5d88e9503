"""The objectives model (llmd_timeslice/domain/objectives.py): what it accepts, and one line naming the input for
each kind of bad input (the gate's file, the stack file's sections, an InferenceObjective object)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmd_timeslice import protocol
from llmd_timeslice.domain.objectives import (
    INT32_MAX,
    INT32_MIN,
    OBJECTIVE_HEADER,
    Objectives,
    ObjectivesError,
    load_objectives,
    load_objectives_file,
    objective_from_k8s,
)
from tests.support.cli import run_cli


def test_a_pool_gets_its_objectives_and_every_band_with_defaults_from_the_gate():
    o = load_objectives(
        {
            "objectives": [
                {"name": "eval", "priority": 10},
                {"name": "judge", "priority": 10, "max_hold_s": 2},
                {"name": "canary", "pool": "other", "priority": 5},
                {"name": "batch", "priority": -1},
            ],
            "priority_bands": [{"priority": 10, "max_hold_s": 30, "hold_deadline_s": 5}],
        }
    )
    pp = o.for_pool("default", "default", 600)
    assert sorted(pp.objectives) == ["batch", "eval", "judge"], "an objective without a pool is the default pool's"
    assert pp.objectives["eval"].band.max_hold_s == 30 and pp.objectives["eval"].max_hold_s == 30
    assert pp.objectives["judge"].max_hold_s == 2, "the objective's own longest hold overrides its band's"
    assert pp.objectives["batch"].band.sheddable and pp.objectives["batch"].max_hold_s == 600
    assert pp.band(0).max_hold_s == 600 and pp.band(0).hold_deadline_s is None, "undeclared band: the gate's hold"
    assert sorted(o.for_pool("other", "default", 600).objectives) == ["canary"]
    assert OBJECTIVE_HEADER == protocol.OBJECTIVE_HEADER == "x-gateway-inference-objective"


@pytest.mark.parametrize(
    ("data", "line"),
    [
        ({"objectives": [{"name": "eval"}, {"name": "eval", "priority": 3}]}, "objective 'eval' is also objectives[0]"),
        ({"objectives": [{"name": "Eval_1"}]}, "objectives[0]: name 'Eval_1' is not a Kubernetes object name"),
        ({"objectives": [{"name": "x", "priority": INT32_MAX + 1}]}, "objectives[0].priority: Input should be less than"),
        ({"objectives": [{"name": "x", "priority": INT32_MIN - 1}]}, "objectives[0].priority: Input should be greater"),
        ({"objectives": [{"name": "x", "priority": "high"}]}, "objectives[0].priority: Input should be a valid integer"),
        ({"objectives": [{"name": "x", "max_hold_s": 0}]}, "objectives[0].max_hold_s: Input should be greater than 0"),
        ({"priority_bands": [{"priority": 1, "max_hold_s": -3}]}, "priority_bands[0].max_hold_s: Input should be greater"),
        ({"priority_bands": [{"priority": 1, "hold_deadline_s": 0}]}, "priority_bands[0].hold_deadline_s: Input should be"),
        (
            {"priority_bands": [{"priority": 1, "max_hold_s": 10, "hold_deadline_s": 12}]},
            "priority_bands[0]: hold_deadline_s 12 is above the band's max_hold_s 10",
        ),
        ({"priority_bands": [{"priority": 1}, {"priority": 1}]}, "priority_bands[1]: band 1 is also priority_bands[0]"),
        ({"priority_bands": [{"priorty": 1}]}, "priority_bands[0].priorty: unknown key (did you mean"),
        ({"objectivs": []}, "objectivs: unknown key (did you mean objectives?)"),
        ([1, 2], "expected a mapping with objectives and priority_bands, got list"),
    ],
)
def test_each_kind_of_bad_input_is_one_line_naming_it(data, line):
    with pytest.raises(ObjectivesError) as exc:
        load_objectives(data, "f.yaml")
    assert any(line in e for e in exc.value.errors), exc.value.errors
    assert all("\n" not in e for e in exc.value.errors)
    assert str(exc.value).startswith("f.yaml: ")


def test_against_the_gate_a_hold_above_its_max_hold_and_a_deadline_above_the_gates_hold_are_refused(tmp_path):
    o = Objectives.model_validate(
        {
            "objectives": [{"name": "eval", "max_hold_s": 900}],
            "priority_bands": [{"priority": 5, "max_hold_s": 700}, {"priority": 1, "hold_deadline_s": 200}],
        }
    )
    problems = o.check(max_hold_s=120)
    assert problems == [
        "priority_bands[0].max_hold_s: 700 is above the gate's max_hold_s 120 (Envoy's timeouts are rendered from the gate's)",
        "priority_bands[1].hold_deadline_s: 200 is above the band's longest hold 120 s: a request would be refused before "
        "its deadline",
        "objectives[0] (eval).max_hold_s: 900 is above the gate's max_hold_s 120",
    ]
    f = tmp_path / "objectives.yaml"
    f.write_text("priority_bands:\n  - priority: 1\n    hold_deadline_s: 200\n")
    with pytest.raises(ObjectivesError, match=r"objectives.yaml: priority_bands\[0\].hold_deadline_s: 200 is above"):
        load_objectives_file(f, max_hold_s=120)
    f.write_text("objectives:\n  - name: a\n    name: b\n")
    with pytest.raises(ObjectivesError, match="duplicate key 'name' \\(line 2 and line 3\\)"):
        load_objectives_file(f)
    f.write_text("")
    assert load_objectives_file(f) == Objectives(), "an empty file: no objectives, no bands"


def test_an_inference_objective_object_reads_as_the_api_server_returns_it():
    obj = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": "eval", "namespace": "ns", "annotations": {"timeslice.io/max-hold-s": "20"}},
        "spec": {"priority": 10, "poolRef": {"name": "qwen"}},
    }
    group, entry = objective_from_k8s(obj)
    assert group == "inference.networking.k8s.io" and (entry.name, entry.pool, entry.priority, entry.max_hold_s) == (
        "eval",
        "qwen",
        10,
        20.0,
    )
    assert objective_from_k8s({"metadata": {"name": "x"}, "spec": {"poolRef": {"name": "p"}}})[1].priority == 0, (
        "spec.priority unset reads as 0, as the EPP reads it"
    )
    with pytest.raises(ObjectivesError, match=r"InferenceObjective ns/huge: spec.priority: Input should be less"):
        objective_from_k8s(
            {"metadata": {"name": "huge", "namespace": "ns"}, "spec": {"priority": 2**40, "poolRef": {"name": "p"}}}
        )
    with pytest.raises(ObjectivesError, match=r"annotation timeslice\.io/max-hold-s: expected seconds, got 'soon'"):
        objective_from_k8s(
            {"metadata": {"name": "x", "annotations": {"timeslice.io/max-hold-s": "soon"}}, "spec": {"poolRef": {"name": "p"}}}
        )
    with pytest.raises(ObjectivesError, match=r"spec\.poolRef\.name: required"):
        objective_from_k8s({"metadata": {"name": "x"}, "spec": {}})


def test_gate_flag_objectives_is_in_the_help_and_a_bad_file_is_one_line_and_exit_2(tmp_path):
    r = run_cli("gate", "--help")
    assert r.returncode == 0 and "--objectives FILE" in r.stdout and "--objectives-from-kubernetes" in r.stdout
    f = tmp_path / "objectives.yaml"
    f.write_text("priority_bands:\n  - priority: 10\n    hold_deadline_s: -1\n")
    r = run_cli("gate", "--objectives", str(f), "--metrics-port", "0")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [f"llmd-timeslice: error: {f}: priority_bands[0].hold_deadline_s: Input should be greater than 0"], r.stderr
    f.write_text("priority_bands:\n  - priority: 10\n    hold_deadline_s: 700\n")
    r = run_cli("gate", "--objectives", str(f), "--max-hold-s", "600")
    assert r.returncode == 2 and "hold_deadline_s: 700 is above the band's longest hold 600 s" in r.stderr, r.stderr
    r = run_cli("gate", "--objectives", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "missing.yaml" in r.stderr and "Traceback" not in r.stderr


def test_objects_of_both_groups_are_read_alike():
    """llm-d.ai/v1alpha2 (llm-d-router) and inference.networking.x-k8s.io/v1alpha2 (the inference extension) carry
    the same spec; the fixtures follow one cited commit each (tests/fixtures/inference-objectives/README.md)."""
    import yaml

    folder = Path(__file__).resolve().parents[1] / "fixtures" / "inference-objectives"
    read = {}
    for name in ("llm-d.ai-v1alpha2.yaml", "inference.networking.x-k8s.io-v1alpha2.yaml"):
        for obj in yaml.safe_load_all((folder / name).read_text()):
            group, entry = objective_from_k8s(obj)
            assert group == "inference.networking.k8s.io", (name, group)
            read[(obj["apiVersion"], entry.name)] = (entry.pool, entry.priority)
    assert read == {
        ("llm-d.ai/v1alpha2", "eval"): ("default", 10),
        ("llm-d.ai/v1alpha2", "rollout"): ("default", 0),
        ("llm-d.ai/v1alpha2", "batch"): ("default", -1),
        ("inference.networking.x-k8s.io/v1alpha2", "eval"): ("default", 3),
        ("inference.networking.x-k8s.io/v1alpha2", "legacy-only"): ("default", 1),
    }
