"""What both edges say when they refuse a request: status, reason, ``retry-after`` and a JSON body.

The typed refusals are the core's (:class:`~epp_plugin.gate.pool_state.AdmissionRefused` and its
subclasses); this adds the one refusal that is about the request itself, not the pool.
"""

from __future__ import annotations

import json

from epp_plugin.gate.pool_state import AdmissionRefused
from llmd_timeslice import protocol


class BadMinWeightVersion(AdmissionRefused):
    """The ``x-llmd-timeslice-min-weight-version`` header is not an integer (HTTP 400)."""

    http_status = 400
    reason = "bad_min_weight_version"


class BadCheck(AdmissionRefused):
    """An ext_authz check without the headers the rendered Envoy config adds (not from Envoy; HTTP 400)."""

    http_status = 400
    reason = "bad_check"


def min_weight_version(raw: str | None) -> int:
    """The request's minimum weight version (0 without the header).

    Raises:
        BadMinWeightVersion: the value is not an integer (quoted, cut to 64 characters, in the message).
    """
    if raw is None:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise BadMinWeightVersion(f"{protocol.MIN_WEIGHT_VERSION_HEADER} must be an integer, got {raw[:64]!r}") from None


def refusal_body(err: AdmissionRefused) -> bytes:
    """JSON body of a refusal: ``{"error": {"type": reason, "message": ...}}``."""
    return json.dumps({"error": {"type": err.reason, "message": err.message}}).encode()
