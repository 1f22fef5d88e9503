"""Stack files of ``llmd-timeslice up``: the examples load, and each kind of bad file gets its message."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from llmd_timeslice.local.stack_file import StackError, load_stack_file
from tests.support.cli import run_cli

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, data: dict | str) -> Path:
    p = tmp_path / "stack.yaml"
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def _base() -> dict:
    return yaml.safe_load((REPO / "examples" / "cpu-stack.yaml").read_text())


def test_the_objectives_sections_become_the_gates_objectives():
    sf = load_stack_file(REPO / "examples" / "cpu-stack.yaml")
    objectives = sf.gate_objectives()
    assert objectives is not None
    pp = objectives.for_pool("default", "default", sf.stack.max_hold_s)
    assert pp.objectives["eval"].band.hold_deadline_s == 5 and pp.objectives["judge"].max_hold_s == 60
    assert pp.objectives["best-effort"].band.sheddable


def test_cpu_example_loads_and_gives_the_orchestrator_inventory():
    sf = load_stack_file(REPO / "examples" / "cpu-stack.yaml")
    inv = sf.inventory()
    assert [g.group_id for g in inv.groups] == ["rollout-group"]
    assert [s.job_id for s in inv.groups[0].samplers] == ["sampler-0", "sampler-1"]
    assert inv.groups[0].sleep_level_policy == "auto"


def test_gpu_example_is_valid_except_for_the_model_it_cannot_find_here():
    with pytest.raises(StackError) as ei:
        load_stack_file(REPO / "examples" / "gpu-node.yaml")
    assert len(ei.value.errors) == 2
    assert all("vllm.model: no model directory (config.json) at /models/Qwen2.5-7B-Instruct" in e for e in ei.value.errors)


@pytest.mark.parametrize(
    "case, mutate, message",
    [
        ("unknown_key", lambda d: d["stack"].update(max_hold=3), "stack.max_hold: unknown key"),
        ("unknown_engine_key", lambda d: d["engines"][0].update(gpu=1), "engines[0].gpu: unknown key"),
        (
            "port_clash_stack",
            lambda d: d["stack"]["ports"].update(picker=9003),
            "stack.ports.picker: port 9003 is also stack.ports.gate_control",
        ),
        (
            "port_clash_engine",
            lambda d: d["engines"][1]["vllm"].update(port=8001),
            "engines[1] (sampler-1).vllm.port: port 8001 is also engines[0] (sampler-0).vllm.port",
        ),
        (
            "missing_model",
            lambda d: d["engines"][0]["vllm"].update(model="./no-such-model"),
            "engines[0] (sampler-0).vllm.model: no model directory (config.json) at",
        ),
        (
            "unknown_group",
            lambda d: d["engines"][0].update(group="nope"),
            "engines[0] (sampler-0).group: unknown group 'nope'; declared: ['rollout-group']",
        ),
        ("unknown_pool", lambda d: d["engines"][0].update(pool="nope"), "engines[0] (sampler-0).pool: unknown pool 'nope'"),
        ("url_and_vllm", lambda d: d["engines"][0].update(url="http://127.0.0.1:7000"), "give exactly one of 'url'"),
        (
            "bad_url",
            lambda d: (d["engines"][0].pop("vllm"), d["engines"][0].update(url="ftp://x")),
            "url must be http://host:port",
        ),
        ("duplicate_engine", lambda d: d["engines"][1].update(name="sampler-0"), "engines: 'sampler-0' is declared more"),
        ("job_unknown_group", lambda d: d["jobs"][0].update(groups=["zzz"]), "jobs[0] (trainer-0).groups: unknown group"),
        ("bad_port", lambda d: d["stack"]["ports"].update(router=70000), "stack.ports.router: Input should be less than"),
        ("no_groups", lambda d: d.update(groups=[]), "groups: List should have at least 1 item"),
        (
            "zero_generation_timeout",
            lambda d: d["stack"].update(generation_timeout_s=0),
            "stack.generation_timeout_s: Input should be greater than 0",
        ),
        ("second_pool_without_prefix", lambda d: d["pools"].append({"name": "other"}), "pools[1] (other).path_prefix"),
        (
            "second_pool_prefix_is_root",
            lambda d: d["pools"].append({"name": "other", "path_prefix": "/"}),
            "pools[1] (other).path_prefix: pools after the first need a path prefix starting with '/', other than '/'",
        ),
        (
            "objective_unknown_pool",
            lambda d: d["objectives"][0].update(pool="nope"),
            "objectives[0] (eval).pool: unknown pool 'nope'; declared: ['default']",
        ),
        (
            "objective_twice",
            lambda d: d["objectives"].append({"name": "eval", "priority": 1}),
            "objectives[4]: objective 'eval' of pool 'default' is also objectives[0]",
        ),
        (
            "objective_huge_priority",
            lambda d: d["objectives"][0].update(priority=2**31),
            "objectives[0].priority: Input should be less than or equal to 2147483647",
        ),
        (
            "band_deadline_zero",
            lambda d: d["priority_bands"][0].update(hold_deadline_s=0),
            "priority_bands[0].hold_deadline_s: Input should be greater than 0",
        ),
        (
            "band_deadline_above_its_hold",
            lambda d: d["priority_bands"][0].update(hold_deadline_s=121),
            "priority_bands[0]: hold_deadline_s 121 is above the band's max_hold_s 120",
        ),
        (
            "band_hold_above_the_stacks",
            lambda d: d["priority_bands"][0].update(max_hold_s=900, hold_deadline_s=None),
            "priority_bands[0].max_hold_s: 900 is above the gate's max_hold_s 120",
        ),
        ("band_max_hold_zero", lambda d: d["priority_bands"][0].update(max_hold_s=0), "priority_bands[0].max_hold_s: Input"),
    ],
)
def test_bad_stack_file_gets_a_message_naming_the_field(tmp_path, case, mutate, message):
    d = _base()
    mutate(d)
    with pytest.raises(StackError) as ei:
        load_stack_file(_write(tmp_path, d))
    assert any(message in e for e in ei.value.errors), (case, ei.value.errors)


def test_not_yaml_and_not_a_mapping_are_refused(tmp_path):
    with pytest.raises(StackError, match="not valid YAML"):
        load_stack_file(_write(tmp_path, "stack: [unclosed"))
    with pytest.raises(StackError, match="must be a mapping"):
        load_stack_file(_write(tmp_path, "- a\n- b\n"))


def test_cli_prints_one_line_per_problem_and_exits_2(tmp_path):
    d = _base()
    d["stack"]["ports"]["picker"] = 9003
    d["engines"][0]["vllm"]["model"] = "./missing"
    f = _write(tmp_path, d)
    for cmd in ("up", "down", "status"):
        r = run_cli(cmd, "-f", str(f))
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 2 and all(ln.startswith(str(f)) for ln in lines), (cmd, r.stderr)
        assert "Traceback" not in r.stderr


async def test_stop_wakes_engines_the_stack_did_not_start(tmp_path):
    """An engine given by URL outlives the stack: if it sleeps when the stack stops, it is woken (verified)."""
    from llmd_timeslice.local.up import Stack
    from tests.support.fake_engines import FakeVllm

    engine = FakeVllm().start()
    engine.level = 1
    try:
        d = _base()
        d["engines"] = [{"name": "ext", "group": "rollout-group", "sidecar_port": 9101, "url": engine.url}]
        sf = load_stack_file(_write(tmp_path, d))
        await Stack(sf, tmp_path).wake_external_engines()
        assert engine.level == 0
    finally:
        engine.stop()


async def test_up_writes_its_state_file_at_each_restart_not_only_at_its_refresh(tmp_path, monkeypatch):
    """`status` and `down` read stack.json: a child's exit and restart show there when they happen, not at the next
    periodic refresh (here never: an hour)."""
    import asyncio
    import contextlib
    import io
    import json
    import os
    import signal
    import sys
    from functools import partial

    from rich.console import Console

    from llmd_timeslice.local import up
    from llmd_timeslice.local.supervisor import ChildSpec, Supervisor
    from tests.support.waits import until

    monkeypatch.setattr(up, "STATE_REFRESH_S", 3600.0)
    monkeypatch.setattr(up, "Supervisor", partial(Supervisor, backoff_s=0.05))  # the restart's back-off: not 1 s
    d = _base()
    d["stack"]["workdir"] = str(tmp_path / "wd")
    d["engines"] = [{"name": "ext", "group": "rollout-group", "sidecar_port": 9101, "url": "http://127.0.0.1:9"}]
    stack = up.Stack(load_stack_file(_write(tmp_path, d)), tmp_path)
    # plain children under the names the stop looks for, instead of the components
    children = [
        ChildSpec(name, [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / f"{name}.log", settle_s=0.1)
        for name in ("orchestrator", "gate")
    ]
    monkeypatch.setattr(stack, "prepare", lambda progress: [children])

    async def no_engine_to_wake() -> None:
        return None

    monkeypatch.setattr(stack, "wake_external_engines", no_engine_to_wake)

    def gate() -> dict:
        with contextlib.suppress(OSError, ValueError, StopIteration):
            state = json.loads((stack.workdir / "stack.json").read_text())
            return {"phase": state["phase"], **next(c for c in state["components"] if c["name"] == "gate")}
        return {}

    task = asyncio.ensure_future(up._up(stack, Console(file=io.StringIO()), live_table=False))
    try:
        await until(lambda: gate().get("phase") == "running" or task.done(), 30, "the stack running")
        first = gate()["pid"]
        os.kill(first, signal.SIGKILL)
        await until(lambda: gate().get("restarts") == 1 and gate()["state"] == "ready", 30, "the restart written")
        assert gate()["phase"] == "running" and gate()["pid"] not in (None, first)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert gate()["phase"] == "stopped"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["stack"].update(max_hold=3), "stack.max_hold: unknown key (did you mean stack.max_hold_s?)"),
        (lambda d: d["stack"]["ports"].update(routr=1), "stack.ports.routr: unknown key (did you mean stack.ports.router?)"),
        (
            lambda d: d["groups"][0].update(sleep_levl=1),
            "groups[0].sleep_levl: unknown key (did you mean groups[0].sleep_level?)",
        ),
        (
            lambda d: d["engines"][1].update(sidecar_prot=1),
            "engines[1].sidecar_prot: unknown key (did you mean engines[1].sidecar_port?)",
        ),
        (
            lambda d: d["engines"][0]["vllm"].update(modle="x"),
            "engines[0].vllm.modle: unknown key (did you mean engines[0].vllm.model?)",
        ),
        (
            lambda d: d.update(gate={"max_hold_s": 3}),
            "gate: unknown key (known here: stack, pools, groups, jobs, engines, objectives, priority_bands)",
        ),
    ],
    ids=["stack.max_hold", "stack.ports.routr", "groups.sleep_levl", "engines.sidecar_prot", "engines.vllm.modle", "gate"],
)
def test_unknown_stack_file_key_gets_a_did_you_mean_suggestion(tmp_path, mutate, message):
    d = _base()
    mutate(d)
    with pytest.raises(StackError) as ei:
        load_stack_file(_write(tmp_path, d))
    assert message in ei.value.errors, ei.value.errors


def _config_check(f: Path) -> subprocess.CompletedProcess:
    return run_cli("config", "check", str(f))


def test_config_check_recognises_a_stack_file_and_checks_it_without_starting_it(tmp_path):
    import socket

    d = _base()
    with socket.socket() as held:  # a port of the stack is taken now: a note, since the file itself is fine
        held.bind(("127.0.0.1", 0))
        held.listen()
        d["stack"]["ports"]["router"] = held.getsockname()[1]
        d["stack"]["workdir"] = str(tmp_path / "work")
        f = _write(tmp_path, d)
        r = _config_check(f)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"OK {f}: stack file (2 engines, 1 group, 1 pool)"), r.stdout
    assert "engine sampler-0: pool default, group rollout-group, sidecar 9101, started: vllm builtin:tiny-llama" in r.stdout
    port = d["stack"]["ports"]["router"]
    assert f"note: port {port} (stack.ports.router) on 127.0.0.1 is in use by pid {os.getpid()}" in r.stdout, r.stdout
    assert not (tmp_path / "work").exists(), "nothing was started or written"


def test_config_check_on_a_bad_stack_file_prints_one_line_per_problem_with_suggestions(tmp_path):
    d = _base()
    d["stack"]["max_hold"] = 3
    d["engines"][0]["sidecar_prot"] = d["engines"][0].pop("sidecar_port")
    f = _write(tmp_path, d)
    r = _config_check(f)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert f"{f}: stack.max_hold: unknown key (did you mean stack.max_hold_s?)" in lines, r.stderr
    assert f"{f}: engines[0].sidecar_prot: unknown key (did you mean engines[0].sidecar_port?)" in lines, r.stderr
    # The misspelled key's line says why sidecar_port is missing: no "engines[0].sidecar_port: required" as well.
    assert len(lines) == 2, r.stderr


def test_up_prints_an_export_line_with_the_router_url_and_where_the_tiny_model_is_built(tmp_path):
    """What `up` prints once the stack runs (cpu example: builtin:tiny-llama engines), read whole by a shell."""
    import io

    from rich.console import Console

    from llmd_timeslice.local.up import ROUTER_URL_ENV, Stack, _print_endpoints

    d = _base()
    d["stack"]["workdir"] = str(tmp_path / "work")
    stack = Stack(load_stack_file(_write(tmp_path, d)), tmp_path)
    buf = io.StringIO()
    _print_endpoints(Console(file=buf, width=80), stack)
    lines = buf.getvalue().splitlines()
    export = next(ln for ln in lines if "export " in ln).split("export ", 1)[1].split()
    assert export == [
        "TIMESLICE_ORCH_ADDR=127.0.0.1:50051",
        f"LLMD_TIMESLICE_TOKEN_FILE={tmp_path / 'work' / 'control-token'}",
        f"{ROUTER_URL_ENV}=http://127.0.0.1:8080",
    ]
    assert any(ln.endswith(str(tmp_path / "work" / "tiny-llama")) for ln in lines), lines
    assert stack.endpoints()["tiny_model"] == str(tmp_path / "work" / "tiny-llama")


@pytest.mark.parametrize("columns", [None, "60"], ids=["pipe_without_COLUMNS", "COLUMNS=60"])
def test_status_tables_show_whole_values_into_a_pipe_or_at_columns(monkeypatch, capsys, columns):
    """Not a terminal: one row per line, nothing cut; with COLUMNS set: that width, long cells folded, nothing cut."""
    from llmd_timeslice.status import UNCUT_WIDTH, output_console, table

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    console = output_console()
    assert console.width == (UNCUT_WIDTH if columns is None else 60)
    t = table("groups @ 127.0.0.1:50051", ("group", "state", "samplers"))
    t.add_row("rollout-group-on-a-shared-node", "IDLE", "sampler-with-a-rather-long-name-0:RUNNING, sampler-1:RUNNING")
    console.print(t)
    out = capsys.readouterr().out
    assert "…" not in out
    rows = [ln.split("│")[1:-1] for ln in out.splitlines() if ln.startswith("│")]
    assert (len(rows) == 1) if columns is None else (len(rows) > 1), out  # one line per row / folded at 60 columns
    cells = ["".join(r[i].strip() for r in rows) for i in range(3)]  # a folded cell, read down its column
    assert cells[0] == "rollout-group-on-a-shared-node", out
    assert cells[2].replace(" ", "") == "sampler-with-a-rather-long-name-0:RUNNING,sampler-1:RUNNING", out


def _seconds(value: str) -> float:
    assert value.endswith("s"), value
    return float(value[:-1])


@pytest.mark.parametrize(
    "stack, route_s",
    [
        ({}, 600 + 3600 + 60),  # defaults: hold 600 s, generation 3600 s
        ({"max_hold_s": 120}, 120 + 3600 + 60),
        ({"max_hold_s": 120, "generation_timeout_s": 7200}, 120 + 7200 + 60),
    ],
)
def test_route_timeout_fits_a_hold_then_the_longest_generation(tmp_path, stack, route_s):
    """Defect 14 of issue 14 in the local stack: a 600 s route timeout cut generations longer than 10 minutes. The
    route timeout is hold + generation + 60 s, the stream idle timeout above it (a held request sends nothing), and
    the gate's lost-completion age above the route timeout (its age rule never ends a request Envoy still serves)."""
    from llmd_timeslice.local.up import Stack

    d = _base()
    d["stack"].pop("max_hold_s", None)
    d["stack"].update(stack)
    d["engines"] = [{"name": "ext", "group": "rollout-group", "sidecar_port": 9101, "url": "http://127.0.0.1:7001"}]
    sf = load_stack_file(_write(tmp_path, d))
    stages = Stack(sf, tmp_path, workdir=tmp_path / "wd").prepare()
    boot = yaml.safe_load((tmp_path / "wd" / "envoy.json").read_text())
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = [r for r in hcm["route_config"]["virtual_hosts"][0]["routes"] if "route" in r]
    assert routes and {_seconds(r["route"]["timeout"]) for r in routes} == {route_s}
    assert _seconds(hcm["stream_idle_timeout"]) > route_s
    (gate,) = [c for stage in stages for c in stage if c.name == "gate"]
    lost = float(gate.argv[gate.argv.index("--lost-completion-after-s") + 1])
    assert lost > route_s


