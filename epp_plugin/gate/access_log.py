"""The gate's fast-path completion edge: Envoy's gRPC access-log service (``AccessLogService``).

Envoy (configured by :func:`llmd_timeslice.router.envoy_config.gate_access_log` and
:func:`~llmd_timeslice.router.envoy_config.gate_upstream_log`, which share one log configuration) keeps one client stream
per worker open to the gate's gRPC data-plane port and sends its entries in batches (every
``buffer_flush_interval``, 20 ms as rendered, or 64 KiB). Each entry logs the request header
``x-llmd-timeslice-admission`` that the ext_authz answer put on the request, which names the admission. By
``common_properties.access_log_type``:

* ``DownstreamEnd`` (the request's stream ended: response done, reset, or client gone):
  :meth:`AdmissionBook.complete` — the in-flight count ends here;
* ``UpstreamPoolReady`` (an upstream stream got a connection): :meth:`AdmissionBook.served` with
  ``upstream_remote_address`` — the request counts only against that endpoint from then on, as on the ext_proc
  edge's response path;
* any entry flagged ``upstream_connection_failure`` (a refused connection; the router's upstream log writes one
  ``UpstreamEnd`` entry per failed attempt): ``on_failed`` — the gate stops steering to that endpoint and tells
  the orchestrator (docs/gate.md, "When an engine dies").

Fact this relies on (Envoy 1.40, measured here): both entry kinds carry the logged request header; a
``DownstreamEnd`` entry is written after the downstream stream is done, so nothing of the request reaches
an engine after it. A stream's end (Envoy stopped or gone) is reported to the book, which drops that
Envoy's admissions when none of its streams comes back (see :mod:`epp_plugin.gate.admissions`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from epp_plugin.gate.admissions import AdmissionBook
from epp_plugin.gate.pool_state import PoolState
from llmd_timeslice import protocol

log = logging.getLogger(__name__)

_END = accesslog_pb2.DownstreamEnd
_UPSTREAM_READY = accesslog_pb2.UpstreamPoolReady
_NOT_SET = accesslog_pb2.NotSet  # an Envoy that does not say: an end (the HCM's access log writes one per stream)
_ADMISSION = protocol.ADMISSION_HEADER
_EMPTY = als_pb2.StreamAccessLogsResponse()


def endpoint_of(entry) -> str | None:
    """``ip:port`` of ``common_properties.upstream_remote_address``, or None when the request had no upstream."""
    sock = entry.common_properties.upstream_remote_address.socket_address
    return f"{sock.address}:{sock.port_value}" if sock.address else None


def failure_reason(entry) -> str:
    """What an entry says about a failed upstream connection, for logs and the orchestrator."""
    why = entry.common_properties.upstream_transport_failure_reason
    return f"upstream connection failure (UF){': ' + why if why else ''}"


class GateAccessLogService(als_pb2_grpc.AccessLogServiceServicer):
    """``envoy.service.accesslog.v3.AccessLogService`` of the gate: completions for the fast path's admissions.

    Args:
        book: the fast path's open admissions.
        on_failed: called with ``(pool, address, reason)`` for an entry whose ``common_properties.response_flags``
            has ``upstream_connection_failure`` (Envoy's ``UF``: the connection to ``upstream_remote_address`` was
            refused or timed out; Envoy 1.40 ``envoy/data/accesslog/v3/accesslog.proto``, ``ResponseFlags``). The
            router's upstream log writes one entry per failed attempt (``UpstreamEnd``), so a failure is seen
            even when a retry on another endpoint served the request.
    """

    def __init__(self, book: AdmissionBook, on_failed: Callable[[PoolState, str, str], None] | None = None) -> None:
        self._book = book
        self._on_failed = on_failed
        self.entries_total = 0
        self.messages_total = 0
        self.unmatched_total = 0
        self.streams_open = 0

    async def StreamAccessLogs(self, request_iterator, context):  # noqa: N802 - gRPC method name
        book = self._book
        envoy: str | None = None  # the Envoy this stream belongs to, learnt from its first entry of a known admission
        self.streams_open += 1
        try:
            async for msg in request_iterator:
                entries = msg.http_logs.log_entry
                self.messages_total += 1
                self.entries_total += len(entries)
                for entry in entries:
                    aid = entry.request.request_headers.get(_ADMISSION)
                    if aid is None:
                        continue  # not admitted by a gate (refused, or a route without the gate)
                    if envoy is None:
                        envoy = book.envoy_of(aid)
                        if envoy is not None:
                            book.stream_tied(envoy)
                    common = entry.common_properties
                    if common.response_flags.upstream_connection_failure and self._on_failed is not None:
                        addr = endpoint_of(entry)
                        pool = book.pool_of(aid)
                        if addr is not None and pool is not None:
                            self._on_failed(pool, addr, failure_reason(entry))
                    kind = common.access_log_type
                    if kind in (_END, _NOT_SET):
                        if not book.complete(aid):
                            self.unmatched_total += 1
                    elif kind == _UPSTREAM_READY:
                        addr = endpoint_of(entry)
                        if addr is not None:
                            book.served(aid, addr)
        finally:
            self.streams_open -= 1
            if envoy is not None:
                book.stream_ended(envoy)
        return _EMPTY
