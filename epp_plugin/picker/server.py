"""An EPP-protocol endpoint picker (ext_proc) for set-ups without the llm-d router's EPP.

EPP protocol (Gateway API Inference Extension, proposal 004): when the request carries a subset
hint (dynamic metadata ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``,
forwarded by Envoy through the filter's ``metadata_options.forwarding_namespaces``), the picker
chooses only among those endpoints. It answers with request header
``x-gateway-destination-endpoint: ip:port`` (read by the ORIGINAL_DST cluster) and the same value
in dynamic metadata ``envoy.lb``. When no endpoint is eligible it answers 503 itself.

Selection is round-robin over the eligible endpoints of the pool, in configuration order (the ``round_robin``
endpoint pick of :mod:`epp_plugin.endpoint_pick`, one per pool).
"""

from __future__ import annotations

import asyncio
import json
import logging

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter

from epp_plugin.endpoint_pick import ENDPOINT_PICKS
from llmd_timeslice import protocol
from llmd_timeslice.config import PickerSettings
from llmd_timeslice.grpc_server import SERVER_OPTIONS

log = logging.getLogger(__name__)

PICKED = Counter("llmd_timeslice_picker_picked_total", "Requests routed, by pool and endpoint.", ["pool", "endpoint"])
NO_ENDPOINT = Counter("llmd_timeslice_picker_no_endpoint_total", "Requests answered 503: nothing eligible.", ["pool"])


PickerConfig = PickerSettings
"""Configuration of the picker (:class:`~llmd_timeslice.config.PickerSettings`): the endpoints (``ip:port``) of each
InferencePool, its bind address and port."""


def _no_endpoint(pool: str, why: str) -> pb.ProcessingResponse:
    body = json.dumps({"error": {"type": "no_eligible_endpoint", "message": why}}).encode()
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=503),
            headers=pb.HeaderMutation(
                set_headers=[
                    base_pb2.HeaderValueOption(
                        header=base_pb2.HeaderValue(key=protocol.REASON_HEADER, raw_value=b"no_eligible_endpoint")
                    ),
                    base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")),
                ]
            ),
            body=body,
            details="no_eligible_endpoint",
        )
    )


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    """ext_proc servicer implementing the EPP protocol's endpoint choice."""

    def __init__(self, config: PickerConfig) -> None:
        self.config = config
        self._picks = {name: ENDPOINT_PICKS.create("round_robin") for name in config.pools}
        self._responses: dict[str, pb.ProcessingResponse] = {}

    def _response_for(self, endpoint: str) -> pb.ProcessingResponse:
        resp = self._responses.get(endpoint)
        if resp is None:
            resp = pb.ProcessingResponse()
            resp.request_headers.response.header_mutation.set_headers.add(
                header=base_pb2.HeaderValue(key=protocol.DESTINATION_HEADER, raw_value=endpoint.encode())
            )
            ns = resp.dynamic_metadata.fields[protocol.DESTINATION_NAMESPACE].struct_value
            ns.fields[protocol.DESTINATION_HEADER].string_value = endpoint
            self._responses[endpoint] = resp
        return resp

    def pick(self, pool: str, subset: list[str] | None) -> str | None:
        """Endpoint for one request of ``pool``, honouring ``subset`` when given; None if none is eligible."""
        endpoints = self.config.pools.get(pool, [])
        eligible = endpoints if subset is None else [e for e in endpoints if e in subset]
        if not eligible:
            return None
        return self._picks[pool].pick(eligible)

    async def Process(self, request_iterator, context):  # noqa: N802
        pool = self.config.default_pool
        for key, value in context.invocation_metadata() or ():
            if key == protocol.POOL_METADATA_KEY:
                pool = value
        async for req in request_iterator:
            which = req.WhichOneof("request")
            if which != "request_headers":
                # Only request headers are configured; answer anything else so Envoy continues.
                resp = pb.ProcessingResponse()
                getattr(resp, which).SetInParent()
                yield resp
                continue
            subset = None
            hint = req.metadata_context.filter_metadata.get(protocol.SUBSET_HINT_NAMESPACE)
            if hint is not None and protocol.SUBSET_HINT_KEY in hint.fields:
                subset = [v.string_value for v in hint.fields[protocol.SUBSET_HINT_KEY].list_value.values]
            if pool not in self.config.pools:
                NO_ENDPOINT.labels(pool=pool).inc()
                yield _no_endpoint(pool, f"pool {pool!r} is not configured on this picker")
                return
            endpoint = self.pick(pool, subset)
            if endpoint is None:
                NO_ENDPOINT.labels(pool=pool).inc()
                yield _no_endpoint(pool, f"no endpoint of pool {pool!r} is in the subset hint {subset}")
                return
            PICKED.labels(pool=pool, endpoint=endpoint).inc()
            yield self._response_for(endpoint)


class PickerServer:
    """The picker's gRPC server in this event loop."""

    def __init__(self, config: PickerConfig) -> None:
        self.config = config
        self.port = config.port
        self._server: aio.Server | None = None

    async def start(self) -> None:
        self._server = aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(self.config), self._server)
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, self._server)
        self.port = self._server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        await self._server.start()
        await hs.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("picker ext_proc=%s:%d pools=%s", self.config.host, self.port, self.config.pools)

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)


async def serve(config: PickerConfig) -> None:
    """Run the picker until cancelled."""
    server = PickerServer(config)
    await server.start()
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()
