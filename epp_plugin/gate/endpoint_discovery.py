"""The gate's endpoint discovery for Envoy (``envoy.service.endpoint.v3.EndpointDiscoveryService``, state of the
world): when the gate picks the endpoint (fast path without an EPP), Envoy's model-server cluster is an EDS cluster
fed from here, so that a connection refused by one endpoint can be retried on another.

Why (docs/decisions/refused-connection-override-host.md): an ORIGINAL_DST cluster routes to
the one address in ``x-gateway-destination-endpoint`` and a retry reuses it (Envoy 1.40
``source/extensions/clusters/original_dst/original_dst_cluster.cc``: only the header's first value is read). The
``envoy.load_balancing_policies.override_host`` policy takes a list ``ip:port,ip:port,...`` from that header and
moves to the next entry on each retry (``override_host/load_balancer.cc``: ``getEndpoint`` consumes the list held
in the request's filter state), but only among hosts the cluster already has (``findHost`` looks the address up
in the cluster's host map). So the cluster lists every endpoint this gate knows, in any state: the gate, not
Envoy, decides which of them a request may reach, and an endpoint is in Envoy's host set long before it is first
picked (the orchestrator publishes samplers ASLEEP or WAKING before SERVING).

Protocol (xDS, state of the world; ``envoy/service/discovery/v3/discovery.proto``): Envoy opens one stream and
sends a ``DiscoveryRequest`` naming the cluster; the gate answers a ``DiscoveryResponse`` (one
``ClusterLoadAssignment`` for :data:`CLUSTER_NAME`) with a ``version_info`` and a ``nonce``; Envoy acks with a
request carrying that version and nonce (a NACK carries ``error_detail``), and the gate sends a new response
whenever its endpoint set changes. Nothing is sent before the gate knows an endpoint (a restarted gate would
otherwise empty Envoy's host set until its first snapshot; Envoy keeps the last assignment while the stream is
down). :meth:`EndpointDirectory.known` says whether every open stream has acked an assignment holding an address:
the ext_authz edge names an endpoint only once Envoy has it (waiting at most :data:`ACK_WAIT_S`; only for checks
that carry ``x-llmd-timeslice-eds``, i.e. from an Envoy configured with this cluster).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable, Mapping

from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from google.protobuf import any_pb2

from epp_plugin.gate.pool_state import PoolState
from llmd_timeslice.addresses import parse_host_port

log = logging.getLogger(__name__)

CLUSTER_NAME = "endpoints"
"""The model-server cluster of the rendered Envoy configuration (:func:`llmd_timeslice.router.envoy_config.render_bootstrap`)."""
TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
ACK_WAIT_S = 2.0
"""Most seconds an admission waits for Envoy to ack an assignment holding its endpoint (then it is answered
anyway: Envoy's override_host policy then finds no host and answers 503, retryable, never another endpoint)."""


def _split(address: str) -> tuple[str, int] | None:
    try:
        hp = parse_host_port(address)
    except ValueError:
        return None
    return hp.host, hp.port


def load_assignment(addresses: Iterable[str]) -> endpoint_pb2.ClusterLoadAssignment:
    """The ``ClusterLoadAssignment`` of :data:`CLUSTER_NAME` listing ``addresses`` (``ip:port``; others skipped)."""
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=CLUSTER_NAME)
    group = cla.endpoints.add()
    for addr in addresses:
        parts = _split(addr)
        if parts is None:
            continue
        sock = group.lb_endpoints.add().endpoint.address.socket_address
        sock.address, sock.port_value = parts
    return cla


class _Stream:
    __slots__ = ("acked", "asked", "wake")

    def __init__(self) -> None:
        self.acked: frozenset[str] = frozenset()
        self.asked = False  # Envoy sent its first request
        self.wake = asyncio.Event()  # a request arrived or the endpoint set changed


class EndpointDirectory(eds_pb2_grpc.EndpointDiscoveryServiceServicer):
    """Every endpoint of ``pools`` as Envoy's EDS assignment; see the module docstring.

    Args:
        pools: pool name -> state (shared with the edges and the subscription); pools added later are seen on the
            next change of any pool.

    ``ack_wait_s``: seconds :meth:`wait_known` waits by default (:data:`ACK_WAIT_S`).
    """

    def __init__(self, pools: Mapping[str, PoolState]) -> None:
        self._pools = pools
        self.version = 0
        self.addresses: frozenset[str] = frozenset()
        self._acked = asyncio.Condition()
        self._streams: set[_Stream] = set()
        self._nonces = itertools.count(1)
        self.streams_total = 0
        self.ack_wait_s = ACK_WAIT_S

    def refresh(self) -> None:
        """Recompute the endpoint set (called by the pools on every state change); a new set is a new version."""
        current = frozenset(a for p in self._pools.values() for a in p.endpoints)
        if current != self.addresses:
            self.addresses = current
            self.version += 1
            for s in self._streams:
                s.wake.set()

    def known(self, addresses: Iterable[str]) -> bool:
        """Whether every open EDS stream acked an assignment holding each of ``addresses`` (False with no stream)."""
        if not self._streams:
            return False
        want = set(addresses)
        return all(want <= s.acked for s in self._streams)

    async def wait_known(self, addresses: tuple[str, ...], timeout_s: float | None = None) -> bool:
        """Wait until :meth:`known` (at most ``timeout_s`` seconds, :attr:`ack_wait_s` if None); returns whether it
        is."""
        timeout_s = self.ack_wait_s if timeout_s is None else timeout_s
        if self.known(addresses):
            return True
        try:
            async with self._acked:
                await asyncio.wait_for(self._acked.wait_for(lambda: self.known(addresses)), timeout_s)
            return True
        except TimeoutError:
            return False

    async def StreamEndpoints(self, request_iterator, context):  # noqa: N802 - gRPC method name
        stream = _Stream()
        self.streams_total += 1
        sent: dict[str, frozenset[str]] = {}  # nonce -> addresses of that response
        loop = asyncio.get_running_loop()

        async def read() -> None:
            async for req in request_iterator:
                if req.type_url and req.type_url != TYPE_URL:
                    continue
                if not stream.asked:
                    stream.asked = True
                    stream.wake.set()
                if req.response_nonce:
                    addrs = sent.pop(req.response_nonce, None)
                    if req.HasField("error_detail"):
                        log.error("envoy rejected the gate's endpoint assignment: %s", req.error_detail.message)
                    elif addrs is not None:
                        async with self._acked:
                            stream.acked = addrs
                            self._acked.notify_all()

        reader = loop.create_task(read())
        self._streams.add(stream)
        try:
            sent_version = -1
            while not reader.done():
                stream.wake.clear()
                if stream.asked and self.version != sent_version and (self.addresses or self.version > 0):
                    sent_version = self.version
                    addrs = self.addresses
                    nonce = str(next(self._nonces))
                    sent[nonce] = addrs
                    resource = any_pb2.Any()
                    resource.Pack(load_assignment(sorted(addrs)))
                    yield discovery_pb2.DiscoveryResponse(
                        version_info=str(sent_version), resources=[resource], type_url=TYPE_URL, nonce=nonce
                    )
                    continue
                waiter = loop.create_task(stream.wake.wait())
                await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
        finally:
            reader.cancel()
            self._streams.discard(stream)
