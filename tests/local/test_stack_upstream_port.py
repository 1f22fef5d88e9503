"""The local stack's upstream-compatible orchestrator port: off unless ``stack.ports.orchestrator_upstream`` is set;
then the orchestrator opens it admitting only ``stack.upstream_compat_allowed_peers`` (this machine by default)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmd_timeslice.local.commands import StackCommands
from llmd_timeslice.local.stack_file import StackError, load_stack_file
from llmd_timeslice.local.up import Stack
from tests.support.cli import run_cli

REPO = Path(__file__).resolve().parents[2]


def _stack(tmp_path: Path, **stack) -> Path:
    d = yaml.safe_load((REPO / "examples" / "cpu-stack.yaml").read_text())
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    for e in d["engines"]:
        e["vllm"]["model"] = str(model)
    for key, value in stack.items():
        if key == "ports":
            d["stack"]["ports"].update(value)
        else:
            d["stack"][key] = value
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def _orchestrator_argv(tmp_path: Path, path: Path) -> list[str]:
    return StackCommands(load_stack_file(path), tmp_path, tmp_path, tmp_path / "token").orchestrator().args()


def test_the_upstream_port_is_off_by_default_and_opened_for_this_machine_only_when_set(tmp_path):
    argv = _orchestrator_argv(tmp_path, _stack(tmp_path))
    assert not any(a.startswith("--upstream-compat") for a in argv), argv
    path = _stack(tmp_path, ports={"orchestrator_upstream": 50052})
    argv = _orchestrator_argv(tmp_path, path)
    assert argv[argv.index("--upstream-compat-port") + 1] == "50052"
    peers = [argv[i + 1] for i, a in enumerate(argv) if a == "--upstream-compat-allowed-peer"]
    assert peers == ["127.0.0.1", "::1"]
    help_text = run_cli("orchestrator", "--help", env={"COLUMNS": "300"}).stdout
    assert "--upstream-compat-port" in help_text and "--upstream-compat-allowed-peer" in help_text
    stack = Stack(load_stack_file(path), tmp_path, workdir=tmp_path / "up")
    assert ("stack.ports.orchestrator_upstream", "127.0.0.1", 50052) in stack.ports_to_bind()


@pytest.mark.parametrize(
    ("stack", "message"),
    [
        (
            {"ports": {"orchestrator_upstream": 50051}},
            "stack.ports.orchestrator_upstream: port 50051 is also stack.ports.orchestrator",
        ),
        ({"upstream_compat_allowed_peers": ["10.0.0.1/8"]}, "got '10.0.0.1/8'"),
        ({"ports": {"orchestrator_upstream": 0}}, "stack.ports.orchestrator_upstream"),
    ],
)
def test_a_bad_upstream_port_setting_is_refused_naming_it(tmp_path, stack, message):
    with pytest.raises(StackError) as ei:
        load_stack_file(_stack(tmp_path, **stack))
    assert any(message in e for e in ei.value.errors), ei.value.errors