def test_up_passes_the_objectives_sections_to_the_gate_it_starts(tmp_path):
    """``up`` writes the stack file's objectives / priority_bands as the gate's --objectives file; without them the
    gate gets no such flag (the header is ignored)."""
    from llmd_timeslice.config import GateSettings
    from llmd_timeslice.domain.objectives import load_objectives_file
    from llmd_timeslice.local.up import Stack

    d = _base()
    d["engines"] = [{"name": "ext", "group": "rollout-group", "sidecar_port": 9101, "url": "http://127.0.0.1:7001"}]
    sf = load_stack_file(_write(tmp_path, d))
    stages = Stack(sf, tmp_path, workdir=tmp_path / "work").prepare()
    gate = next(c for st in stages for c in st if c.name == "gate")
    f = Path(gate.argv[gate.argv.index("--objectives") + 1])
    assert load_objectives_file(f, sf.stack.max_hold_s) == sf.gate_objectives()
    assert GateSettings(objectives=f).objectives == f
    del d["objectives"], d["priority_bands"]
    sf = load_stack_file(_write(tmp_path, d))
    stages = Stack(sf, tmp_path, workdir=tmp_path / "work2").prepare()
    assert "--objectives" not in next(c for st in stages for c in st if c.name == "gate").argv


# ---------------------------------------------------------------- the first hour (issue 42)
def _model_keys(model, prefix: str = "") -> list[str]:
    """Every key a stack file may hold, as ``engines[].vllm.port`` paths (the models' own fields, nested models and
    lists of models followed)."""
    from llmd_timeslice import yaml_files

    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        out.append(path)
        inner = yaml_files._inner_model(field.annotation)
        if inner is not None:
            is_list = "list[" in str(field.annotation)
            out += _model_keys(inner, f"{path}{'[]' if is_list else ''}.")
    return out


