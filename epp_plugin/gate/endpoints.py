"""The endpoint table of one InferencePool at the gate (no I/O): each endpoint's state and weight version, the
endpoints Envoy could not connect to, the freshness of the orchestrator's view, and the SERVING lookup the data
path asks once per request. :class:`~epp_plugin.gate.pool_state.PoolState` composes it with the hold queue and the
drain accounting.

**Endpoint states** (docs/architecture.md, "States and their vocabularies") and the table of their moves,
:data:`TRANSITIONS`, as the orchestrator publishes them on the state stream, its one writer
(docs/decisions/one-writer-of-gate-state.md; ``llmd_timeslice/orchestrator/actions.py``):

* the switch: ``SERVING -drain-> DRAINING -slept-> ASLEEP -resume-> WAKING -verified awake-> SERVING``;
* a failed drain or sleep is rolled back by waking: ``DRAINING -> WAKING``;
* a failed wake: ``WAKING -> ASLEEP`` (out of service, never half-awake);
* out of service from any state (an engine fault: ``take_out_of_service``): ``-> DRAINING``;
* a retired sampler, or one of a group a job holds at the orchestrator's start: ``SERVING -> ASLEEP``;
* the same state again with another weight version (a weight update, a repeat): ``X -> X``.

Not in the table: ``ASLEEP|DRAINING -> SERVING`` (into service without the verified wake that ``WAKING`` stands for)
and ``SERVING -> WAKING``. The gate is a follower of its one writer, so an update taking such an edge is
**flagged, not refused** (:meth:`EndpointTable.update`): a warning naming both states and the pool's
``unexpected_transitions`` count (metric ``llmd_timeslice_gate_endpoint_unexpected_transitions_total``), and the
state is applied — refusing would leave this gate steering by a state the orchestrator has left, the divergence the
one writer exists to prevent. A full snapshot (a resync after missed updates) replaces the view and is not checked: a
gate that missed ``WAKING`` legitimately jumps from ``ASLEEP`` to ``SERVING``. ``tests/gate/test_endpoint_states.py``
walks every edge.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import MappingProxyType

log = logging.getLogger(__name__)

_INF = math.inf  # a module global: no attribute lookup per admission
_SERVING_CACHE_LIMIT = 64


class EndpointState(enum.Enum):
    """Gate view of one model-server endpoint (docs/architecture.md, "States and their vocabularies")."""

    SERVING = "SERVING"
    DRAINING = "DRAINING"
    ASLEEP = "ASLEEP"
    WAKING = "WAKING"


_S = EndpointState
TRANSITIONS: MappingProxyType[EndpointState, frozenset[EndpointState]] = MappingProxyType(
    {
        _S.SERVING: frozenset({_S.SERVING, _S.DRAINING, _S.ASLEEP}),
        _S.DRAINING: frozenset({_S.DRAINING, _S.ASLEEP, _S.WAKING}),
        _S.ASLEEP: frozenset({_S.ASLEEP, _S.WAKING, _S.DRAINING}),
        _S.WAKING: frozenset({_S.WAKING, _S.SERVING, _S.ASLEEP, _S.DRAINING}),
    }
)
"""From each endpoint state, the states an update may move it to (see the module docstring)."""


@dataclass(slots=True)
class Endpoint:
    """One endpoint (``ip:port``) of a pool; ``in_flight`` counts live requests that may reach it."""

    address: str
    state: EndpointState
    weight_version: int = 0
    in_flight: int = 0


class EndpointTable:
    """Endpoints of one pool, their failure marks and the view's freshness.

    Args:
        pool: the pool's name (for log lines).
        clock: monotonic clock in seconds, the pool's.
        on_unfailed: called when a failure mark expires by itself (the pool may release held requests then).
    """

    def __init__(self, pool: str, clock: Callable[[], float] = time.monotonic, on_unfailed: Callable[[], None] | None = None):
        self.pool = pool
        self._clock = clock
        self._on_unfailed = on_unfailed
        self.endpoints: dict[str, Endpoint] = {}
        self.epoch = 0
        self.failed: dict[str, asyncio.TimerHandle | None] = {}
        """Endpoints Envoy could not connect to (:meth:`mark_failed`): not steered to until their state changes or
        their hold passes."""
        self._serving: dict[int, tuple[str, ...]] = {}
        """:meth:`serving`'s answer per ``min_version``, emptied by every change of an endpoint's state, version or
        failure mark (:meth:`states_changed`): the data path asks it once per request, the state changes per switch."""
        self.stale = False
        """True while the gate has lost the orchestrator's state stream for longer than its grace: no
        endpoint is steerable (new requests are held) until the stream resyncs."""
        self.fresh_until = math.inf
        """Monotonic deadline (``clock``) of the orchestrator view: past it the pool counts as stale at once, in the
        data path, even before the subscription's watchdog runs (after a stall of this process the first request
        must not be steered by a view the orchestrator may have acted past). ``inf``: no deadline."""
        self.unexpected_transitions: dict[tuple[EndpointState, EndpointState], int] = {}
        """Updates that took an edge outside :data:`TRANSITIONS`, per (from, to) (flagged and applied)."""

    # ------------------------------------------------------------------ queries
    def serving(self, min_version: int = 0) -> tuple[str, ...]:
        """Addresses that are SERVING at ``weight_version >= min_version``, in insertion order (none while stale)."""
        if self.stale or (self.fresh_until != _INF and self._clock() >= self.fresh_until):
            return ()
        found = self._serving.get(min_version)
        if found is not None:
            return found
        failed = self.failed
        found = tuple(
            ep.address
            for ep in self.endpoints.values()
            if ep.state is EndpointState.SERVING and ep.weight_version >= min_version and ep.address not in failed
        )
        if len(self._serving) >= _SERVING_CACHE_LIMIT:  # min_version comes from clients: bounded
            self._serving.clear()
        self._serving[min_version] = found
        return found

    def newest_version(self) -> int:
        """The highest weight version any endpoint has (whatever its state; 0: the initial weights)."""
        return max((ep.weight_version for ep in self.endpoints.values()), default=0)

    def in_flight(self, addresses: Iterable[str]) -> dict[str, int]:
        """Live requests that may still reach each address."""
        return {a: (self.endpoints[a].in_flight if a in self.endpoints else 0) for a in addresses}

    def states_changed(self) -> None:
        """An endpoint was added, removed, changed state or version, or was marked failed or unmarked."""
        self._serving.clear()

    def expired(self) -> bool:
        """Whether the view's deadline (``fresh_until``) has passed."""
        return self.fresh_until != math.inf and self._clock() >= self.fresh_until

    # ------------------------------------------------------------------ updates
    def update(self, address: str, state: EndpointState, version: int | None, resync: bool = False) -> bool:
        """Apply one endpoint's update from the orchestrator (``version`` None: keep the weight version); returns
        whether anything changed. An edge outside :data:`TRANSITIONS` is flagged (logged and counted) and applied,
        except on a ``resync`` (a full snapshot), which is not checked (see the module docstring)."""
        ep = self.endpoints.get(address)
        if ep is None:
            self.endpoints[address] = Endpoint(address, state, version or 0)
            return True
        if not resync and state not in TRANSITIONS[ep.state]:
            self._flag(address, ep.state, state)
        if ep.state is state and (version is None or version == ep.weight_version):
            return False
        ep.state = state
        if version is not None:
            ep.weight_version = version
        self.clear_failed(address)  # the orchestrator said something new about it: that governs
        return True

    def _flag(self, address: str, current: EndpointState, target: EndpointState) -> None:
        key = (current, target)
        self.unexpected_transitions[key] = self.unexpected_transitions.get(key, 0) + 1
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[current]))
        log.warning(
            "pool=%s endpoint=%s: update from %s to %s is not a move of the endpoint table (from %s: %s); applied: "
            "the orchestrator's state governs",
            self.pool,
            address,
            current.value,
            target.value,
            current.value,
            allowed,
        )

    def remove(self, address: str) -> None:
        """Forget ``address`` (the caller checked that nothing is in flight to it)."""
        del self.endpoints[address]
        self.states_changed()
        self.clear_failed(address)

    # ------------------------------------------------------------ failure marks
    def mark_failed(self, address: str, hold_s: float) -> bool:
        """Envoy could not connect to ``address``: steer no new request to it until the orchestrator publishes a new
        state for it, or for ``hold_s`` seconds (then it is tried again; 0: until a new state). Requests already
        admitted keep counting. Returns whether it was a SERVING endpoint not marked yet (first failure)."""
        ep = self.endpoints.get(address)
        if ep is None or address in self.failed:
            return False
        timer = asyncio.get_running_loop().call_later(hold_s, self._failed_expired, address) if hold_s > 0 else None
        self.failed[address] = timer
        self.states_changed()
        return ep.state is EndpointState.SERVING

    def _failed_expired(self, address: str) -> None:
        self.failed.pop(address, None)
        self.states_changed()
        if self._on_unfailed is not None:
            self._on_unfailed()

    def clear_failed(self, address: str) -> None:
        """Unmark ``address`` (no-op when it is not marked failed)."""
        if address not in self.failed:
            return
        timer = self.failed.pop(address)
        self.states_changed()
        if timer is not None:
            timer.cancel()

    def clear_all_failed(self) -> None:
        for addr in list(self.failed):
            self.clear_failed(addr)
