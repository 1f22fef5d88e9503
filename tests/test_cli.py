"""The CLI as a user runs it: bad input gets one clear line and exit code 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.support.cli import run_cli as run  # the commands that exit at once, in this process


def run_process(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """``python -m llmd_timeslice.cli ARGS`` as a child process (the entry point as installed)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLMD_TIMESLICE_")}
    return subprocess.run(
        [sys.executable, "-m", "llmd_timeslice.cli", *args], capture_output=True, text=True, timeout=timeout, env=base
    )


@pytest.mark.parametrize(
    "inventory,expected",
    [
        ("groups:\n  - group_id: g\n    sleep_levle: 1\n", "sleep_levle"),
        (
            "groups:\n  - group_id: g\n    samplers:\n      - {address: '127.0.0.1:99999', sidecar: 'a:1', job_id: s}\n",
            "expected host:port",
        ),
        ("groups:\n  - group_id: g\n  - group_id: g\n", "duplicate group_id"),
        ("groups: [\n", "while parsing"),
    ],
)
def test_bad_inventory_is_one_line_naming_the_problem(tmp_path, inventory, expected):
    f = tmp_path / "inv.yaml"
    f.write_text(inventory)
    r = run("orchestrator", "--inventory", str(f), "--port", "0")
    assert r.returncode == 2, r.stderr
    assert expected in r.stderr and "Traceback" not in r.stderr


def test_out_of_range_port_is_refused():
    r = run("gate", "--ext-proc-port", "70000")
    assert r.returncode == 2 and "65535" in r.stderr


def test_missing_token_file_is_one_line():
    r = run("status", "--token-file", "/nonexistent/token")
    assert r.returncode == 2 and "/nonexistent/token" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("endpoint", ["default=notanaddr", "default=example.com:80", "default=10.0.0.1:99999"])
def test_bad_picker_endpoint_is_refused(endpoint):
    """An IP address and a port: the picker's answer is Envoy's ORIGINAL_DST header, which Envoy does not resolve."""
    r = run("picker", "--endpoint", endpoint)
    assert r.returncode == 2 and "POOL=ip:port (an IP address" in r.stderr and endpoint in r.stderr, r.stderr


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--max-hold-s", "nan"], "--max-hold-s"),
        (["--max-hold-s", "-5"], "--max-hold-s: must be a positive number of seconds, not -5"),
        (["--max-hold-s", "0"], "--max-hold-s: must be a positive number of seconds, not 0"),
        (["--max-hold-s", "7200"], "--max-hold-s"),
        (["--generation-timeout-s", "1e300"], "--generation-timeout-s"),
        (["--listen-port", "9901"], "--listen-port and --admin-port are the same port 9901"),
        (["--gate-edge", "ext_proc", "--gate-port", "9004"], "--gate-port and --epp-port are the same port 9004"),
        (["--listen-port", "0"], "--listen-port"),
        (["--pool", ""], "--pool: must not be empty"),
    ],
)
def test_render_envoy_refuses_what_the_gate_or_envoy_would_and_writes_nothing(tmp_path, args, expected):
    out = tmp_path / "envoy.json"
    r = run("render-envoy", "--out", str(out), "--no-validate", *args)
    assert r.returncode == 2 and expected in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists()


def test_every_subcommand_has_help():
    from typer.testing import CliRunner

    from llmd_timeslice.cli import app

    r = run_process("gate", "--help")  # through the process entry point once; each command in this process below
    assert r.returncode == 0 and "--help" in r.stdout, r.stderr
    for cmd in ("gate", "picker", "orchestrator", "sidecar", "status", "demo", "render-envoy"):
        r = CliRunner().invoke(app, [cmd, "--help"])
        assert r.exit_code == 0 and "--help" in r.output, (cmd, r.output)