def _example_keys(text: str) -> set[str]:
    """The keys of examples/cpu-stack.yaml as paths, the commented-out ones (``# key: value``) included."""
    import re

    def walk(node, prefix: str) -> set[str]:
        keys: set[str] = set()
        if isinstance(node, dict):
            for k, v in node.items():
                keys.add(f"{prefix}{k}")
                keys |= walk(v, f"{prefix}{k}.")
        elif isinstance(node, list):
            for item in node:
                keys |= walk(item, f"{prefix.removesuffix('.')}[].")
        return keys

    # A commented key is uncommented in place (its indentation kept), so it lands at its own path.
    uncommented = re.sub(r"(?m)^(\s*)# ([a-z_]+: .*?)(\s+#.*)?$", r"\1\2", text)
    keys = walk(yaml.safe_load(uncommented), "")
    return {k for k in keys if not re.search(r"\.(job_priorities|job_sleep_levels|env)\..", k)}


def test_the_cpu_example_shows_every_key_of_the_stack_file():
    from llmd_timeslice.local.stack_file import StackFile

    shown = _example_keys((REPO / "examples" / "cpu-stack.yaml").read_text())
    missing = [k for k in _model_keys(StackFile) if k not in shown]
    assert not missing, f"examples/cpu-stack.yaml says it shows every key; it lacks {missing}"


