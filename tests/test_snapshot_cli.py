"""`llmd-timeslice sidecar` refuses bad snapshot options with one line (no server started)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from llmd_timeslice.cli import app


@pytest.mark.parametrize(("args", "message"), [
    (["--backend", "cuda"], "at least one --pid"),
    (["--backend", "criu"], "choose vllm, sglang, cuda or workload_channel"),
    (["--pause-mode", "later"], "choose wait, keep or abort"),
    (["--annotation", "novalue"], "is not KEY=VALUE"),
])
def test_sidecar_refuses_bad_snapshot_options(args, message):
    r = CliRunner().invoke(app, ["sidecar", "--job-id", "j", "--port", "0", *args])
    assert r.exit_code == 2
    flat = " ".join(r.output.replace("│", " ").split())  # rich wraps the error box
    assert message in flat, r.output
