"""Component command lines come from one place (``llmd_timeslice/local/commands.py``): the demo's stack and ``up``'s
get the same settings, so the drift of issue 27 (the demo's Envoy kept a 600 s route timeout, its gate no default
pool and no lost-completion age) cannot come back."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmd_timeslice.demo.stack import demo_stack_file
from llmd_timeslice.local.commands import GateCommand, OrchestratorCommand, PickerCommand, SidecarCommand, StackCommands
from llmd_timeslice.local.stack_file import load_stack_file
from llmd_timeslice.local.up import Stack
from llmd_timeslice.router.envoy_config import lost_completion_after_s, route_timeout_s
from tests.support.cli import run_cli

REPO = Path(__file__).resolve().parents[2]


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")  # a model directory for the checks; no vLLM starts here
    return model


def _up_stack(tmp_path: Path, model: Path) -> Stack:
    """``up -f examples/cpu-stack.yaml``, its engines on ``model`` (the builtin tiny model is not built here)."""
    d = yaml.safe_load((REPO / "examples" / "cpu-stack.yaml").read_text())
    for e in d["engines"]:
        e["vllm"]["model"] = str(model)
    path = tmp_path / "cpu-stack.yaml"
    path.write_text(yaml.safe_dump(d))
    return Stack(load_stack_file(path), tmp_path, workdir=tmp_path / "up")


def _demo_stack(tmp_path: Path, model: Path) -> Stack:
    return Stack(demo_stack_file(tmp_path / "demo", model, "rollout-group"), tmp_path / "demo")


def _flags(argv: list[str]) -> list[str]:
    return sorted(a for a in argv if a.startswith("--"))


def _route_timeouts(bootstrap: Path) -> set[float]:
    boot = yaml.safe_load(bootstrap.read_text())
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = [r for r in hcm["route_config"]["virtual_hosts"][0]["routes"] if "route" in r]
    assert routes, "no route in the bootstrap"
    return {float(r["route"]["timeout"].rstrip("s")) for r in routes}


def _gate_value(argv: list[str], flag: str) -> str:
    assert flag in argv, f"the gate is started without {flag}: {argv}"
    return argv[argv.index(flag) + 1]


def test_the_demo_and_up_start_every_component_with_the_same_settings(tmp_path):
    model = _model(tmp_path)
    demo, up = _demo_stack(tmp_path, model), _up_stack(tmp_path, model)
    assert demo.sf.stack.max_hold_s == up.sf.stack.max_hold_s == 120, "the demo and examples/cpu-stack.yaml hold 120 s"
    started = {}
    for name, stack in (("demo", demo), ("up", up)):
        stages = stack.prepare()
        started[name] = {c.name: c.argv for stage in stages for c in stage}
    assert sorted(started["demo"]) == sorted(started["up"]), "the same components"
    own = {"--objectives"}  # examples/cpu-stack.yaml declares InferenceObjectives (issue 26); the demo's own traffic
    for component, argv in started["up"].items():
        demo_flags, up_flags = ([f for f in _flags(a) if f not in own] for a in (started["demo"][component], argv))
        assert demo_flags == up_flags, f"{component}: the demo and up pass other flags"

    route = route_timeout_s(120, 3600)
    for name, stack in (("demo", demo), ("up", up)):
        assert _route_timeouts(stack.workdir / "envoy.json") == {route}, f"{name}: Envoy's route timeout"
        gate = started[name]["gate"]
        assert float(_gate_value(gate, "--lost-completion-after-s")) == lost_completion_after_s(route), name
        assert _gate_value(gate, "--default-pool") == "default", name
        assert float(_gate_value(gate, "--max-hold-s")) == 120, name
    assert route > 600, "the 600 s route timeout the demo kept (issue 27) cut generations longer than 10 minutes"


def test_config_check_accepts_the_inventory_the_demo_writes(tmp_path, monkeypatch):
    """``config check demo-out/inventory.yaml`` (issue 27: it answered ``groups: unknown key``); the demo's files land
    in its ``--out`` folder, relative to the current directory, as ``make demo`` names it."""
    monkeypatch.chdir(tmp_path)
    out = Path("demo-out")
    model = _model(tmp_path / "demo-out")
    stack = Stack(demo_stack_file(out, out / "model", "rollout-group"), out)
    stages = stack.prepare()
    inv = tmp_path / "demo-out" / "inventory.yaml"
    assert stack.workdir == inv.parent and stack.token_file == inv.parent / "control-token"
    vllm = [c.argv for stage in stages for c in stage if c.name.startswith("vllm-")]
    assert vllm and all(argv[argv.index("--model") + 1] == str(model) for argv in vllm), vllm
    r = run_cli("config", "check", str(inv))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"OK {inv}: inventory (1 group, 2 samplers)"), r.stdout


@pytest.mark.parametrize("edge", ["ext_authz", "ext_proc"])
def test_every_flag_the_launcher_passes_is_one_the_component_has(tmp_path, edge):
    """A flag renamed in the CLI and not here would make a component exit with a usage error at start-up."""
    sf = demo_stack_file(tmp_path, _model(tmp_path), "g", gate_edge=edge)
    cmds = StackCommands(sf, tmp_path, tmp_path, tmp_path / "token")
    commands = [cmds.gate(), cmds.orchestrator(), *(cmds.sidecar(e) for e in sf.engines)]
    picker = cmds.picker()
    assert (picker is None) == (edge == "ext_authz"), "a picker only on the ext_proc edge"
    commands += [picker] if picker is not None else []
    for cmd in commands:
        help_text = run_cli(cmd.COMPONENT, "--help", env={"COLUMNS": "300"}).stdout
        for flag in _flags(cmd.args()):
            assert flag in help_text, f"llmd-timeslice {cmd.COMPONENT} has no {flag}"


def test_command_lines_leave_out_unset_flags_and_write_whole_seconds_plainly(tmp_path):
    gate = GateCommand(ext_proc_port=9002, max_hold_s=120.0, lost_completion_after_s=4080.5, pools=["a", "b"])
    assert gate.args() == [
        *("gate", "--ext-proc-port", "9002", "--max-hold-s", "120"),
        *("--lost-completion-after-s", "4080.5", "--pool", "a", "--pool", "b"),
    ]
    assert PickerCommand(port=1, endpoints=[("p", "10.0.0.1:8000")], log_level="debug").args() == [
        "picker",
        "--port",
        "1",
        "--endpoint",
        "p=10.0.0.1:8000",
        "--log-level",
        "debug",
    ]
    assert OrchestratorCommand().args() == ["orchestrator"]
    argv = SidecarCommand(job_id="j", token_file=tmp_path / "t").argv(python="/py")
    assert argv == ["/py", "-m", "llmd_timeslice.cli", "sidecar", "--job-id", "j", "--token-file", str(tmp_path / "t")]


def test_no_vllm_command_for_an_engine_that_runs_already(tmp_path):
    d = yaml.safe_load((REPO / "examples" / "cpu-stack.yaml").read_text())
    d["engines"] = [{"name": "ext", "group": "rollout-group", "sidecar_port": 9101, "url": "http://127.0.0.1:7001"}]
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(d))
    sf = load_stack_file(path)
    cmds = StackCommands(sf, tmp_path, tmp_path, tmp_path / "token")
    with pytest.raises(ValueError, match=r"engine 'ext' runs already at http://127.0.0.1:7001"):
        cmds.vllm(sf.engines[0], tmp_path)


def test_the_launcher_removes_a_vllm_servers_runtime_directory_after_it_exits(tmp_path):
    """vLLM leaves IPC sockets and temporary files in its runtime directory (TMPDIR): one per start, removed after."""
    stack = _demo_stack(tmp_path, _model(tmp_path))
    (vllm, *_) = [c for stage in stack.prepare() for c in stage if c.name.startswith("vllm-")]
    env = vllm.env_factory()
    runtime = Path(env["TMPDIR"])
    assert runtime.is_dir() and env["VLLM_RPC_BASE_PATH"] == str(runtime)
    vllm.after_exit()
    assert not runtime.exists()


def test_the_examples_vllm_engines_run_the_command_the_tests_real_vllm_runs(tmp_path):
    """``up`` on the CPU example starts each vLLM engine with the command line and environment of the session's
    real vLLM server (tests/support/vllm.py), so that server's tests (sleep, wake, weight reloads, the phase switch)
    are tests of what ``up`` starts; tests/local/test_stack_up.py runs ``up`` on fake engines."""
    from llmd_timeslice.engines.vllm_server import VllmServer

    model = _model(tmp_path)
    stack = _up_stack(tmp_path, model)
    cmds = stack.commands()
    for e in stack.sf.engines:
        ours = cmds.vllm(e, model)
        tests = VllmServer(model, ours.port, tmp_path / "tests-vllm.log")  # tests/support/vllm.py, before its LoRA flags
        assert ours.command() == tests.command(), e.name
        env_ours, env_tests = ours.environment(), tests.environment()
        for env, server in ((env_ours, ours), (env_tests, tests)):  # each start's own runtime directory
            for k in [k for k, v in env.items() if v.startswith(str(server.runtime_dir))]:
                del env[k]
        assert env_ours == env_tests, e.name
        for server in (ours, tests):
            server.remove_runtime_dir()