def test_a_stack_file_with_five_errors_of_different_kinds_reports_all_five_at_once(tmp_path):
    d = _base()
    d["stack"]["max_hold_s"] = -1  # range
    d["groups"][0]["sleep_level"] = 5  # range, in a group that engines refer to
    d["engines"][0]["sidecar_port"] = "nine"  # type, in an engine that is then left out of the cross checks
    d["engines"][1]["pool"] = "nowhere"  # an unknown reference, found only by the cross checks
    d["engines"][1]["vllm"]["model"] = "./no-such-model"  # a missing model directory, also a cross check
    with pytest.raises(StackError) as ei:
        load_stack_file(_write(tmp_path, d))
    errors = ei.value.errors
    assert len(errors) == 5, errors
    for where in (
        "stack.max_hold_s:",
        "groups[0].sleep_level:",
        "engines[0].sidecar_port:",
        "engines[1] (sampler-1).pool: unknown pool 'nowhere'",
        "engines[1] (sampler-1).vllm.model: no model directory",
    ):
        assert any(e.startswith(where) for e in errors), (where, errors)


def test_port_offset_moves_every_port_the_stack_binds_and_its_workdir(tmp_path):
    f = _write(tmp_path, _base())
    base = load_stack_file(f)
    moved = load_stack_file(f, port_offset=100)
    assert {k: None if v is None else v + 100 for k, v in base.stack.ports.model_dump().items()} == moved.stack.ports.model_dump()
    assert [(e.sidecar_port + 100, e.vllm.port + 100) for e in base.engines] == [
        (e.sidecar_port, e.vllm.port) for e in moved.engines
    ]
    assert moved.workdir(tmp_path) == tmp_path / ".llmd-timeslice" / "cpu+100"
    d = _base()
    d["stack"]["port_offset"] = 100
    assert load_stack_file(_write(tmp_path, d)).stack.ports == moved.stack.ports, "the setting does what the flag does"
    assert load_stack_file(_write(tmp_path, d), port_offset=0).stack.ports == base.stack.ports, "the flag replaces it"


