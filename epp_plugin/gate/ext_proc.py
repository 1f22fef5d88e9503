"""The gate's ext_proc edge: Envoy ``ExternalProcessor`` servicer (headers only).

For gateways that can attach only ext_proc; the default is the fast path (:mod:`epp_plugin.gate.ext_authz`
and :mod:`epp_plugin.gate.access_log`), which answers a request in one HTTP round trip instead of a gRPC
stream per request (docs/gate.md has both side by side).

Per HTTP request Envoy opens one gRPC stream and sends, with the processing mode rendered by
:mod:`llmd_timeslice.router.envoy_config`: ``request_headers`` (answered once the request is admitted, i.e.
possibly after a hold) and ``response_headers`` (carrying the ``upstream.address`` attribute,
which names the endpoint that served it; the answer sets ``x-llmd-timeslice-weight-version``, the
weight version of that endpoint, and after a hold ``x-llmd-timeslice-hold-ms``). The stream's end, whatever the reason, ends the
request's in-flight count. This module only translates protobuf messages into calls on
:class:`~epp_plugin.gate.pool_state.PoolState`; it holds no policy.

Each stream's state is one :class:`_Stream` (phase :class:`StreamPhase`, admission, cut): a message its phase
does not take (a second ``request_headers``, ``response_headers`` before an admission, a message with nothing
set) ends the stream with a gRPC error naming it (:class:`OutOfPhaseMessage`, ``out_of_phase: ...``) and
releases the admission, as Envoy's own filter drops a processor that answers out of turn (docs/architecture.md,
the ext_proc edge; docs/decisions/ext-proc-out-of-phase.md).

Drain deadline: each admission gets an ``on_cut`` that answers the request with an ImmediateResponse
(503 ``drain_deadline``) on its still open stream. Envoy accepts an ``immediate_response`` whatever it
is waiting for (``Filter::onReceiveMessage`` in ``source/extensions/filters/http/ext_proc/ext_proc.cc``,
unless ``disable_immediate_response`` is set): it closes the stream, resets the upstream request if one
started, and sends the local reply to the client.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
from collections.abc import Mapping

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2

from epp_plugin.gate import metrics
from epp_plugin.gate.pool_state import Admission, AdmissionRefused, PoolState, UnknownPool
from epp_plugin.gate.refusals import min_weight_version, refusal_body
from llmd_timeslice import protocol

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


def _request_headers_of_interest(headers: pb.HttpHeaders) -> tuple[str | None, str, str | None]:
    """``(min weight version header or None, x-request-id or "", InferenceObjective header or None)`` in one pass
    over the headers."""
    min_version, request_id, objective = None, "", None
    for h in headers.headers.headers:
        if h.key == protocol.MIN_WEIGHT_VERSION_HEADER:
            min_version = _value(h)
        elif h.key == REQUEST_ID_HEADER:
            request_id = _value(h)[:128]
        elif h.key == protocol.OBJECTIVE_HEADER:
            objective = _value(h)
    return min_version, request_id, objective


class StreamPhase(enum.Enum):
    """Where one ext_proc stream is. Envoy sends, per HTTP request, ``request_headers`` once, then (once the
    request was answered) request body/trailers if configured, then ``response_headers`` once, then response
    body/trailers; the gate renders headers SEND, response trailers SEND, bodies NONE."""

    NEW = "new"
    """No request headers yet."""
    ADMITTED = "admitted"
    """The request was admitted (answered with the subset hint): it counts in flight."""
    RESPONDING = "responding"
    """Response headers seen: the served endpoint is known."""
    CUT = "cut"
    """Answered with an immediate response at the drain deadline: Envoy closes the stream; what it had
    already sent is dropped unanswered (Envoy ignores the stream once it took an immediate response)."""


_ACCEPTED: dict[StreamPhase, frozenset[str]] = {
    StreamPhase.NEW: frozenset({"request_headers"}),
    StreamPhase.ADMITTED: frozenset({"request_body", "request_trailers", "response_headers"}),
    StreamPhase.RESPONDING: frozenset({"request_body", "request_trailers", "response_body", "response_trailers"}),
}
"""Messages each phase takes; any other one is :class:`OutOfPhaseMessage`."""


class OutOfPhaseMessage(Exception):
    """A message the stream's phase does not take: a second ``request_headers``, ``response_headers`` before
    the request was admitted, a body or trailers of a side whose headers were not seen, or a message with no
    field set. The stream ends with FAILED_PRECONDITION (INVALID_ARGUMENT for an empty message) and details
    ``out_of_phase: ...``; the request's admission, if any, is released.

    The mirror of what Envoy does on its side (envoyproxy/envoy
    ``source/extensions/filters/http/ext_proc/processor_state.cc``, ``ProcessorState::handleHeadersResponse``
    / ``handleBodyResponse`` / ``handleTrailersResponse``: a response the filter is not waiting for is
    ``FailedPrecondition("spurious message")``; ``ext_proc.cc``, ``Filter::onReceiveMessage``: it counts
    ``spurious_msgs_received``, closes the stream and ignores the processor for the rest of the request)."""

    reason = "out_of_phase"

    def __init__(self, message: str, phase: StreamPhase) -> None:
        self.message, self.phase = message, phase
        self.code = grpc.StatusCode.INVALID_ARGUMENT if message == "none" else grpc.StatusCode.FAILED_PRECONDITION
        accepted = ", ".join(sorted(_ACCEPTED.get(phase, ())))
        what = "a ProcessingRequest with no message set" if message == "none" else message
        super().__init__(
            f"{self.reason}: {what} in stream phase {phase.name} (accepted there: {accepted or 'nothing'}); "
            "Envoy sends request_headers once per stream, then response_headers once after the request was answered"
        )


class _Stream:
    """The state of one ext_proc stream (one HTTP request): its phase, its admission, and what the cut of the
    admitted request needs (the stream's context, whether the handler is sending)."""

    __slots__ = ("_writer", "adm", "context", "cut_error", "phase", "pool", "sending")

    def __init__(self, context, pool: str) -> None:
        self.context, self.pool = context, pool
        self.phase = StreamPhase.NEW
        self.adm: Admission | None = None
        self.sending = False
        self.cut_error: AdmissionRefused | None = None
        self._writer: asyncio.Task | None = None  # kept: the loop holds tasks only weakly

    def take(self, message: str) -> bool:
        """Check that the phase takes ``message`` (the ``ProcessingRequest`` oneof name, ``"none"`` if unset):
        True to handle it, False to drop it unanswered (the request was cut); raises :class:`OutOfPhaseMessage`."""
        if self.phase is StreamPhase.CUT:
            return False
        if message not in _ACCEPTED[self.phase]:
            raise OutOfPhaseMessage(message, self.phase)
        return True

    def admitted(self, adm: Admission) -> None:
        self.adm, self.phase = adm, StreamPhase.ADMITTED
        adm.on_cut = self.cut

    def cut(self, err: AdmissionRefused) -> None:
        """Answer the admitted request with ``err`` (once). While the handler is itself sending, it writes the
        answer after its own message (two concurrent writes on one stream are not allowed)."""
        if self.cut_error is not None:
            return
        self.cut_error = err
        self.phase = StreamPhase.CUT
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
        self.open_streams = 0
        self._none_open = asyncio.Event()
        self._none_open.set()

    async def wait_streams_done(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for every open ext_proc stream (one per HTTP request, see the module
        docstring) to end. Returns whether none is open."""
        try:
            await asyncio.wait_for(self._none_open.wait(), timeout_s)
        except TimeoutError:
            pass
        return self.open_streams == 0

    def _pool_name(self, context) -> str:
        for key, value in context.invocation_metadata() or ():
            if key == protocol.POOL_METADATA_KEY:
                return value
        return self._default_pool

    async def Process(self, request_iterator, context):  # noqa: N802 - gRPC method name
        pool_name = self._pool_name(context)
        pool = self._pools.get(pool_name)
        st = _Stream(context, pool_name)
        self.open_streams += 1
        self._none_open.clear()
        try:
            async for req in request_iterator:
                which = req.WhichOneof("request") or "none"
                if not st.take(which):
                    log.debug("pool=%s %s after the cut: dropped", pool_name, which)
                    continue
                if which == "request_headers":
                    try:
                        if pool is None:
                            raise UnknownPool(f"pool {pool_name!r} is not configured on this gate")
                        raw, request_id, objective_raw = _request_headers_of_interest(req.request_headers)
                        min_version = min_weight_version(raw)
                        objective = pool.objective(objective_raw) if objective_raw is not None else None
                        adm = await pool.admit(min_version, objective)
                    except AdmissionRefused as err:
                        metrics.REFUSED.labels(pool=pool_name, reason=err.reason).inc()
                        yield refusal_response(err)
                        return
                    if adm.hold_s > 0:
                        metrics.observe_hold(pool_name, adm)
                    adm.request_id = request_id
                    st.admitted(adm)
                    st.sending = True
                    yield self._hints.get(adm.candidates)
                    st.sending = False
                    if st.cut_error is not None:  # cut while the subset hint was being sent
                        yield refusal_response(st.cut_error)
                elif which == "response_headers":
                    adm = st.adm
                    assert adm is not None and pool is not None  # ADMITTED: request_headers admitted it
                    st.phase = StreamPhase.RESPONDING
                    yield self._response_headers_answer(pool, adm, req)
                else:
                    yield _CONTINUE[which]
        except OutOfPhaseMessage as err:
            metrics.EXT_PROC_OUT_OF_PHASE.labels(pool=pool_name, message=err.message).inc()
            log.warning("pool=%s ext_proc stream refused: %s", pool_name, err)
            await context.abort(err.code, str(err))
        finally:
            self.open_streams -= 1
            if self.open_streams == 0:
                self._none_open.set()
            if st.adm is not None and pool is not None:  # an admission implies its pool
                pool.finish(st.adm)

    @staticmethod
    def _response_headers_answer(pool: PoolState, adm: Admission, req: pb.ProcessingRequest) -> pb.ProcessingResponse:
        """``upstream.address`` names the endpoint that served the request (it now counts against that one);
        the answer sets its weight version and, after a hold, the hold time."""
        version = None
        attrs = req.attributes.get(protocol.EXT_PROC_ATTRIBUTES_NAMESPACE)
        if attrs is not None:
            served = attrs.fields.get(protocol.UPSTREAM_ADDRESS_ATTRIBUTE)
            if served is not None and served.string_value:
                version = pool.on_served(adm, served.string_value)
        if adm.hold_s > 0:
            resp = pb.ProcessingResponse()
            hdrs = resp.response_headers.response.header_mutation.set_headers
            hdrs.add(header=base_pb2.HeaderValue(key=protocol.HOLD_MS_HEADER, raw_value=str(round(adm.hold_s * 1000)).encode()))
            if version is not None:
                hdrs.add(header=base_pb2.HeaderValue(key=protocol.WEIGHT_VERSION_HEADER, raw_value=str(version).encode()))
            return resp
        if version is not None:
            return _version_response(version)
        return _CONTINUE_RESPONSE_HEADERS
