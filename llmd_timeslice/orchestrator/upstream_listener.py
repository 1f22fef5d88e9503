"""The upstream-compatible listener: a second gRPC port serving only ``TimeSliceOrchestratorService`` (and gRPC
health), without a bearer token, for clients that cannot send one.

Why it exists: upstream's Python client (llm-d-incubation/llm-d-rl-time-slicing 6cf8e9b07c60,
``pkg/client/python/timeslice/orchestrator/client.py``, package ``timeslice`` 0.2.1) opens
``grpc.insecure_channel(target, options=channel_options)`` and sends no call credentials or metadata, and its slime
integration (``pkg/integrations/slime/timeslice_slime``) builds that client; against the main port, which requires
``authorization: Bearer``, every call is UNAUTHENTICATED. Who may reach this port is decided outside the process
(the guide's NetworkPolicy admits only trainer pods to it) and, optionally, inside it by source address
(:class:`PeerAllowList`): docs/security.md, docs/decisions/upstream-compat-port.md.

What it serves: the same servicer object as the main port (one orchestrator, one queue per group); gRPC health;
nothing else (no GateState, Lease, WeightVersion, OrchestratorInfo: UNIMPLEMENTED). A caller here carries no token,
so with ``require_job_tokens`` a job that has its own token is refused (PERMISSION_DENIED) here as on the main port.
Plain TCP always: upstream's client cannot speak TLS (a mesh's sidecars may still wrap the connection in mTLS).
"""

from __future__ import annotations

import inspect
import ipaddress
import logging
from collections.abc import Iterable, Sequence

import grpc
from grpc import aio

from llmd_timeslice.addresses import Network, parse_network, peer_ip
from llmd_timeslice.auth import PERMISSION_DENIED_CALLS

log = logging.getLogger(__name__)


class PeerAllowList:
    """Source addresses allowed on one listener. Empty: every peer that can connect (the network decides)."""

    def __init__(self, networks: Iterable[str | Network] = ()) -> None:
        self.networks: tuple[Network, ...] = tuple(
            n if isinstance(n, ipaddress.IPv4Network | ipaddress.IPv6Network) else parse_network(n) for n in networks
        )

    def allows(self, peer: str) -> bool:
        if not self.networks:
            return True
        ip = peer_ip(peer)
        return ip is not None and any(ip in n for n in self.networks)

    def __str__(self) -> str:
        return ", ".join(map(str, self.networks)) or "any peer"


def _guard(handler: grpc.RpcMethodHandler, method: str, allow: PeerAllowList) -> grpc.RpcMethodHandler:
    """``handler`` with the peer checked first: a peer not in ``allow`` gets PERMISSION_DENIED naming its address."""

    async def refuse(context) -> None:
        PERMISSION_DENIED_CALLS.labels(reason="peer_not_allowed").inc()
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED, f"{method}: peer {context.peer()} is not in the allowed peers ({allow})"
        )

    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            if not allow.allows(context.peer()):
                await refuse(context)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, handler.request_deserializer, handler.response_serializer)
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def stream_items(request, context):  # an async generator yielding the responses
            if not allow.allows(context.peer()):
                await refuse(context)
            async for item in inner_stream(request, context):
                yield item

        async def stream_writes(request, context):  # a coroutine writing with context.write
            if not allow.allows(context.peer()):
                await refuse(context)
            return await inner_stream(request, context)

        unary_stream = stream_items if inspect.isasyncgenfunction(inner_stream) else stream_writes
        return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer, handler.response_serializer)
    raise TypeError(f"{method}: a client-streaming method has no place on the upstream-compatible listener")


class _PeerCheck(aio.ServerInterceptor):
    def __init__(self, allow: PeerAllowList) -> None:
        self._allow = allow

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:  # not served here: UNIMPLEMENTED, as for any peer
            return None
        return _guard(handler, handler_call_details.method, self._allow)


def interceptors(allow: PeerAllowList) -> list[aio.ServerInterceptor]:
    """The peer check of the listener (none when ``allow`` is empty)."""
    return [_PeerCheck(allow)] if allow.networks else []


def describe(host: str, port: int, allow: PeerAllowList, extra: Sequence[str] = ()) -> str:
    """The start-up line: what the listener serves and whom it admits."""
    return (
        f"upstream-compatible port {host}:{port}: TimeSliceOrchestratorService and gRPC health only, NO bearer token "
        f"(upstream's client sends none); admits {allow}" + "".join(f"; {e}" for e in extra)
    )