def test_a_port_offset_past_65535_names_the_port_it_moves_there(tmp_path):
    d = _base()
    d["stack"]["port_offset"] = 15000  # orchestrator 50051 -> 65051: fine; below, the flag moves it further
    load_stack_file(_write(tmp_path, d))
    with pytest.raises(StackError) as ei:
        load_stack_file(_write(tmp_path, d), port_offset=16000)
    assert "stack.ports.orchestrator: port 66051 is above 65535 with stack.port_offset 16000" in ei.value.errors


def test_up_with_a_host_that_is_not_an_address_of_this_machine_is_one_line_and_exit_2(tmp_path):
    d = _base()
    d["stack"]["host"] = "10.255.255.1"
    d["stack"]["workdir"] = str(tmp_path / "work")
    f = _write(tmp_path, d)
    r = run_cli("up", "-f", str(f), "--no-live")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [
        "llmd-timeslice up: stack.host: 10.255.255.1 is not an address of this machine (Cannot assign requested "
        "address); every component binds it: use 127.0.0.1, 0.0.0.0 or an address of this machine's interfaces"
    ], r.stderr
    assert not (tmp_path / "work" / "stack.json").exists() and not (tmp_path / "work" / "logs").exists()


def _across_without_node_list(d: dict, tmp_path: Path) -> list[str]:
    d["engines"][1]["node"] = 1
    return ["engines: they name nodes, but there is no node list (stack.nodes or a Slurm allocation)"]


