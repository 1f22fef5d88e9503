"""Crashes the fuzz tests found (tests/test_fuzz.py), each kept as a named test against the real gate."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as xp
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as xp_grpc

from epp_plugin.gate.pool_state import EndpointState
from epp_plugin.gate.server import GateConfig, GateServer
from llmd_timeslice import protocol


async def test_min_weight_version_header_that_is_not_utf8_gets_400_not_a_crash():
    """Fuzz find: ``x-llmd-timeslice-min-weight-version: \\x80`` raised UnicodeDecodeError in the servicer
    (the stream ended UNKNOWN, Envoy answered 503 status_on_error). Now: 400 ``bad_min_weight_version``."""
    gate = GateServer(GateConfig(ext_proc_port=0, control_port=0))
    await gate.start()
    gate.pools["default"].set_states([("10.0.0.1:8000", EndpointState.SERVING, 0)])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gate.ext_proc_port}") as ch:
            hdrs = base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=protocol.MIN_WEIGHT_VERSION_HEADER, raw_value=b"\x80\xff")]
            )
            call = xp_grpc.ExternalProcessorStub(ch).Process(
                iter([xp.ProcessingRequest(request_headers=xp.HttpHeaders(headers=hdrs))]), timeout=5
            )
            out = [r async for r in call]
        assert out[0].immediate_response.status.code == 400
        assert out[0].immediate_response.details == "bad_min_weight_version"
        assert gate.pools["default"].live == 0
    finally:
        await gate.stop()


def _hdrs(*pairs: tuple[str, bytes]) -> xp.HttpHeaders:
    return xp.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in pairs]))


REQ = xp.ProcessingRequest(request_headers=_hdrs((":path", b"/v1/completions")))
RESP = xp.ProcessingRequest(response_headers=_hdrs((":status", b"200")))

OUT_OF_PHASE = {
    # name: (messages, answers before the error, status code, what the details name)
    "second_request_headers": ([REQ, REQ], 1, grpc.StatusCode.FAILED_PRECONDITION, "request_headers in stream phase ADMITTED"),
    "response_headers_without_admission": (
        [RESP],
        0,
        grpc.StatusCode.FAILED_PRECONDITION,
        "response_headers in stream phase NEW",
    ),
    "second_response_headers": ([REQ, RESP, RESP], 2, grpc.StatusCode.FAILED_PRECONDITION, "in stream phase RESPONDING"),
    "response_trailers_before_response_headers": (
        [REQ, xp.ProcessingRequest(response_trailers=xp.HttpTrailers())],
        1,
        grpc.StatusCode.FAILED_PRECONDITION,
        "response_trailers in stream phase ADMITTED",
    ),
    "request_body_before_request_headers": (
        [xp.ProcessingRequest(request_body=xp.HttpBody(body=b"{}"))],
        0,
        grpc.StatusCode.FAILED_PRECONDITION,
        "request_body in stream phase NEW",
    ),
    "message_with_nothing_set": ([REQ, xp.ProcessingRequest()], 1, grpc.StatusCode.INVALID_ARGUMENT, "no message set"),
}


@pytest.mark.parametrize("name", sorted(OUT_OF_PHASE))
async def test_ext_proc_message_out_of_phase_ends_the_stream_with_a_named_error_and_releases_the_admission(name):
    """Envoy sends request_headers once per stream, then response_headers once after the request was answered
    (and refuses a processor's answers out of turn the same way: processor_state.cc, "spurious message"). Any
    other order ends the stream with a gRPC error whose details start ``out_of_phase:`` and name the message and
    the phase; the request's admission is released (nothing stays in flight)."""
    msgs, answered, code, names = OUT_OF_PHASE[name]
    gate = GateServer(GateConfig(ext_proc_port=0, control_port=0))
    await gate.start()
    pool = gate.pools["default"]
    pool.set_states([("10.0.0.1:8000", EndpointState.SERVING, 0)])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gate.ext_proc_port}") as ch:
            call = xp_grpc.ExternalProcessorStub(ch).Process(iter(msgs), timeout=5)
            out = []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for r in call:
                    out.append(r)
        assert len(out) == answered, out
        assert info.value.code() == code
        assert info.value.details().startswith("out_of_phase: ") and names in info.value.details()
        for _ in range(100):  # the stream's end releases the admission on the server's side
            if pool.live == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.live == 0 and pool.held == 0
    finally:
        await gate.stop()
