"""A refused token surfaces from the TimeSlice client as AuthError (still a LeaseError), whose message says where the
client took its token from: the token= or token_file= argument, $LLMD_TIMESLICE_TOKEN_FILE (which file),
$LLMD_TIMESLICE_TOKEN, or, with none, everywhere it looked. Against a real orchestrator over gRPC."""

from __future__ import annotations

import pytest

from llmd_timeslice.auth import TOKEN_ENV, TOKEN_FILE_ENV
from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient, AuthError, LeaseError, TimeSliceOrchestratorClient
from llmd_timeslice.domain.inventory import Inventory
from llmd_timeslice.orchestrator.server import OrchestratorServer

TOKEN = "the-stacks-token"
INVENTORY = Inventory.model_validate({"groups": [{"group_id": "g"}]})


@pytest.fixture
def orchestrator(loop_thread):
    srv = OrchestratorServer(INVENTORY, port=0, token=TOKEN, job_tokens={"job-a": "token-of-job-a"})
    loop_thread.run(srv.start())
    yield f"127.0.0.1:{srv.port}"
    loop_thread.run(srv.stop())


def _given(case: str, tmp_path, monkeypatch) -> tuple[dict, str]:
    """Client kwargs for ``case`` (environment set as it needs) and what the error must say about the source."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    wrong = tmp_path / "old-stack-token"
    wrong.write_text("a-token-of-another-stack\n")
    if case == "token_argument":
        return {"token": "a-token-of-another-stack"}, "the client's token came from the token= argument"
    if case == "token_file_argument":
        return {"token_file": wrong}, f"the client's token came from the token_file= argument: file {wrong}"
    if case == "token_file_variable":
        monkeypatch.setenv(TOKEN_FILE_ENV, str(wrong))
        return {}, f"the client's token came from ${TOKEN_FILE_ENV}: file {wrong}"
    if case == "token_variable":
        monkeypatch.setenv(TOKEN_ENV, "a-token-of-another-stack")
        return {}, f"the client's token came from ${TOKEN_ENV}"
    assert case == "no_token"
    return {}, (
        f"the client sent no token: it looked at the token= and token_file= arguments, ${TOKEN_FILE_ENV} and "
        f"${TOKEN_ENV} (none set)"
    )


CASES = ["token_argument", "token_file_argument", "token_file_variable", "token_variable", "no_token"]


@pytest.mark.parametrize("case", CASES)
def test_refused_token_is_an_auth_error_naming_where_the_token_came_from(orchestrator, tmp_path, monkeypatch, case):
    kwargs, source = _given(case, tmp_path, monkeypatch)
    with TimeSliceOrchestratorClient(orchestrator, job_id="trainer", group_id="g", **kwargs) as c:
        for call in (c.list_groups, lambda: c.acquire(timeout_sec=5)):
            with pytest.raises(AuthError) as ei:
                call()
            err = ei.value
            assert isinstance(err, LeaseError), "code catching LeaseError keeps working"
            assert "UNAUTHENTICATED: missing or wrong bearer token" in str(err) and source in str(err), str(err)
            assert err.token_source == source


@pytest.mark.parametrize("case", ["token_file_variable", "no_token"])
async def test_async_client_raises_the_same_auth_error(orchestrator, tmp_path, monkeypatch, case):
    kwargs, source = _given(case, tmp_path, monkeypatch)
    c = AsyncTimeSliceOrchestratorClient(orchestrator, job_id="trainer", group_id="g", **kwargs)
    try:
        with pytest.raises(AuthError, match="UNAUTHENTICATED") as ei:
            await c.acquire(timeout_sec=5)
        assert ei.value.token_source == source and source in str(ei.value)
    finally:
        await c.close()


def test_another_jobs_token_is_an_auth_error_too(orchestrator, tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "job-a-token"))
    (tmp_path / "job-a-token").write_text("token-of-job-a")
    denied = r"PERMISSION_DENIED: the token of job 'job-a' cannot act for job 'job-b'"
    with (
        TimeSliceOrchestratorClient(orchestrator, job_id="job-b", group_id="g") as c,
        pytest.raises(AuthError, match=denied) as ei,
    ):
        c.acquire(timeout_sec=5)
    assert f"${TOKEN_FILE_ENV}: file {tmp_path / 'job-a-token'}" in str(ei.value)


def test_right_token_from_a_file_argument_works(orchestrator, tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    f = tmp_path / "control-token"
    f.write_text(TOKEN + "\n")
    with TimeSliceOrchestratorClient(orchestrator, job_id="trainer", group_id="g", token_file=f) as c:
        assert c.list_groups() == ["g"]
        c.acquire(timeout_sec=5)
        c.release()


def test_rl_loop_with_a_wrong_token_in_the_variable_names_the_variable_not_an_argument(
    orchestrator, tmp_path, monkeypatch, capsys
):
    """examples/rl_loop.py finds the token file through llmd_timeslice.local.find_stack and hands it to the client;
    the refusal names where the user put it ($LLMD_TIMESLICE_TOKEN_FILE), not the token_file= argument the script
    passed on."""
    import importlib.util
    from pathlib import Path

    from llmd_timeslice.local.find_stack import ORCH_ADDR_ENV
    from llmd_timeslice.local.up import ROUTER_URL_ENV

    spec = importlib.util.spec_from_file_location("rl_loop", Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py")
    assert spec is not None and spec.loader is not None
    rl_loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rl_loop)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    wrong = tmp_path / "old-stack-token"
    wrong.write_text("a-token-of-another-stack\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(wrong))
    monkeypatch.setenv(ORCH_ADDR_ENV, orchestrator)
    monkeypatch.setenv(ROUTER_URL_ENV, "http://127.0.0.1:9")
    assert rl_loop.main(["--stack", str(tmp_path / "none.yaml"), "--group", "g", "--iterations", "1"]) == 1
    err = capsys.readouterr().err
    assert f"the client's token came from ${TOKEN_FILE_ENV}: file {wrong}" in err, err
    assert "token_file= argument" not in err, err
