"""The configuration schema: loading from file and environment, one clear line per error, `config` commands."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from llmd_timeslice.config import (
    SECTIONS,
    ConfigError,
    TimesliceConfig,
    load_config,
    parse_duration,
    reference_markdown,
)
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parent.parent

GOOD = """\
token_file: /var/run/secrets/llmd-timeslice/token
gate:
  host: 0.0.0.0
  pools: [sampler-pool]
  default_pool: sampler-pool
  max_hold_s: 10m
  orchestrator: llmd-timeslice-orchestrator:50051
picker:
  pools: {default: ["127.0.0.1:8001", "127.0.0.1:8002"]}
orchestrator:
  host: 0.0.0.0
  discovery: kubernetes
  kubernetes:
    namespace: llm-d-timeslice
    manage_serving_label: true
    drain_timeout_s: 1m30s
sidecar:
  job_id: vllm-sampler-0
  idle_timeout_s: 500ms
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("LLMD_TIMESLICE_"):
            monkeypatch.delenv(k)


def write(tmp_path, text: str) -> Path:
    f = tmp_path / "cfg.yaml"
    f.write_text(text)
    return f


def errors_of(tmp_path, text: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    return err.value.errors


def test_good_file_loads_with_units(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.configured() == ["gate", "picker", "orchestrator", "sidecar"]
    assert cfg.gate.max_hold_s == 600.0 and cfg.gate.ext_proc_port == 9002
    assert cfg.orchestrator.kubernetes.drain_timeout_s == 90.0 and cfg.sidecar.idle_timeout_s == 0.5
    assert cfg.token_file_for("gate") == Path("/var/run/secrets/llmd-timeslice/token")
    assert load_config(write(tmp_path, "")).configured() == []


@pytest.mark.parametrize(
    "text,expected",
    [
        ("gate:\n  max_hodl_s: 3\n", "gate.max_hodl_s: unknown key (did you mean gate.max_hold_s?)"),
        ("orchestrater:\n  port: 1\n", "orchestrater: unknown key (did you mean orchestrator?)"),
        ("gate:\n  ext_proc_port: 70000\n", "gate.ext_proc_port: Input should be less than or equal to 65535 (got 70000)"),
        ("picker:\n  port: http\n  pools: {p: ['10.0.0.1:80']}\n", "picker.port: Input should be a valid integer"),
        ("gate:\n  max_hold_s: soon\n", "gate.max_hold_s: invalid duration 'soon'"),
        ("gate:\n  max_hold_s: 2h\n", "gate.max_hold_s: Input should be less than or equal to 3600"),
        ("sidecar:\n  job_id: s\n  operation_timeout_s: -5\n", "sidecar.operation_timeout_s: Input should be greater than 0"),
        ("orchestrator:\n  port: 1\n", "orchestrator.inventory: required when discovery: static"),
        (
            "orchestrator:\n  inventory: i.yaml\n  leader_election: true\n",
            "orchestrator.leader_election: needs state_configmap",
        ),
        (
            "orchestrator:\n  inventory: i.yaml\n  state_configmap: cm\n  leader_election: true\n  lease_duration_s: 2.5\n",
            "orchestrator.lease_duration_s: lease_duration_s must be whole seconds",
        ),
        ("sidecar:\n  job_id: s\n  backend: cuda\n", "sidecar.pid: required with backend: cuda"),
        ("picker: {}\n", "picker.pools: required"),
        ("sidecar:\n  port: 1\n", "sidecar.job_id: required"),
        ("gate:\n  orchestrator: nohost\n", "gate.orchestrator: expected host:port"),
    ],
)
def test_each_error_is_one_line_naming_the_field(tmp_path, text, expected):
    errors = errors_of(tmp_path, text)
    assert len(errors) == 1 and errors[0].startswith(expected), errors
    assert "\n" not in errors[0]


def test_several_errors_give_one_line_each(tmp_path):
    errors = errors_of(tmp_path, "gate:\n  ext_proc_port: 70000\n  max_hold_s: soon\n  bogus: 1\n")
    assert [e.split(":")[0] for e in errors] == ["gate.ext_proc_port", "gate.max_hold_s", "gate.bogus"]


def test_file_level_problems(tmp_path):
    # Where and what, from PyYAML's marks: no "<unicode string>", no caret lines, each position once.
    assert errors_of(tmp_path, "gate: [\n")[0] == (
        "not valid YAML at line 2, column 1: expected the node content, but found '<stream end>' "
        "(while parsing a flow node at line 2, column 1)"
    )
    assert errors_of(tmp_path, "- gate\n")[0].startswith("expected a mapping of sections")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_durations():
    assert parse_duration(10) == 10.0 and parse_duration("2.5") == 2.5
    assert parse_duration("500ms") == 0.5 and parse_duration("1m30s") == 90.0 and parse_duration("1h") == 3600.0
    for bad in ("soon", "10x", "m", "", "1m 30", True):
        with pytest.raises(ValueError, match="invalid duration"):
            parse_duration(bad)


def test_environment_overrides_the_file(tmp_path, monkeypatch):
    f = write(tmp_path, GOOD)
    monkeypatch.setenv("LLMD_TIMESLICE_GATE__MAX_HOLD_S", "30s")
    monkeypatch.setenv("LLMD_TIMESLICE_GATE__POOLS", '["a", "b"]')
    monkeypatch.setenv("LLMD_TIMESLICE_ORCHESTRATOR__KUBERNETES__NAMESPACE", "other")
    monkeypatch.setenv("LLMD_TIMESLICE_TOKEN", "not-a-config-field")  # the token itself is ignored here
    cfg = load_config(f)
    assert cfg.gate.max_hold_s == 30.0 and cfg.gate.pools == ["a", "b"]
    assert cfg.gate.default_pool == "sampler-pool"  # the rest of the section still comes from the file
    assert cfg.orchestrator.kubernetes.namespace == "other" and cfg.orchestrator.kubernetes.manage_serving_label
    assert load_config(f, env=False).gate.max_hold_s == 600.0
    # Environment alone creates a section (and its rules apply: an orchestrator section needs its discovery).
    monkeypatch.setenv("LLMD_TIMESLICE_SIDECAR__JOB_ID", "env-job")
    with pytest.raises(ConfigError, match=r"orchestrator\.inventory: required"):
        load_config(None)
    monkeypatch.delenv("LLMD_TIMESLICE_ORCHESTRATOR__KUBERNETES__NAMESPACE")
    assert load_config(None).sidecar.job_id == "env-job"


def test_environment_errors_name_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMD_TIMESLICE_GATE__MAX_HOLD", "30")
    errors = errors_of(tmp_path, "gate: {}\n")
    assert errors == ["gate.max_hold: unknown key (did you mean gate.max_hold_s?) [from $LLMD_TIMESLICE_GATE__MAX_HOLD]"]


def test_each_component_command_has_one_option_per_field_and_nothing_else():
    """The component commands are built from the settings models: an option per field (the kubernetes section's
    fields flattened), the renamed ones kept (--pool, --release-rate, --endpoint), plus --config."""
    import typer.main

    from llmd_timeslice.cli import app
    from llmd_timeslice.config import cli_fields

    cmd = typer.main.get_command(app)
    for section, model in SECTIONS.items():
        options = {o for p in cmd.commands[section].params for o in p.opts}
        assert options == {"--config", *(f.option for f in cli_fields(model))}, section
    assert {"--pool", "--release-rate"} <= {o for p in cmd.commands["gate"].params for o in p.opts}
    assert "--endpoint" in {o for p in cmd.commands["picker"].params for o in p.opts}
    k8s = {f.option for f in cli_fields(SECTIONS["orchestrator"]) if f.path[0] == "kubernetes"}
    assert {"--namespace", "--label-selector", "--default-pool", "--manage-serving-label", "--kubeconfig"} <= k8s
    for model in (*SECTIONS.values(), TimesliceConfig, SECTIONS["orchestrator"].model_fields["kubernetes"].annotation):
        for key, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{key} has no description"


def test_component_settings_layers_flags_over_environment_over_file(tmp_path, monkeypatch):
    from llmd_timeslice.config import component_settings

    f = write(tmp_path, GOOD.replace("gate:\n", "gate:\n  max_held: 7\n  release_rate_per_s: 5\n"))
    monkeypatch.setenv("LLMD_TIMESLICE_GATE__MAX_HOLD_S", "30s")
    monkeypatch.setenv("LLMD_TIMESLICE_GATE__MAX_HELD", "8")
    gate, token_file = component_settings("gate", f, {("max_held",): 9})
    assert gate.max_held == 9  # flag over environment
    assert gate.max_hold_s == 30.0  # environment over file (10m)
    assert gate.release_rate_per_s == 5.0 and gate.pools == ["sampler-pool"]  # file over defaults
    assert gate.ext_proc_port == 9002  # defaults
    assert token_file == Path("/var/run/secrets/llmd-timeslice/token")  # the top-level token_file
    monkeypatch.setenv("LLMD_TIMESLICE_TOKEN_FILE", "/env/token")
    assert component_settings("gate", f)[1] == Path("/env/token")
    assert component_settings("gate", f, {("token_file",): Path("/own")})[1] == Path("/own")
    # Nested sections merge key by key; the environment alone is enough.
    monkeypatch.setenv("LLMD_TIMESLICE_ORCHESTRATOR__KUBERNETES__LABEL_SELECTOR", "app=x")
    orch, _ = component_settings("orchestrator", f, {("kubernetes", "sleep_level"): 2})
    assert (orch.kubernetes.namespace, orch.kubernetes.label_selector, orch.kubernetes.sleep_level) == (
        "llm-d-timeslice",
        "app=x",
        2,
    )
    monkeypatch.setenv("LLMD_TIMESLICE_SIDECAR__JOB_ID", "env-job")
    assert component_settings("sidecar")[0].job_id == "env-job"


@pytest.mark.parametrize(
    "file_text,env,flags,expected",
    [
        ("gate:\n  max_hodl_s: 3\n", {}, {}, ["{f}: gate.max_hodl_s: unknown key (did you mean gate.max_hold_s?)"]),
        ("gaet: {}\n", {}, {}, ["{f}: gaet: unknown key (did you mean gate?)"]),
        ("gate: []\n", {}, {}, ["{f}: gate: expected a mapping of settings, got list"]),
        ("gate:\n  max_hold_s: 2h\n", {}, {}, ["{f}: gate.max_hold_s: Input should be less than or equal to 3600"]),
        (
            "",
            {"LLMD_TIMESLICE_GATE__MAX_HOLD_S": "2h"},
            {},
            ["gate.max_hold_s: Input should be less than or equal to 3600 (got 7200.0) [from $LLMD_TIMESLICE_GATE__MAX_HOLD_S]"],
        ),
        ("", {}, {("max_hold_s",): 7200.0}, ["--max-hold-s: Input should be less than or equal to 3600 (got 7200.0)"]),
        ("gate:\n  orchestrator: nohost\n", {}, {("orchestrator",): "o:1"}, []),  # the flag replaces the bad value
    ],
)
def test_component_settings_errors_name_where_the_value_came_from(tmp_path, monkeypatch, file_text, env, flags, expected):
    from llmd_timeslice.config import component_settings

    f = write(tmp_path, file_text)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if not expected:
        component_settings("gate", f, flags)
        return
    with pytest.raises(ConfigError) as err:
        component_settings("gate", f, flags)
    lines = [f"{err.value.source}: {e}" if err.value.source else e for e in err.value.errors]
    assert [ln[: len(e.format(f=f))] for ln, e in zip(lines, expected, strict=True)] == [e.format(f=f) for e in expected]


def test_component_settings_missing_and_rule_errors_name_the_option(tmp_path):
    from llmd_timeslice.config import component_settings

    with pytest.raises(ConfigError) as err:
        component_settings("sidecar")
    assert err.value.errors == ["--job-id: required (or $LLMD_TIMESLICE_SIDECAR__JOB_ID)"]
    with pytest.raises(ConfigError) as err:
        component_settings("sidecar", write(tmp_path, "sidecar:\n  backend: cuda\n"), {("job_id",): "j"})
    assert err.value.errors == ["--pid: required with --backend cuda (the processes to checkpoint)"]
    with pytest.raises(ConfigError) as err:
        component_settings("orchestrator", None, {("kubernetes", "manage_serving_label"): True, ("inventory",): Path("i.yaml")})
    assert err.value.errors == ["--manage-serving-label: needs --discovery kubernetes"]


def test_reference_doc_is_current():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == reference_markdown(), "regenerate: .venv/bin/llmd-timeslice config reference > docs/configuration.md"
    # The example in it is valid.
    example = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert TimesliceConfig.model_validate(__import__("yaml").safe_load(example)).configured() == [
        "gate",
        "orchestrator",
        "sidecar",
    ]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    with contextlib.chdir(ROOT):
        return run_cli(*args, env=env)


def test_config_check_command(tmp_path):
    good = write(tmp_path, GOOD)
    r = cli("config", "check", str(good))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"OK {good}: gate, picker, orchestrator, sidecar configured")
    assert "discovery kubernetes (namespace llm-d-timeslice" in r.stdout and "max_hold 600 s" in r.stdout

    bad = tmp_path / "bad.yaml"
    bad.write_text("gate:\n  ext_proc_port: 70000\n  max_hold_s: soon\n  max_hodl_s: 1\n")
    r = cli("config", "check", str(bad))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 3 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"{bad}: gate.ext_proc_port:") and "gate.max_hold_s: invalid duration" in lines[1]

    r = cli("config", "check", str(good), env={"LLMD_TIMESLICE_GATE__CONTROL_PORT": "-1"})
    assert r.returncode == 2 and "gate.control_port" in r.stderr and "$LLMD_TIMESLICE_GATE__CONTROL_PORT" in r.stderr

    r = cli("config", "check", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "cannot read" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_config_schema_command():
    r = cli("config", "schema")
    assert r.returncode == 0, r.stderr
    schema = json.loads(r.stdout)
    assert set(schema["properties"]) == {"token_file", *SECTIONS}
    gate = schema["$defs"]["GateSettings"]
    assert gate["additionalProperties"] is False and gate["properties"]["ext_proc_port"]["maximum"] == 65535
    assert {"type": "number"} in gate["properties"]["max_hold_s"]["anyOf"]
