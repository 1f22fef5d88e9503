"""Compatibility: an "existing llm-d client" — stubs generated at test time from a .proto written from the
upstream tables, separate from the project's own, in its own process — drives the orchestrator unchanged;
and 20 jobs contend for one group, granted once each in FIFO order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from grpc_tools import protoc

from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from tests.orchestrator.test_orchestrator import RecordingActions

COMPAT = Path(__file__).parents[1] / "compat"
INV = Inventory.model_validate(
    {
        "groups": [
            {
                "group_id": "g0",
                "samplers": [
                    {"pool": "default", "address": "127.0.0.1:8001", "sidecar": "127.0.0.1:9101", "job_id": "sampler-0"}
                ],
            },
            {"group_id": "trainers"},
        ]
    }
)


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("upstream_stubs")
    include = Path(protoc.__file__).parent / "_proto"
    rc = protoc.main(
        [
            "protoc",
            f"-I{COMPAT}",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(COMPAT / "upstream_orchestrator.proto"),
        ]
    )
    assert rc == 0
    return out


@pytest.fixture
def server(loop_thread):
    srv = OrchestratorServer(INV, port=0, actions=RecordingActions())  # no token: as upstream clients connect
    loop_thread.run(srv.start())
    yield srv
    loop_thread.run(srv.stop())


@pytest.mark.parametrize("scenario", ["basic", "twenty"])
def test_upstream_client_drives_the_orchestrator_unchanged(stubs, server, scenario):
    r = subprocess.run(
        [sys.executable, str(COMPAT / "upstream_client.py"), str(stubs), f"127.0.0.1:{server.port}", scenario],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr
