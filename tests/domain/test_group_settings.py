"""One model of a group's settings (issue 27): every source parses into GroupSettings, each default is defined once,
and docs/group-settings.md lists every field."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from llmd_timeslice.config import KubernetesDiscoverySettings
from llmd_timeslice.discovery.kubernetes import GROUP_ANNOTATIONS, JOB_ANNOTATIONS, DiscoveryDefaults, build_groups, pod_member
from llmd_timeslice.domain.group_settings import SETTINGS_FIELDS, GroupSettings, GroupSpec, SamplerEndpoint
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.local.stack_file import StackFile
from tests.support.source import parse_source

ROOT = Path(__file__).resolve().parents[2]

SETTINGS = {
    "sleep_level": 2,
    "drain_timeout_s": 15.0,
    "lease_ttl_s": 45.0,
    "policy": "priority",
    "sleep_level_policy": "auto",
    "yield_request_bands": [10],
    "yield_request_fraction": 0.8,
    "min_training_s": 3.0,
    "residual_budget_bytes": {1: 4 * 1024**3, 2: 512 * 1024**2},
}
JOB_SETTINGS = {"job_priorities": {"trainer-a": 5}, "job_sleep_levels": {"trainer-a": 1}, "job_yield_opt_out": ["trainer-a"]}


def _pod(name: str, role: str, annotations: dict[str, str]) -> dict:
    return {
        "metadata": {
            "name": name,
            "uid": name,
            "labels": {"timeslice.io/group": "g0", "timeslice.io/role": role},
            "annotations": annotations,
        },
        "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        "spec": {"containers": [{"name": "vllm", "ports": [{"containerPort": 8000}]}]},
    }


def _annotation_text(value) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def test_every_source_parses_into_the_same_settings():
    want = GroupSettings(**SETTINGS, **JOB_SETTINGS)
    inventory = Inventory.model_validate({"groups": [{"group_id": "g0", **SETTINGS, **JOB_SETTINGS}]})
    stack = StackFile.model_validate(
        {
            "groups": [{"group_id": "g0", **SETTINGS}],
            "jobs": [{"job_id": "trainer-a", "priority": 5, "sleep_level": 1, "yield_opt_out": True}],
            "engines": [{"name": "e0", "group": "g0", "sidecar_port": 9101, "url": "http://127.0.0.1:8001"}],
        }
    ).inventory()
    by_field = {f: a for a, f in GROUP_ANNOTATIONS.items()}
    group_ann = {by_field[k]: _annotation_text(v) for k, v in SETTINGS.items()}
    job_field = {f: a for a, f in JOB_ANNOTATIONS.items()}
    job_ann = {job_field["job_priorities"]: "5", job_field["job_sleep_levels"]: "1", job_field["job_yield_opt_out"]: "true"}
    trainer = _pod("trainer-a", "trainer", {**group_ann, **job_ann})
    members = [m for m in (pod_member(trainer, DiscoveryDefaults()),) if m is not None]
    (from_pods,) = build_groups(members, DiscoveryDefaults())
    for source, spec in (("inventory", inventory.groups[0]), ("stack file", stack.groups[0]), ("pod annotations", from_pods)):
        assert spec.settings() == want, source


def test_every_setting_has_a_pod_annotation_and_a_row_in_the_docs():
    table = (ROOT / "docs" / "group-settings.md").read_text()
    annotations = {**{f: a for a, f in GROUP_ANNOTATIONS.items()}, **{f: a for a, f in JOB_ANNOTATIONS.items()}}
    assert set(annotations) == set(SETTINGS_FIELDS), "a setting without a pod annotation (json_schema_extra)"
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`" in line]
    for name in SETTINGS_FIELDS:
        row = next((r for r in rows if re.search(rf"`{name}[`:]", r)), None)
        assert row is not None, f"docs/group-settings.md has no row for {name}"
        assert f"`{annotations[name]}`" in row, f"{name}: the row does not name its annotation {annotations[name]}"


def test_each_default_is_defined_once():
    """No module but domain/group_settings.py spells a default of a group setting (a class attribute named like a
    setting with a literal value, or Field(<literal>, ...))."""
    owner = ROOT / "llmd_timeslice" / "domain" / "group_settings.py"
    not_a_default = {("SwitchRecord", "sleep_level")}  # the level one switch used (0: the group's), not a setting
    found = []
    for path in [*(ROOT / "llmd_timeslice").rglob("*.py"), *(ROOT / "epp_plugin").rglob("*.py")]:
        if path == owner or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        for node in ast.walk(parse_source(path)):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None):
                    continue
                if item.target.id not in SETTINGS_FIELDS or (node.name, item.target.id) in not_a_default:
                    continue
                value = item.value
                if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "Field" and value.args:
                    value = value.args[0]
                if isinstance(value, ast.Constant) and value.value is not None:
                    found.append(f"{path.relative_to(ROOT)}:{item.lineno} {node.name}.{item.target.id} = {value.value!r}")
    assert not found, "group-setting defaults spelled outside GroupSettings:\n" + "\n".join(found)


def test_the_kubernetes_defaults_start_from_the_model():
    k = KubernetesDiscoverySettings()
    assert (k.sleep_level, k.drain_timeout_s) == (GroupSettings().sleep_level, GroupSettings().drain_timeout_s)
    assert DiscoveryDefaults().settings == GroupSettings()


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("sleep_level", 3, "sleep_level"),
        ("drain_timeout_s", 0, "drain_timeout_s"),
        ("yield_request_fraction", 0, "yield_request_fraction"),
        ("yield_request_fraction", 1.5, "yield_request_fraction"),
        ("min_training_s", -1, "min_training_s"),
        ("yield_request_bands", "ten", "yield_request_bands"),
        ("sleep_levle", 1, "sleep_levle"),
        ("residual_budget_bytes", "1=4GiB,3=1GiB", "residual_budget_bytes"),
        ("residual_budget_bytes", "4GiB", "residual_budget_bytes"),
        ("residual_budget_bytes", "1=lots", "residual_budget_bytes"),
    ],
)
def test_a_bad_setting_names_its_field(key, value, expected):
    with pytest.raises(ValidationError) as err:
        GroupSettings.model_validate({key: value})
    assert expected in str(err.value)


def test_a_spec_copy_owns_its_maps_and_keeps_its_samplers():
    s = SamplerEndpoint("p", "127.0.0.1:8001", "127.0.0.1:9101", "e0")
    spec = GroupSpec("g0", [s], job_priorities={"a": 1}, job_yield_opt_out=["a"])
    copy = spec.copy()
    copy.job_priorities["b"] = 2
    copy.job_yield_opt_out.append("b")
    assert spec.job_priorities == {"a": 1} and spec.job_yield_opt_out == ["a"]
    assert copy.samplers == [s] and spec.copy(samplers=[]).samplers == [] and spec.samplers == [s]
    other = GroupSpec("g0", [], sleep_level=2)
    spec.apply_settings(other)
    assert spec.sleep_level == 2 and spec.job_priorities == {} and spec.samplers == [s]


def test_a_sampler_endpoint_refuses_a_malformed_address():
    with pytest.raises(ValidationError, match="address"):
        SamplerEndpoint("p", "no-port", "127.0.0.1:9101", "e0")