def _host_not_here(d: dict, tmp_path: Path) -> list[str]:
    d["stack"]["host"] = "10.255.255.1"
    return [
        "stack.host: 10.255.255.1 is not an address of this machine (Cannot assign requested address); every "
        "component binds it: use 127.0.0.1, 0.0.0.0 or an address of this machine's interfaces"
    ]


def _token_dir(d: dict, tmp_path: Path) -> list[str]:
    (tmp_path / "tokens").mkdir()
    d["stack"]["token_file"] = "tokens"
    return [
        f"stack.token_file {tmp_path / 'tokens'}: is a directory; name a file holding the token, or leave "
        "stack.token_file out (`up` generates one)"
    ]


def _token_empty(d: dict, tmp_path: Path) -> list[str]:
    (tmp_path / "token").write_text("\n")
    d["stack"]["token_file"] = str(tmp_path / "token")
    return [
        f"stack.token_file {tmp_path / 'token'}: the file is empty; write the token into it, or delete it and `up` creates one"
    ]


def _both(*cases):
    def mutate(d: dict, tmp_path: Path) -> list[str]:
        return [line for case in cases for line in case(d, tmp_path)]

    return mutate


@pytest.mark.parametrize(
    "mutate",
    [
        _across_without_node_list,
        _host_not_here,
        _token_dir,
        _token_empty,
        _both(_host_not_here, _token_dir),
        _both(_across_without_node_list, _token_empty),
    ],
    ids=[
        "engines-node-without-node-list",
        "host-not-here",
        "token-file-directory",
        "token-file-empty",
        "host-and-token-directory",
        "nodes-and-token-empty",
    ],
)
def test_config_check_refuses_what_up_refuses_before_starting_anything_every_error_at_once(tmp_path, monkeypatch, mutate):
    """The fresh-clone trial: `config check` said OK for files `up` then refused (engines naming nodes without a node
    list, a host not of this machine) or that failed after the engines started (a token file that is a directory or
    empty). One check (llmd_timeslice/local/preflight.py) answers for both: the same lines, all of them, exit 2,
    nothing written."""
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    d = _base()
    d["stack"]["workdir"] = str(tmp_path / "work")
    expected = mutate(d, tmp_path)
    f = _write(tmp_path, d)
    check = _config_check(f)
    assert check.returncode == 2 and check.stderr.splitlines() == [f"{f}: {line}" for line in expected], check.stderr
    assert "OK" not in check.stdout
    up = run_cli("up", "-f", str(f), "--no-live")
    assert up.returncode == 2, up.stdout + up.stderr
    assert [ln for ln in up.stderr.splitlines() if ln.strip()] == [f"llmd-timeslice up: {line}" for line in expected]
    assert not (tmp_path / "work").exists(), "nothing was started or written"


