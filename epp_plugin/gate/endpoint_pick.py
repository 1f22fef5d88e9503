"""Endpoint choice for set-ups with no EPP behind the gate (the local stack): least in flight.

With the fast path and no EPP filter, the gate names the endpoint itself (answer header
``x-gateway-destination-endpoint``: the pick, then up to two other SERVING endpoints for Envoy's retries, read by
the override_host policy of Envoy's model-server cluster), so a request costs one Python hop. The llm-d EPP
(or :mod:`epp_plugin.picker`) stays the choice where its scoring matters.
"""

from __future__ import annotations

from epp_plugin.gate.pool_state import PoolState


class LeastInFlight:
    """The candidate with the fewest live requests counted against it; ties go round-robin.

    Every candidate of an admission is counted once for it, so comparing counts compares the requests each
    endpoint may be serving.
    """

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, pool: PoolState, candidates: tuple[str, ...]) -> str:
        """One of ``candidates`` (non-empty, all endpoints of ``pool``)."""
        n = len(candidates)
        if n == 1:
            return candidates[0]
        self._turn += 1
        endpoints = pool.endpoints
        best, best_load = candidates[0], None
        for i in range(n):
            addr = candidates[(self._turn + i) % n]
            load = endpoints[addr].in_flight
            if best_load is None or load < best_load:
                best, best_load = addr, load
        return best

    def order(self, pool: PoolState, candidates: tuple[str, ...], n: int) -> tuple[str, ...]:
        """Up to ``n`` distinct candidates: :meth:`pick` first, then the others by fewest live requests (Envoy tries
        them in this order when a connection is refused: the override_host policy, docs/gate.md)."""
        first = self.pick(pool, candidates)
        if n <= 1 or len(candidates) == 1:
            return (first,)
        endpoints = pool.endpoints
        rest = sorted((a for a in candidates if a != first), key=lambda a: endpoints[a].in_flight)
        return (first, *rest[: n - 1])