def _commands():
    """Every command path of the CLI: ("gate",), ("config", "check"), ..."""
    import typer

    from llmd_timeslice.cli import app

    def walk(cmd, path):
        yield path, cmd
        for name, sub in getattr(cmd, "commands", {}).items():  # a group (typer's own click)
            yield from walk(sub, (*path, name))

    return list(walk(typer.main.get_command(app), ()))


@pytest.mark.parametrize("path", [p for p, _ in _commands()], ids=lambda p: " ".join(p) or "(top)")
def test_help_fits_80_columns_and_cuts_nothing(path):
    """`--help` at 80 columns (a pipe, or COLUMNS=80): no line wider, no value ending in '…', every option whole."""
    from typer.testing import CliRunner

    from llmd_timeslice.cli import app

    cmd = dict(_commands())[path]
    r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert r.exit_code == 0, r.output
    wide = [ln for ln in r.output.splitlines() if len(ln) > 80]
    assert not wide, wide
    cut = [ln for ln in r.output.splitlines() if "…" in ln or (ln.endswith("...") and not ln.startswith("Usage:"))]
    assert not cut, cut
    for p in cmd.params:
        for opt in [*p.opts, *p.secondary_opts]:
            if opt.startswith("-"):
                assert opt in r.output, (opt, r.output)


def test_picker_binds_its_host_not_the_last_endpoints_host():
    """Issue 16 bug 1: `picker --host 127.0.0.1 --endpoint default=127.0.0.2:8000` listened on 127.0.0.2 (a loop
    variable shadowed --host). It must answer gRPC health on 127.0.0.1."""
    import time

    import grpc
    import port_for
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = port_for.select_random()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmd_timeslice.cli",
            "picker",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--endpoint",
            "default=127.0.0.2:8000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            while True:
                try:
                    r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                    break
                except grpc.RpcError:
                    assert proc.poll() is None, proc.stdout.read().decode()
                    assert time.monotonic() < deadline, "the picker never answered on --host 127.0.0.1"
                    time.sleep(0.2)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.terminate()
        proc.wait(10)


def test_settings_problems_are_one_line_each_naming_option_variable_or_file(tmp_path):
    f = tmp_path / "gate.yaml"
    f.write_text("gate:\n  max_hodl_s: 1\n  pools: [a]\n")
    r = run("gate", "--config", str(f), env={"LLMD_TIMESLICE_GATE__STALE_AFTER_S": "soon"})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert sorted(lines) == sorted(
        [
            f"llmd-timeslice gate: {f}: gate.max_hodl_s: unknown key (did you mean gate.max_hold_s?)",
            "llmd-timeslice gate: gate.stale_after_s: invalid duration 'soon': expected seconds (a number) or a number "
            "with a unit, e.g. 500ms, 30s, 10m, 1h, 1m30s [from $LLMD_TIMESLICE_GATE__STALE_AFTER_S]",
        ]
    ), lines
    r = run("sidecar")
    assert r.returncode == 2 and r.stderr.strip() == (
        "llmd-timeslice sidecar: --job-id: required (or $LLMD_TIMESLICE_SIDECAR__JOB_ID)"
    ), r.stderr
    r = run("orchestrator", "--discovery", "kubernetes", "--state-file", "s.json", "--state-configmap", "cm")
    assert r.returncode == 2 and "--state-configmap: choose one of --state-file and --state-configmap" in r.stderr


