"""Orchestrator refusals reach the client as exceptions chosen by their ``google.rpc.ErrorInfo`` reason
(``llmd_timeslice/error_info.py``), never by message text."""

from __future__ import annotations

import grpc
import pytest

from llmd_timeslice import error_info
from llmd_timeslice.client import (
    LockOrderViolation,
    NotHolder,
    OrchestratorUnavailable,
    TimeSliceOrchestratorClient,
    UnknownGroup,
)
from llmd_timeslice.client.integrations import LockOrderError, TimeSliceConfigError, TimesliceConfigError
from llmd_timeslice.orchestrator.server import OrchestratorServer
from tests.orchestrator.test_orchestrator import INVENTORY, RecordingActions


@pytest.fixture
def orchestrator_server(loop_thread):
    srv = OrchestratorServer(INVENTORY, port=0, actions=RecordingActions(), token="s3cret")
    loop_thread.run(srv.start())
    yield srv
    loop_thread.run(srv.stop())


def test_each_refusal_reason_maps_to_the_client_exception_of_its_name(orchestrator_server):
    target = f"127.0.0.1:{orchestrator_server.port}"
    job = TimeSliceOrchestratorClient(target, job_id="job", group_id="g0", token="s3cret")
    with pytest.raises(UnknownGroup, match="NOT_FOUND"):
        job.acquire(group_id="missing", timeout_sec=1)
    with pytest.raises(NotHolder, match="FAILED_PRECONDITION"):
        job.release()
    job.acquire()  # the sampler group first, then the trainer group: refused by the orchestrator
    with pytest.raises(LockOrderViolation, match="trainer group first"):
        job.acquire(group_id="trainers-only", timeout_sec=1)
    job.release()


def test_unreachable_orchestrator_is_unavailable_without_a_reason():
    job = TimeSliceOrchestratorClient("127.0.0.1:1", job_id="job", group_id="g0", token="s3cret")
    with pytest.raises(OrchestratorUnavailable, match="unreachable"):
        job.acquire(timeout_sec=5)


def test_error_info_round_trips_and_ignores_other_domains_and_garbage():
    code = grpc.StatusCode.FAILED_PRECONDITION
    md = error_info.trailing_metadata(code.value[0], "no", "LOCK_ORDER_VIOLATION", {"group_id": "g0"})
    info = error_info.error_info(md)
    assert info is not None and (info.reason, info.domain, dict(info.metadata)) == (
        "LOCK_ORDER_VIOLATION",
        error_info.DOMAIN,
        {"group_id": "g0"},
    )
    assert error_info.error_info([(error_info.STATUS_DETAILS_KEY, b"\xff\x00garbage")]) is None
    assert error_info.error_info([("x-other", "v")]) is None
    assert error_info.reason_of(LockOrderViolation) == "LOCK_ORDER_VIOLATION"


def test_old_error_names_are_aliases_of_the_one_spelling():
    assert LockOrderError is LockOrderViolation and TimesliceConfigError is TimeSliceConfigError


async def test_the_callers_channel_options_win_over_the_clients_own_retries():
    """``channel_options=[("grpc.enable_retries", 0)]``: one attempt, where the client's own service config retries
    UNAVAILABLE 5 times (it used to put the caller's options after its own, and gRPC takes the first)."""
    from grpc import aio

    from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient

    attempts = []

    class Unavailable(grpc.GenericRpcHandler):
        def service(self, details):
            async def refuse(request, context):
                attempts.append(details.method)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "not the leader")

            return grpc.unary_unary_rpc_method_handler(refuse)

    srv = aio.server()
    srv.add_generic_rpc_handlers((Unavailable(),))
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    client = AsyncTimeSliceOrchestratorClient(
        f"127.0.0.1:{port}", job_id="job", group_id="g0", token="s3cret", channel_options=[("grpc.enable_retries", 0)]
    )
    try:
        with pytest.raises(OrchestratorUnavailable, match="not the leader"):
            await client.acquire(timeout_sec=5)
        assert len(attempts) == 1, attempts
    finally:
        await client.close()
        await srv.stop(None)
