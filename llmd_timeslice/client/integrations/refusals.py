"""Who refused a request on the way through the router, and why: the gate's refusals and the llm-d EPP's.

Two vocabularies reach a client:

* **The gate's** (docs/gate.md, "Refusals"): ``x-llmd-timeslice-reason`` (``hold_expired``, ``hold_queue_full``, ...).
  On the fast path a 5xx refusal travels as 429 + ``x-llmd-timeslice-status: 503`` and Envoy's local-reply mapping
  restores the 503; where that mapping is missing the client sees the 429, and the status header keeps the meaning
  (:attr:`Refusal.status` is the restored one). The gate's header wins over anything else on the answer.
* **The EPP's** (llm-d/llm-d-router ``pkg/common/error/error.go``: the ``x-llm-d-request-dropped-reason`` header
  of an Envoy immediate response, body ``inference error: <Code> - <message>``, plain text). What each reason means
  and which status carries it, by version (llm-d-router ``pkg/epp/requestcontrol/admission.go``,
  ``translateFlowControlOutcome``; ``director.go``; ``scheduling/scheduler_profile.go``):

  ==========================  ======================================================================================
  ``rejected-ttl-expired``    flow control's queue-wait TTL ran out. v0.9.0 (5f4e762f341a): 503. From v0.10.0
                              (#2047, 6f11c95a945b): 429 while the pool has endpoints (backpressure).
  ``rejected-no-endpoints``   no endpoint to serve (from v0.10.0: a TTL eviction of an empty pool, 503; on main
                              after v0.10.0 also an empty candidate set or screeners leaving none, 503, #2462
                              645ba71ef15a, and the ``noEndpointRequestTTL`` budget running out, 503, #2284).
  ``rejected-saturated``      flow control's capacity limit (429, every version); on main after v0.10.0 also
                              scheduling filters that leave no candidate (429, #2462; before: a 429 without the
                              header).
  ``rejected-shutting-down``  the EPP's flow controller is stopping (503).
  ``rejected-context-cancelled`` the client went away (503).
  ``evicted``, ``evicted-*``  a dispatched request killed by flow control (429, body ``request evicted by flow
                              control``: ``pkg/epp/handlers/server.go``); not repeated (it may have generated).
  ==========================  ======================================================================================

The rollout helper (:mod:`~llmd_timeslice.client.integrations.rollouts`) repeats, with back-off and within the
caller's budget, the EPP answers that mean "wait": a queue TTL that ran out (the pool is busy or every sampler
sleeps through a training phase), an empty pool, a stopping EPP. Any other EPP answer (``rejected-saturated``: the
router sheds load now, an unknown reason) is a typed refusal returned to the caller at once, never repeated blindly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import httpx

from llmd_timeslice.protocol import REASON_HEADER, STATUS_HEADER

DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
"""The EPP's response header naming why it dropped a request (llm-d-router ``RequestDroppedReasonHeaderKey``)."""

TTL_EXPIRED = "rejected-ttl-expired"
NO_ENDPOINTS = "rejected-no-endpoints"
SATURATED = "rejected-saturated"
SHUTTING_DOWN = "rejected-shutting-down"
CONTEXT_CANCELLED = "rejected-context-cancelled"
EVICTED = ("evicted", "evicted-queue-pressure", "evicted-priority")

ROUTER_RETRYABLE_REASONS = frozenset({TTL_EXPIRED, NO_ENDPOINTS, SHUTTING_DOWN})
"""EPP answers the rollout helper repeats with back-off: the request waited its queue budget out (429 from v0.10.0,
503 before), the pool had no endpoint (all asleep: a training phase), or the EPP is stopping."""
ROUTER_KNOWN_REASONS = ROUTER_RETRYABLE_REASONS | {SATURATED, CONTEXT_CANCELLED, *EVICTED}


@dataclass(frozen=True)
class Refusal:
    """A refused answer. ``source``: ``gate`` (``x-llmd-timeslice-reason``) or ``router`` (the EPP's
    ``x-llm-d-request-dropped-reason``); ``status``: the HTTP status it means (a gate 429 carrying
    ``x-llmd-timeslice-status`` means that status); ``message``: the answer's body, at most 500 characters."""

    source: Literal["gate", "router"]
    reason: str
    status: int
    message: str = ""

    def __str__(self) -> str:
        return f"{self.source} refused with {self.status} {self.reason}" + (f": {self.message}" if self.message else "")


def _meant_status(response: httpx.Response) -> int:
    try:
        status = int(response.headers.get(STATUS_HEADER, ""))
    except ValueError:
        return response.status_code
    return status if 400 <= status <= 599 else response.status_code


def refusal_of(response: httpx.Response, read_body: bool = False) -> Refusal | None:
    """The refusal ``response`` is, or None (an answer neither the gate nor the EPP refused: a success, an engine's
    own error, a 429/503 with neither header). ``read_body``: fill :attr:`Refusal.message` (the body must be read)."""
    if response.status_code < 400:
        return None
    message = ""
    if read_body:
        try:
            message = response.text.strip()[:500]
        except httpx.ResponseNotRead:
            message = ""
    gate = response.headers.get(REASON_HEADER)
    if gate and response.status_code in (400, 429, 503):
        return Refusal("gate", gate, _meant_status(response), message)
    router = response.headers.get(DROPPED_REASON_HEADER)
    if router:
        return Refusal("router", router, response.status_code, message)
    return None