@pytest.mark.parametrize(
    "make,problem",
    [
        (
            lambda t: t.parent.write_text("a file"),
            "cannot read it (Not a directory); make it readable by this user",
        ),
        (
            lambda t: t.parent.mkdir() or t.write_bytes(b"\xff\xfe"),
            "is not text; write the token into it as one line",
        ),
    ],
    ids=["folder-is-a-file", "not-text"],
)
def test_a_token_file_that_cannot_be_read_is_refused_before_anything_starts(tmp_path, make, problem):
    """A token file whose folder is a file, or that is not text (mode 000 cannot be tested as root, who reads it)."""
    token = tmp_path / "secrets" / "token"
    make(token)
    d = _base()
    d["stack"]["token_file"] = str(token)
    f = _write(tmp_path, d)
    r = _config_check(f)
    assert r.returncode == 2 and r.stderr.splitlines() == [f"{f}: stack.token_file {token}: {problem}"], r.stderr


def test_a_token_file_that_does_not_exist_is_created_0600_and_said_so(tmp_path):
    """A stack.token_file named on purpose that is not there yet: `config check` notes that `up` creates it; `up`
    (its preparation, what it writes before it starts a component) creates it, mode 0600, with a token."""
    from llmd_timeslice.local.up import Stack

    d = _base()
    d["stack"]["token_file"] = "secrets/token"
    d["engines"] = [{"name": "ext", "group": "rollout-group", "sidecar_port": 9101, "url": "http://127.0.0.1:7001"}]
    f = _write(tmp_path, d)
    token = tmp_path / "secrets" / "token"
    r = _config_check(f)
    assert r.returncode == 0, r.stderr
    assert f"  note: stack.token_file {token}: no such file; `up` creates it with a new token (mode 0600)" in r.stdout
    assert not token.exists(), "config check writes nothing"
    Stack(load_stack_file(f), tmp_path, workdir=tmp_path / "work").prepare()
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text().strip()) >= 24
    assert [p.name for p in token.parent.iterdir()] == ["token"], "no temporary file is left beside it"


