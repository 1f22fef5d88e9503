"""Endpoint pick: which of a request's candidate endpoints (``ip:port``) it goes to, and in which order Envoy
tries the others. One interface, :class:`EndpointPick`, for both places that pick without the llm-d EPP: the
gate on the fast path (:mod:`epp_plugin.gate.ext_authz`, ``least_in_flight``) and the EPP-protocol picker
(:mod:`epp_plugin.picker.server`, ``round_robin`` per pool); each chooses its pick by name through
:data:`ENDPOINT_PICKS` (:mod:`llmd_timeslice.plugins`).

With the fast path and no EPP filter, the gate names the endpoint itself (answer header
``x-gateway-destination-endpoint``: the pick, then up to two other SERVING endpoints for Envoy's retries, read by
the override_host policy of Envoy's model-server cluster), so a request costs one Python hop. The llm-d EPP
(or :mod:`epp_plugin.picker`) stays the choice where its scoring matters.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import ClassVar

from llmd_timeslice.plugins import Registry

InFlight = Callable[[str], int]
"""Endpoint -> live requests counted against it (what a load-aware pick weighs)."""


def _no_load(address: str) -> int:
    return 0


class EndpointPick(abc.ABC):
    """Orders the candidates of one request. An instance may keep state between calls (a turn counter): build one
    per pool."""

    name: ClassVar[str]

    @abc.abstractmethod
    def order(self, candidates: Sequence[str], n: int, in_flight: InFlight = _no_load) -> tuple[str, ...]:
        """Up to ``n`` (>= 1) distinct endpoints of ``candidates`` (not empty): the pick first, then the ones Envoy
        tries in this order when a connection is refused (the override_host policy, docs/gate.md)."""

    def pick(self, candidates: Sequence[str], in_flight: InFlight = _no_load) -> str:
        """The one endpoint of ``candidates`` (not empty) the request goes to."""
        return self.order(candidates, 1, in_flight)[0]


class LeastInFlight(EndpointPick):
    """The candidate with the fewest live requests counted against it; ties go round-robin; the others by fewest
    live requests.

    Every candidate of an admission is counted once for it, so comparing counts compares the requests each
    endpoint may be serving.
    """

    name = "least_in_flight"

    def __init__(self) -> None:
        self._turn = 0

    def order(self, candidates: Sequence[str], n: int, in_flight: InFlight = _no_load) -> tuple[str, ...]:
        count = len(candidates)
        if count == 1:
            return (candidates[0],)
        self._turn += 1
        best, best_load = candidates[0], None
        for i in range(count):
            addr = candidates[(self._turn + i) % count]
            load = in_flight(addr)
            if best_load is None or load < best_load:
                best, best_load = addr, load
        if n <= 1:
            return (best,)
        rest = sorted((a for a in candidates if a != best), key=in_flight)
        return (best, *rest[: n - 1])


class RoundRobin(EndpointPick):
    """Each call starts one further along ``candidates`` (in their given order); load is not weighed."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def order(self, candidates: Sequence[str], n: int, in_flight: InFlight = _no_load) -> tuple[str, ...]:
        count = len(candidates)
        start = self._turn % count
        self._turn += 1
        return tuple(candidates[(start + i) % count] for i in range(min(n, count)))


ENDPOINT_PICKS: Registry[EndpointPick] = Registry("endpoint pick")
for _cls in (LeastInFlight, RoundRobin):
    ENDPOINT_PICKS.register(_cls.name, _cls)
