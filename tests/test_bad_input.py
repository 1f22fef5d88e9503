"""Crashes the fuzz tests found (tests/test_fuzz.py), each kept as a named test against the real gate."""

from __future__ import annotations

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as xp
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as xp_grpc

from epp_plugin import protocol
from epp_plugin.gate.pool_state import EndpointState
from epp_plugin.gate.server import GateConfig, GateServer


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
