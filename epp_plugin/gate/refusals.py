"""What both edges say when they refuse a request: the typed refusals (status, reason, ``retry-after``) and their
JSON body.

The core (:mod:`epp_plugin.gate.pool_state`) raises the refusals about the pool (a full queue, an expired hold, a
drain deadline, ...); the edges add the ones about the request itself (a bad header, a bad check).
"""

from __future__ import annotations

import json

from llmd_timeslice import protocol


class AdmissionRefused(Exception):
    """Base of the typed refusals; ``http_status`` and ``reason`` go to the client."""

    http_status = 503
    reason = "refused"
    retry_after_s: int | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class QueueFull(AdmissionRefused):
    """The pool already holds ``max_held`` requests (HTTP 429)."""

    http_status = 429
    reason = "hold_queue_full"
    retry_after_s = 1


class HoldExpired(AdmissionRefused):
    """The request waited ``max_hold_s`` without a SERVING endpoint (HTTP 503)."""

    http_status = 503
    reason = "hold_expired"
    retry_after_s = 5


class SheddableWhileAsleep(AdmissionRefused):
    """A sheddable request (its objective's priority < 0) while the pool has no SERVING endpoint: refused at once
    rather than held (HTTP 503, retryable once the pool serves again)."""

    http_status = 503
    reason = "sheddable_while_asleep"
    retry_after_s = 5


class UnknownObjective(AdmissionRefused):
    """The request names an InferenceObjective this gate does not know for its pool (HTTP 400)."""

    http_status = 400
    reason = "unknown_objective"


class UnknownPool(AdmissionRefused):
    """The request names a pool this gate does not know (HTTP 503, a configuration error)."""

    http_status = 503
    reason = "unknown_pool"


class DrainDeadline(AdmissionRefused):
    """The drain deadline passed while the request could still reach a draining endpoint and its response had
    not started (HTTP 503, retryable: a retry is admitted to a serving endpoint or held)."""

    http_status = 503
    reason = "drain_deadline"
    retry_after_s = 1


class WeightVersionUnavailable(AdmissionRefused):
    """The request asks for a weight version above the newest the pool has, and none can come now: no job holds or
    waits for the pool's group and none is pending (the orchestrator's ``weights_final``). HTTP 503, refused at once
    rather than held to the longest hold (issue 38 §5)."""

    http_status = 503
    reason = "weight_version_unavailable"


class GateShuttingDown(AdmissionRefused):
    """The gate is stopping; held requests are refused rather than left hanging (HTTP 503)."""

    http_status = 503
    reason = "gate_shutting_down"
    retry_after_s = 1


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
