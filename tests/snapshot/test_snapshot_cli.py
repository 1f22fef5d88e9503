"""`llmd-timeslice sidecar` refuses bad snapshot options with one line (no server started)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from llmd_timeslice.cli import app


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "cuda"], "--pid: required with --backend cuda"),
        (["--backend", "criu"], "Input should be 'vllm', 'sglang', 'cuda' or 'workload_channel'"),
        (["--pause-mode", "later"], "Input should be 'wait', 'keep' or 'abort'"),
        (["--annotation", "novalue"], "expected KEY=VALUE, got 'novalue'"),
        (["--residual-margin-bytes", "lots"], "--residual-margin-bytes': could not parse value and unit"),
        (["--memory-settle-timeout-s", "300"], "must be below --operation-timeout-s"),
    ],
)
def test_sidecar_refuses_bad_snapshot_options(args, message):
    r = CliRunner().invoke(app, ["sidecar", "--job-id", "j", "--port", "0", *args])
    assert r.exit_code == 2
    flat = " ".join(r.output.replace("│", " ").split())  # rich wraps the error box
    assert message in flat, r.output