def test_running_gate_holds_for_the_max_hold_its_environment_sets(tmp_path):
    """Issue 16: `LLMD_TIMESLICE_GATE__MAX_HOLD_S` (listed in docs/configuration.md) was never read: the gate held
    for its 600 s default. Here the file says 1 h and serves pool `p`, the environment 500 ms (it wins over the
    file): a request held on `p` (no endpoint serves) must be refused `hold_expired` after about half a second."""
    import httpx
    import port_for

    from llmd_timeslice import protocol

    ext_proc, authz, control = (port_for.select_random() for _ in range(3))
    cfg = tmp_path / "gate.yaml"
    cfg.write_text(f"gate:\n  pools: [p]\n  default_pool: p\n  max_hold_s: 1h\n  authz_port: {authz}\n")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("LLMD_TIMESLICE_")},
        "LLMD_TIMESLICE_GATE__MAX_HOLD_S": "500ms",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmd_timeslice.cli",
            "gate",
            "--config",
            str(cfg),
            "--ext-proc-port",
            str(ext_proc),
            "--control-port",
            str(control),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{authz}/v1/completions"
        with httpx.Client(timeout=20) as client:
            deadline = time.monotonic() + 30
            while True:  # ready when it answers a check for a pool it does not serve (refused at once)
                try:
                    r = client.post(url, headers={protocol.POOL_HEADER: "unknown"})
                    break
                except httpx.TransportError:
                    assert proc.poll() is None, proc.stdout.read().decode()
                    assert time.monotonic() < deadline, "the gate never answered on its ext_authz port"
                    time.sleep(0.2)
            assert r.headers[protocol.REASON_HEADER] == "unknown_pool"
            started = time.monotonic()
            r = client.post(url, headers={protocol.POOL_HEADER: "p"})
            held_s = time.monotonic() - started
        assert r.headers.get(protocol.REASON_HEADER) == "hold_expired", (r.status_code, r.headers)
        assert r.headers.get(protocol.STATUS_HEADER) == "503"
        assert 0.4 <= held_s < 10, f"held {held_s:.2f} s; the environment says 0.5 s, the file 3600 s"
    finally:
        proc.terminate()
        proc.wait(10)


def test_render_envoy_removes_a_bootstrap_envoy_rejects(tmp_path, monkeypatch):
    """Should Envoy refuse what was rendered (another Envoy version), the file is not left for Envoy to be pointed at."""
    from llmd_timeslice.router import envoy_launcher

    def reject(path):
        assert path.exists()
        raise ValueError(f"envoy rejected {path}: error initializing configuration (test)")

    monkeypatch.setattr(envoy_launcher, "validate", reject)
    out = tmp_path / "envoy.json"
    r = run("render-envoy", "--out", str(out))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"llmd-timeslice: error: envoy rejected {out}: error initializing configuration (test)"
    assert not out.exists()


def test_a_command_plugin_that_cannot_load_is_named_in_one_line_and_the_rest_still_run(monkeypatch, capsys):
    """The entry point group ``llmd_timeslice.commands`` (the gate's and picker's commands): one that names a missing
    module leaves its commands out with one line; the installed one adds ``gate`` and ``picker``."""
    import importlib.metadata

    import typer
    from typer.testing import CliRunner

    from llmd_timeslice import cli

    broken = importlib.metadata.EntryPoint("broken", "no_such_package.commands:register", "llmd_timeslice.commands")
    real = [ep for ep in importlib.metadata.entry_points(group="llmd_timeslice.commands")]
    assert [ep.value for ep in real] == ["epp_plugin.commands:register"], "pyproject.toml's entry point is installed"
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [broken, *real])
    app = typer.Typer(rich_markup_mode=None)

    @app.command()
    def other() -> None:
        """Another command."""

    cli._register_command_plugins(app)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no_such_package.commands:register" in err[0] and "unavailable" in err[0], err
    out = CliRunner().invoke(app, ["--help"]).output
    assert all(name in out for name in ("gate", "picker", "other")), out


_NO_SUCH = "no such file"


