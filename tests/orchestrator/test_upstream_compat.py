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


def test_upstream_client_works_unchanged_against_a_group_that_receives_yield_requests(stubs, loop_thread):
    """Acquire (upstream client), a yield request marks its lease, it yields and acquires again: its wire has no
    Lease extension and nothing it sees changes; the orchestrator counts the yield as honoured."""
    inv = Inventory.model_validate({"groups": [dict(INV.model_dump()["groups"][0], min_training_s=0)]})
    srv = OrchestratorServer(inv, port=0, actions=RecordingActions())
    loop_thread.run(srv.start())
    proc = subprocess.Popen(
        [sys.executable, str(COMPAT / "upstream_client.py"), str(stubs), f"127.0.0.1:{srv.port}", "yield_requested"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ACQUIRED"
        answer = loop_thread.run(srv.orchestrator.request_yield("g0", "eval band waits", band=10, hold_deadline_s=5))
        assert answer.requested and answer.holder == "trainer-0"
        proc.stdin.write("REQUESTED\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.strip().endswith("OK"), out + err
        g = srv.orchestrator.groups["g0"]
        assert (g.yield_stats.sent, g.yield_stats.honoured) == (1, 1)
    finally:
        proc.kill()
        loop_thread.run(srv.stop())
