"""The gate's fast-path completion edge: Envoy's gRPC access-log service (``AccessLogService``).

Envoy (configured by :func:`epp_plugin.envoy_config.gate_access_log` and
:func:`~epp_plugin.envoy_config.gate_upstream_log`, which share one log configuration) keeps one client stream
per worker open to the gate's gRPC data-plane port and sends its entries in batches (every
``buffer_flush_interval``, 20 ms as rendered, or 64 KiB). Each entry logs the request header
``x-llmd-timeslice-admission`` that the ext_authz answer put on the request, which names the admission. By
``common_properties.access_log_type``:

* ``DownstreamEnd`` (the request's stream ended: response done, reset, or client gone):
  :meth:`AdmissionBook.complete` — the in-flight count ends here;
* ``UpstreamPoolReady`` (an upstream stream got a connection; rendered only when an EPP picks the endpoint):
  :meth:`AdmissionBook.served` with ``upstream_remote_address`` — the request counts only against that
  endpoint from then on, as on the ext_proc edge's response path.

Fact this relies on (Envoy 1.40, measured here): both entry kinds carry the logged request header; a
``DownstreamEnd`` entry is written after the downstream stream is done, so nothing of the request reaches
an engine after it. A stream's end (Envoy stopped or gone) is reported to the book, which drops that
Envoy's admissions when none of its streams comes back (see :mod:`epp_plugin.gate.admissions`).
"""

from __future__ import annotations

import logging

from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from epp_plugin import protocol
from epp_plugin.gate.admissions import AdmissionBook

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


class GateAccessLogService(als_pb2_grpc.AccessLogServiceServicer):
    """``envoy.service.accesslog.v3.AccessLogService`` of the gate: completions for the fast path's admissions."""

    def __init__(self, book: AdmissionBook) -> None:
        self._book = book
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
                    kind = entry.common_properties.access_log_type
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
