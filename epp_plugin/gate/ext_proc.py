"""The gate's ext_proc edge: Envoy ``ExternalProcessor`` servicer (headers only).

For gateways that can attach only ext_proc; the default is the fast path (:mod:`epp_plugin.gate.ext_authz`
and :mod:`epp_plugin.gate.access_log`), which answers a request in one HTTP round trip instead of a gRPC
stream per request (docs/gate.md has both side by side).

Per HTTP request Envoy opens one gRPC stream and sends, with the processing mode rendered by
:mod:`epp_plugin.envoy_config`: ``request_headers`` (answered once the request is admitted, i.e.
possibly after a hold) and ``response_headers`` (carrying the ``upstream.address`` attribute,
which names the endpoint that served it; the answer sets ``x-llmd-timeslice-weight-version``, the
weight version of that endpoint, and after a hold ``x-llmd-timeslice-hold-ms``). The stream's end, whatever the reason, ends the
request's in-flight count. This module only translates protobuf messages into calls on
:class:`~epp_plugin.gate.pool_state.PoolState`; it holds no policy.

Drain deadline: each admission gets an ``on_cut`` that answers the request with an ImmediateResponse
(503 ``drain_deadline``) on its still open stream. Envoy accepts an ``immediate_response`` whatever it
is waiting for (``Filter::onReceiveMessage`` in ``source/extensions/filters/http/ext_proc/ext_proc.cc``,
unless ``disable_immediate_response`` is set): it closes the stream, resets the upstream request if one
started, and sends the local reply to the client.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2

from epp_plugin import protocol
from epp_plugin.gate import metrics
from epp_plugin.gate.pool_state import AdmissionRefused, PoolState, UnknownPool
from epp_plugin.gate.refusals import min_weight_version, refusal_body

log = logging.getLogger(__name__)

_CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_CONTINUE = {
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}


@functools.lru_cache(maxsize=256)
def _version_response(version: int) -> pb.ProcessingResponse:
    """Response-headers answer that sets the weight-version header (prebuilt per version)."""
    resp = pb.ProcessingResponse()
    resp.response_headers.response.header_mutation.set_headers.add(
        header=base_pb2.HeaderValue(key=protocol.WEIGHT_VERSION_HEADER, raw_value=str(version).encode())
    )
    return resp


def refusal_response(err: AdmissionRefused) -> pb.ProcessingResponse:
    """ImmediateResponse for a refused request: status, reason header, ``retry-after``, JSON body."""
    headers = [
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=protocol.REASON_HEADER, raw_value=err.reason.encode())),
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")),
    ]
    if err.retry_after_s is not None:
        headers.append(
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="retry-after", raw_value=str(err.retry_after_s).encode()))
        )
    body = refusal_body(err)
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=err.http_status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=body,
            details=err.reason,
        )
    )


class _HintCache:
    """Prebuilt request-headers responses per candidate tuple (the subset hint), so the common case
    allocates nothing. Bounded: cleared when it grows past ``limit`` entries."""

    def __init__(self, limit: int = 4096) -> None:
        self._by_candidates: dict[tuple[str, ...], pb.ProcessingResponse] = {}
        self._limit = limit

    def get(self, candidates: tuple[str, ...]) -> pb.ProcessingResponse:
        resp = self._by_candidates.get(candidates)
        if resp is None:
            if len(self._by_candidates) >= self._limit:
                self._by_candidates.clear()
            resp = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            hint = resp.dynamic_metadata.fields[protocol.SUBSET_HINT_NAMESPACE].struct_value
            hint.fields[protocol.SUBSET_HINT_KEY].list_value.values.add().string_value = candidates[0]
            values = hint.fields[protocol.SUBSET_HINT_KEY].list_value.values
            for addr in candidates[1:]:
                values.add().string_value = addr
            self._by_candidates[candidates] = resp
        return resp


REQUEST_ID_HEADER = "x-request-id"


def _value(h: base_pb2.HeaderValue) -> str:
    # Envoy passes header bytes as they came; a value that is not UTF-8 must not crash the stream
    # (found by tests/test_fuzz.py: b"\x80" in the min-weight-version header).
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value


def _header(headers: pb.HttpHeaders, name: str) -> str | None:
    for h in headers.headers.headers:
        if h.key == name:
            return _value(h)
    return None


def _request_headers_of_interest(headers: pb.HttpHeaders) -> tuple[str | None, str]:
    """``(min weight version header or None, x-request-id or "")`` in one pass over the headers."""
    min_version, request_id = None, ""
    for h in headers.headers.headers:
        if h.key == protocol.MIN_WEIGHT_VERSION_HEADER:
            min_version = _value(h)
        elif h.key == REQUEST_ID_HEADER:
            request_id = _value(h)[:128]
    return min_version, request_id


class _Stream:
    """What the cut of one admitted request needs: the stream's context, and whether the handler is sending."""

    __slots__ = ("_writer", "context", "cut_error", "pool", "sending")

    def __init__(self, context, pool: str) -> None:
        self.context, self.pool = context, pool
        self.sending = False
        self.cut_error: AdmissionRefused | None = None
        self._writer: asyncio.Task | None = None  # kept: the loop holds tasks only weakly

    def cut(self, err: AdmissionRefused) -> None:
        """Answer the admitted request with ``err`` (once). While the handler is itself sending, it writes the
        answer after its own message (two concurrent writes on one stream are not allowed)."""
        if self.cut_error is not None:
            return
        self.cut_error = err
        metrics.REFUSED.labels(pool=self.pool, reason=err.reason).inc()
        log.warning("pool=%s request cut at the drain deadline: %s", self.pool, err.message)
        if not self.sending:
            self._writer = asyncio.get_running_loop().create_task(self._write(err))

    async def _write(self, err: AdmissionRefused) -> None:
        try:
            await self.context.write(refusal_response(err))
        except Exception as exc:  # the stream ended meanwhile: the request is gone already
            log.debug("pool=%s cut answer not written: %r", self.pool, exc)


class GateExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """ext_proc servicer of the time-slice gate.

    Args:
        pools: pool name -> :class:`PoolState` (shared with the control servicer).
        default_pool: pool used when Envoy sends no ``x-llmd-timeslice-pool`` metadata.
    """

    def __init__(self, pools: Mapping[str, PoolState], default_pool: str) -> None:
        self._pools = pools
        self._default_pool = default_pool
        self._hints = _HintCache()

    def _pool_name(self, context) -> str:
        for key, value in context.invocation_metadata() or ():
            if key == protocol.POOL_METADATA_KEY:
                return value
        return self._default_pool

    async def Process(self, request_iterator, context):  # noqa: N802 - gRPC method name
        pool_name = self._pool_name(context)
        pool = self._pools.get(pool_name)
        adm = None
        try:
            async for req in request_iterator:
                which = req.WhichOneof("request")
                if which == "request_headers":
                    if adm is not None:
                        log.warning("pool=%s duplicate request_headers on one stream; ignored", pool_name)
                        yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                        continue
                    try:
                        if pool is None:
                            raise UnknownPool(f"pool {pool_name!r} is not configured on this gate")
                        raw, request_id = _request_headers_of_interest(req.request_headers)
                        min_version = min_weight_version(raw)
                        adm = await pool.admit(min_version)
                    except AdmissionRefused as err:
                        metrics.REFUSED.labels(pool=pool_name, reason=err.reason).inc()
                        yield refusal_response(err)
                        return
                    if adm.hold_s > 0:
                        metrics.HOLD_SECONDS.labels(pool=pool_name).observe(adm.hold_s)
                    stream = _Stream(context, pool_name)
                    adm.request_id, adm.on_cut = request_id, stream.cut
                    stream.sending = True
                    yield self._hints.get(adm.candidates)
                    stream.sending = False
                    if stream.cut_error is not None:  # cut while the subset hint was being sent
                        yield refusal_response(stream.cut_error)
                elif which == "response_headers":
                    if adm is None:
                        yield _CONTINUE_RESPONSE_HEADERS
                        continue
                    version = None
                    attrs = req.attributes.get(protocol.EXT_PROC_ATTRIBUTES_NAMESPACE)
                    if attrs is not None:
                        served = attrs.fields.get(protocol.UPSTREAM_ADDRESS_ATTRIBUTE)
                        if served is not None and served.string_value:
                            version = pool.on_served(adm, served.string_value)
                    if adm.hold_s > 0:
                        resp = pb.ProcessingResponse()
                        hdrs = resp.response_headers.response.header_mutation.set_headers
                        hdrs.add(
                            header=base_pb2.HeaderValue(
                                key=protocol.HOLD_MS_HEADER, raw_value=str(round(adm.hold_s * 1000)).encode()
                            )
                        )
                        if version is not None:
                            hdrs.add(
                                header=base_pb2.HeaderValue(key=protocol.WEIGHT_VERSION_HEADER, raw_value=str(version).encode())
                            )
                        yield resp
                    elif version is not None:
                        yield _version_response(version)
                    else:
                        yield _CONTINUE_RESPONSE_HEADERS
                elif which in _CONTINUE:
                    yield _CONTINUE[which]
        finally:
            if adm is not None:
                pool.finish(adm)
