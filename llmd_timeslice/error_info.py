"""Structured error reasons on gRPC statuses (``google.rpc.ErrorInfo`` in ``grpc-status-details-bin``).

The orchestrator's edge attaches to every refusal it produces a ``google.rpc.Status`` whose ``details`` hold one
``google.rpc.ErrorInfo`` (``reason``: UPPER_SNAKE_CASE of the core error's class, e.g. ``LOCK_ORDER_VIOLATION``;
``domain``: :data:`DOMAIN`; ``metadata``: string pairs), serialized into the trailing metadata key
``grpc-status-details-bin`` -- the key and shape of gRPC's richer error model (grpc/grpc
``doc/statuscodes.md``; googleapis/googleapis ``google/rpc/status.proto``, ``google/rpc/error_details.proto``),
so any gRPC client that reads rich statuses understands it. The client maps ``reason`` to its exception of the
same name; no side reads the message text. See ``docs/decisions/one-client-core.md``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]

DOMAIN = "llmd-timeslice.io"
STATUS_DETAILS_KEY = "grpc-status-details-bin"


def reason_of(exc_type: type) -> str:
    """``LockOrderViolation`` -> ``LOCK_ORDER_VIOLATION``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", exc_type.__name__).upper()


def trailing_metadata(code_value: int, message: str, reason: str, metadata: Mapping[str, str] | None = None) -> tuple:
    """Trailing metadata carrying ``google.rpc.Status(code, message, details=[ErrorInfo(reason, DOMAIN, metadata)])``;
    ``code_value`` is the numeric gRPC code (``grpc.StatusCode.X.value[0]``)."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=dict(metadata or {}))
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=code_value, message=message, details=[detail])
    return ((STATUS_DETAILS_KEY, status.SerializeToString()),)


def error_info(trailing: Iterable[tuple[str, object]] | None) -> error_details_pb2.ErrorInfo | None:
    """The :data:`DOMAIN` ``ErrorInfo`` in a call's trailing metadata, or None (none sent, another domain, or
    unparsable bytes -- e.g. a transport failure that never reached the orchestrator)."""
    for key, value in trailing or ():
        if key != STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        status = status_pb2.Status()
        try:
            status.ParseFromString(value)
        except Exception:
            return None
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == DOMAIN:
                return info
    return None