@pytest.mark.parametrize(
    "args,what,problem",
    [
        (("up", "-f"), "llmd-timeslice up: stack file", _NO_SUCH),
        (("down", "-f"), "llmd-timeslice down: stack file", _NO_SUCH),
        (("status", "-f"), "llmd-timeslice status: stack file", _NO_SUCH),
        (("plan", "-p"), "llmd-timeslice plan: profiles file", _NO_SUCH),
        (("plan", "-f"), "llmd-timeslice plan: stack file", _NO_SUCH),
        (("plan", "--offer-file"), "llmd-timeslice plan: offer file", _NO_SUCH),
        (("plan", "--switch-costs"), "llmd-timeslice plan: switch costs file", _NO_SUCH),
        (("plan", "--apply", "--stack"), "llmd-timeslice plan: stack file", _NO_SUCH),
        (("orchestrator", "--inventory"), "llmd-timeslice: error:", "No such file or directory"),  # read, not checked
        (("k8s", "restore"), "llmd-timeslice: error:", "No such file or directory"),
    ],
)
def test_a_file_that_is_not_there_is_one_line_naming_it_exit_2(tmp_path, args, what, problem):
    """The fresh-clone trial: `up -f missing.yaml` and `plan -p missing.yaml` printed click's four lines of usage.
    One line naming the file, exit 2 (a usage error), for every option that reads a file; a folder given as the
    file is named too."""
    missing = tmp_path / "missing.yaml"
    r = run(*args, str(missing))
    assert r.returncode == 2 and r.stderr.splitlines() == [f"{what} {missing}: {problem}"], r.stderr
    if problem == _NO_SUCH:
        r = run(*args, str(tmp_path))
        assert r.returncode == 2 and r.stderr.splitlines() == [f"{what} {tmp_path}: is a directory, not a file"], r.stderr


@pytest.mark.parametrize("profiles", [False, True], ids=["status", "status-profiles"])
def test_status_hint_names_the_port_offset_it_was_given(tmp_path, profiles):
    """The fresh-clone trial: `status -f STACK --port-offset 200` of a stack not running said `start one with
    llmd-timeslice up -f STACK`, which starts the stack without the offset. The hint repeats the offset (and a
    --workdir given); `status --profiles` looks for the stack at that offset too."""
    from pathlib import Path

    f = tmp_path / "stack.yaml"
    f.write_text((Path(__file__).resolve().parents[1] / "examples" / "cpu-stack.yaml").read_text())
    hint = f"start one with `llmd-timeslice up -f {f} --port-offset 200`"
    r = run("status", "-f", str(f), "--port-offset", "200", *(["--profiles"] if profiles else []))
    assert r.returncode == 1, r.stdout + r.stderr
    if profiles:
        assert r.stderr.splitlines() == [f"no stack runs from {f}: {hint.replace('start one', 'start it')}"], r.stderr
    else:
        assert r.stdout.splitlines() == [f"no stack state in {tmp_path}/.llmd-timeslice/cpu+200: {hint}"], r.stdout
    wd = tmp_path / "wd"
    r = run("status", "-f", str(f), "--workdir", str(wd), "--port-offset", "7")
    assert f"`llmd-timeslice up -f {f} --workdir {wd} --port-offset 7`" in r.stdout, r.stdout


@pytest.mark.parametrize("path", [p for p, _ in _commands()], ids=lambda p: " ".join(p) or "(top)")
def test_every_option_names_its_value_in_one_placeholder_style(path):
    """The fresh-clone trial: `up --help` said `--file <file>`, `plan --help` `--profiles FILE`, the components
    `--token-file PATH`. Every option's value and every argument reads as click's own (FILE, DIR, TEXT, INTEGER,
    SECONDS, HOST:PORT, [a|b], ...), never typer's `<file>` / `<int range>`, and a file is FILE, not PATH."""
    import re

    cmd = dict(_commands())[path]
    bad = []
    for p in cmd.params:
        if p.param_type_name == "option" and (p.is_flag or p.is_bool_flag or p.hidden):  # typer's own click
            continue
        shown = p.metavar or ""
        if not re.fullmatch(r"[A-Z][A-Z0-9_:=.]*|\[[a-z0-9_|]+\]", shown) or shown == "PATH":
            bad.append((p.name, shown))
    assert not bad, bad
