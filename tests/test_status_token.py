"""`llmd-timeslice status` against an orchestrator that refuses its token: the refusal names `--token-file` (and
where the token it sent came from), whether no token, a wrong file or the variable was used. Real gRPC."""

from __future__ import annotations

import port_for
import pytest
from rich.console import Console

from llmd_timeslice.auth import TOKEN_ENV, TOKEN_FILE_ENV
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer
from llmd_timeslice.status import print_status


@pytest.fixture
def orchestrator(loop_thread):
    srv = OrchestratorServer(Inventory.model_validate({"groups": [{"group_id": "g"}]}), port=0, token="the-stacks-token")
    loop_thread.run(srv.start())
    yield f"127.0.0.1:{srv.port}"
    loop_thread.run(srv.stop())


@pytest.mark.parametrize("case", ["no_token", "wrong_token_file", "wrong_variable_file"])
def test_status_with_a_refused_token_names_the_token_file_flag(orchestrator, tmp_path, monkeypatch, case):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    wrong = tmp_path / "old-token"
    wrong.write_text("a-token-of-another-stack\n")
    token_file, expected = None, "no token was sent: give --token-file FILE"
    if case == "wrong_token_file":
        token_file, expected = wrong, f"the token sent came from --token-file {wrong}"
    elif case == "wrong_variable_file":
        monkeypatch.setenv(TOKEN_FILE_ENV, str(wrong))
        expected = f"the token sent came from ${TOKEN_FILE_ENV} ({wrong}); give --token-file FILE"
    console = Console(record=True, width=400)
    assert print_status(orchestrator, [], token_file, console) == 1
    text = console.export_text()
    assert "UNAUTHENTICATED" in text and expected in text, text


def test_status_with_nothing_listening_says_where_a_stacks_addresses_are():
    console = Console(record=True, width=400)
    assert print_status(f"127.0.0.1:{port_for.select_random()}", [], None, console) == 1
    text = console.export_text()
    assert "UNAVAILABLE" in text and "is a stack running? `status -f STACK.yaml`" in text, text
