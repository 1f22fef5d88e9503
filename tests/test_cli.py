"""The CLI as a user runs it: bad input gets one clear line and exit code 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmd_timeslice.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("inventory,expected", [
    ("groups:\n  - group_id: g\n    sleep_levle: 1\n", "sleep_levle"),
    ("groups:\n  - group_id: g\n    samplers:\n      - {address: '127.0.0.1:99999', sidecar: 'a:1', job_id: s}\n",
     "expected host:port"),
    ("groups:\n  - group_id: g\n  - group_id: g\n", "duplicate group_id"),
    ("groups: [\n", "while parsing"),
])
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


def test_bad_picker_endpoint_is_refused():
    r = run("picker", "--endpoint", "default=notanaddr")
    assert r.returncode == 2 and "POOL=ip:port" in r.stderr


def test_every_subcommand_has_help():
    for cmd in ("gate", "picker", "orchestrator", "sidecar", "status", "demo", "render-envoy"):
        r = run(cmd, "--help")
        assert r.returncode == 0 and "--help" in r.stdout, cmd