async def test_the_gate_starts_beside_the_orchestrator_and_is_ready_only_once_it_has_the_orchestrators_state(tmp_path):
    """`up` starts the gate in the orchestrator's stage (not after it: one Python start-up less on the way to a
    running stack), so its readiness probe asks the gate's readiness service, SERVING only once the orchestrator's
    first state snapshot was applied: Envoy, the next stage, never starts in front of a gate without state."""
    from epp_plugin.gate.server import GateConfig, GateServer
    from llmd_timeslice.local.up import Stack
    from tests.conftest import free_port

    d = _base()
    port = free_port()
    d["stack"]["ports"] = {"gate_ext_proc": port}
    d["engines"] = [{"name": "ext", "group": "rollout-group", "sidecar_port": 9101, "url": "http://127.0.0.1:7001"}]
    stages = Stack(load_stack_file(_write(tmp_path, d)), tmp_path, workdir=tmp_path / "wd").prepare()
    assert [[c.name for c in st] for st in stages] == [["sidecar-ext"], ["orchestrator", "gate"], ["envoy"]]
    (gate_spec,) = [c for c in stages[1] if c.name == "gate"]
    assert gate_spec.probe is not None
    # a gate whose orchestrator does not answer yet: it serves, but has no state
    gate = GateServer(GateConfig(host="127.0.0.1", ext_proc_port=port, control_port=0, orchestrator=f"127.0.0.1:{free_port()}"))
    await gate.start()
    try:
        assert not await gate_spec.probe(), "ready before it had the orchestrator's state"
        gate._synced()  # what the subscription calls once the orchestrator's first snapshot is applied
        for _ in range(100):  # the readiness update runs in a task of the gate's
            if await gate_spec.probe():
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the gate was not ready once it had the orchestrator's state")
    finally:
        await gate.stop()
