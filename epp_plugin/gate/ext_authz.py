"""The gate's fast-path admission edge: an Envoy ext_authz **HTTP** service.

Envoy's ext_authz filter (rendered by :func:`llmd_timeslice.router.envoy_config.authz_filter`) sends each request's
headers as an HTTP/1.1 check (no body) on a pooled connection and waits up to ``max_hold_s`` + 10 s for
the answer. A check carries (``headers_to_add``, overwriting any client header of the same name)
``x-llmd-timeslice-pool``, ``x-llmd-timeslice-envoy`` and, when no EPP follows, ``x-llmd-timeslice-pick``;
and from the client (``allowed_headers``) ``x-llmd-timeslice-min-weight-version`` and the InferenceObjective
header ``x-gateway-inference-objective`` (its band: :meth:`~epp_plugin.gate.pool_state.PoolState.objective`; a
check without it does no band work).

The answer, per :class:`~epp_plugin.gate.pool_state.PoolState`:

* **admitted**: 200 with ``x-llmd-timeslice-admission`` (matched later by the access-log stream), and either
  the subset hint (``x-llmd-timeslice-subset-hint``: a base64 ``google.protobuf.Value`` list, which Envoy's
  header_to_metadata filter turns into ``envoy.lb.subset_hint`` for the EPP) or, with ``pick``, the endpoint
  itself (``x-gateway-destination-endpoint``; when the check carries ``x-llmd-timeslice-eds``: the pick, then up
  to :data:`PICK_RETRY_ENDPOINTS` other SERVING endpoints, comma-separated, which Envoy's override_host policy
  tries in turn when a connection is refused, answered only once Envoy's endpoint discovery has them,
  :mod:`epp_plugin.gate.endpoint_discovery`; without it, the pick alone, for an ORIGINAL_DST cluster).
  For the client: ``x-llmd-timeslice-weight-version`` when it is
  known at admission (the picked endpoint's, or the one version all candidates share) and, after a hold,
  ``x-llmd-timeslice-hold-ms``.
* **held**: no answer yet. The connection stays open; when Envoy gives up (client gone) it closes it and the
  request leaves the queue at once.
* **refused**: the refusal's status, ``x-llmd-timeslice-reason``, ``retry-after`` and JSON body. A 5xx
  refusal is sent as 429 with ``x-llmd-timeslice-status: 503``: Envoy treats any 5xx ext_authz answer as an
  error (``status_on_error``, body and headers dropped), and the rendered ``local_reply_config`` turns it
  back into 503 (:func:`llmd_timeslice.router.envoy_config.refusal_local_reply`).

Server stack: a plain asyncio protocol with the ``httptools`` parser (uvloop's loop in the gate process),
chosen by measurement against uvicorn and aiohttp (the figures: docs/decisions/fast-path-http-server.md; the
check's cost now: docs/gate.md, "Cost", ``benchmarks/gate_check_cost.py``). The common case (pool serving, nobody
held) answers inside ``data_received`` with a prebuilt answer and no task; a held check is one task.
"""

from __future__ import annotations

import asyncio
import base64
import http
import logging
from collections.abc import Mapping

import httptools
from google.protobuf import struct_pb2

from epp_plugin.endpoint_pick import ENDPOINT_PICKS
from epp_plugin.gate import metrics
from epp_plugin.gate.admissions import AdmissionBook
from epp_plugin.gate.endpoint_discovery import EndpointDirectory
from epp_plugin.gate.pool_state import Admission, AdmissionRefused, PoolState, UnknownPool
from epp_plugin.gate.refusals import BadCheck, min_weight_version, refusal_body
from llmd_timeslice import protocol
from llmd_timeslice.domain.objectives import ObjectiveClass

log = logging.getLogger(__name__)

_POOL, _ENVOY, _PICK, _MIN_VERSION, _EDS, _OBJECTIVE = range(6)
_WANTED = {
    protocol.POOL_HEADER.encode(): _POOL,
    protocol.ENVOY_ID_HEADER.encode(): _ENVOY,
    protocol.PICK_HEADER.encode(): _PICK,
    protocol.MIN_WEIGHT_VERSION_HEADER.encode(): _MIN_VERSION,
    protocol.EDS_HEADER.encode(): _EDS,
    protocol.OBJECTIVE_HEADER.encode(): _OBJECTIVE,
}
_PICK_VALUE = protocol.PICK_LEAST_IN_FLIGHT.encode()
_ADMISSION = f"{protocol.ADMISSION_HEADER}: ".encode()
_HOLD_MS = f"{protocol.HOLD_MS_HEADER}: ".encode()
_CACHE_LIMIT = 4096
PICK_RETRY_ENDPOINTS = 2
"""Endpoints the gate lists after its pick, for Envoy's retries of a refused connection (the rendered route retries
twice: :func:`llmd_timeslice.router.envoy_config.route_retry_policy`)."""
UNREAD_WINDOW_S = 1.0
"""A connection Envoy closes within this many seconds of an admission answer, before sending another check, lost
that answer: Envoy reset the check (its client went away just then), so the request never carries the admission
id and no access-log entry will end it; the admission is dropped at once. (Envoy keeps a connection whose answer it
read: idle connections to the gate close only after the cluster's idle timeout, an hour by default.)"""


def _line(name: str, value: str) -> bytes:
    return f"{name}: {value}\r\n".encode()


def subset_hint_value(candidates: tuple[str, ...]) -> str:
    """The subset hint as Envoy's header_to_metadata filter decodes it: base64 of a serialized
    ``google.protobuf.Value`` holding a list of ``ip:port`` strings."""
    value = struct_pb2.Value()
    values = value.list_value.values
    for addr in candidates:
        values.add().string_value = addr
    return base64.b64encode(value.SerializeToString()).decode()


def refusal_answer(err: AdmissionRefused) -> bytes:
    """The whole HTTP answer for a refusal (see the module docstring for the 5xx carrier)."""
    status = err.http_status
    carrier = status if status < 500 else 429
    body = refusal_body(err)
    head = [
        f"HTTP/1.1 {carrier} {http.HTTPStatus(carrier).phrase}\r\n".encode(),
        _line("content-type", "application/json"),
        _line(protocol.REASON_HEADER, err.reason),
        _line("content-length", str(len(body))),
    ]
    if err.retry_after_s is not None:
        head.append(_line("retry-after", str(err.retry_after_s)))
    if carrier != status:
        head.append(_line(protocol.STATUS_HEADER, str(status)))
    return b"".join(head) + b"\r\n" + body


class AuthzService:
    """State shared by every connection of the HTTP ext_authz edge.

    Args:
        pools: pool name -> :class:`PoolState` (shared with the control servicer and the ext_proc edge).
        book: the fast path's open admissions (shared with the access-log edge).
    """

    def __init__(self, pools: Mapping[str, PoolState], book: AdmissionBook, directory: EndpointDirectory | None = None) -> None:
        self.pools = pools
        self.book = book
        self.directory = directory
        """Envoy's endpoint discovery (when the gate picks): an endpoint is named only once Envoy has it."""
        self.picker = ENDPOINT_PICKS.create("least_in_flight")
        self._answers: dict[tuple[str, bool], tuple[int, dict]] = {}  # (pool, pick) -> (epoch, key -> answer head)
        self._by_header: dict[bytes, PoolState] = {}
        """Pools by the check's raw pool header, filled as checks name them (the gate adds pools, never replaces
        one: server.py, control.py, subscription.py), so a check decodes no header."""
        self._envoys: dict[bytes, str] = {}  # raw Envoy id -> str (a handful per gate)
        self.open: set[AuthzProtocol] = set()
        """Open connections from Envoy (each held check is one)."""

    def protocol(self) -> AuthzProtocol:
        return AuthzProtocol(self)

    def pool(self, raw: bytes | None) -> PoolState:
        """The pool a check names (its raw ``x-llmd-timeslice-pool`` value).

        Raises:
            BadCheck: no pool header.
            UnknownPool: no such pool on this gate.
        """
        pool = self._by_header.get(raw) if raw is not None else None
        if pool is not None:
            return pool
        if raw is None:
            raise BadCheck(
                f"a check needs the {protocol.POOL_HEADER} header (rendered by the gate's Envoy "
                "config); this port serves Envoy's ext_authz only"
            )
        name = raw.decode("utf-8", "replace")
        pool = self.pools.get(name)
        if pool is None:
            raise UnknownPool(f"pool {name!r} is not configured on this gate")
        if len(self._by_header) < _CACHE_LIMIT:
            self._by_header[raw] = pool
        return pool

    def envoy(self, raw: bytes | None) -> str:
        """The check's Envoy id (``x-llmd-timeslice-envoy``) as text ("" without it)."""
        if raw is None:
            return ""
        envoy = self._envoys.get(raw)
        if envoy is None:
            envoy = raw.decode("ascii", "replace")
            if len(self._envoys) < _CACHE_LIMIT:
                self._envoys[raw] = envoy
        return envoy

    def _cache(self, pool: PoolState, pick: bool) -> dict:
        key = (pool.name, pick)
        entry = self._answers.get(key)
        if entry is None or entry[0] != pool.epoch or len(entry[1]) > _CACHE_LIMIT:
            entry = self._answers[key] = (pool.epoch, {})
        return entry[1]

    def order(self, pool: PoolState, adm: Admission, fallbacks: bool = True) -> tuple[str, ...]:
        """The endpoints a picked request may go to, in Envoy's order (the pick first, then its retries; only the
        pick without ``fallbacks``: an Envoy routing by ORIGINAL_DST, which takes one address); ``adm`` counts only
        against them from now on (and against the one that serves it once its upstream log names it)."""
        endpoints = pool.endpoints
        order = self.picker.order(adm.candidates, 1 + PICK_RETRY_ENDPOINTS if fallbacks else 1, lambda a: endpoints[a].in_flight)
        pool.narrow(adm, order)
        return order

    def admitted(self, pool: PoolState, adm: Admission, envoy: str, order: tuple[str, ...] | None) -> tuple[bytes, str]:
        """Record ``adm``; returns its answer (``order``: the endpoints chosen here, see :meth:`order`; None: the
        subset hint for an EPP) and its admission id."""
        if order is not None:
            cache = self._cache(pool, True)
            head = cache.get(order)
            if head is None:
                head = cache[order] = (
                    b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n"
                    + _line(protocol.DESTINATION_HEADER, ",".join(order))
                    + _line(protocol.WEIGHT_VERSION_HEADER, str(pool.endpoints[order[0]].weight_version))
                    + _ADMISSION
                )
        else:
            cache = self._cache(pool, False)
            head = cache.get(adm.candidates)
            if head is None:
                versions = {pool.endpoints[a].weight_version for a in adm.candidates}
                head = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n" + _line(
                    protocol.SUBSET_HINT_HEADER, subset_hint_value(adm.candidates)
                )
                if len(versions) == 1:
                    head += _line(protocol.WEIGHT_VERSION_HEADER, str(versions.pop()))
                head = cache[adm.candidates] = head + _ADMISSION
        aid = self.book.add(pool, adm, envoy)
        if adm.hold_s > 0:
            metrics.observe_hold(pool.name, adm)
            return head + aid.encode() + b"\r\n" + _HOLD_MS + str(round(adm.hold_s * 1000)).encode() + b"\r\n\r\n", aid
        return head + aid.encode() + b"\r\n\r\n", aid


class AuthzProtocol(asyncio.Protocol):
    """One connection from Envoy's ext_authz HTTP client: one check at a time (Envoy does not pipeline)."""

    __slots__ = (
        "__weakref__",
        "_answered",
        "_answered_at",
        "_closed",
        "_eds",
        "_h",
        "_held",
        "_parser",
        "_svc",
        "_transport",
    )
    _transport: asyncio.Transport  # set by connection_made, before any data arrives

    def __init__(self, svc: AuthzService) -> None:
        self._svc = svc
        self._parser = httptools.HttpRequestParser(self)
        self._h: list = [None, None, None, None, None, None]
        self._held: asyncio.Task | None = None
        self._closed = False
        self._answered: str | None = None  # the last admission answered here, until the next check proves it read
        self._answered_at = 0.0
        self._eds = False  # the check says Envoy routes by the gate's EDS (x-llmd-timeslice-eds)

    # ------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport) -> None:
        self._transport = transport  # asyncio.Transport: this protocol is served by loop.create_server
        self._svc.open.add(self)

    def connection_lost(self, exc) -> None:
        self._closed = True
        self._svc.open.discard(self)
        if self._held is not None:
            self._held.cancel()  # Envoy gave up on the check (client gone): leave the hold queue now
            self._held = None
        if self._answered is not None and asyncio.get_running_loop().time() - self._answered_at < UNREAD_WINDOW_S:
            self._svc.book.drop(self._answered)  # Envoy reset the check as it was answered (see UNREAD_WINDOW_S)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._reply(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            log.warning("ext_authz: unparsable check (%s); connection closed", exc)
            self._transport.close()

    # ------------------------------------------------------------ httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        # Envoy sends header names in lower case (its HTTP/1 codec), the client's too: no .lower() per header.
        i = _WANTED.get(name)
        if i is not None:
            self._h[i] = value

    def on_message_complete(self) -> None:
        if self._held is not None:
            # A second check before the first was answered: Envoy never does this.
            self._reply(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self._transport.close()
            return
        h = self._h
        pool_raw, envoy_raw, pick_raw, version_raw, eds_raw, objective_raw = h
        h[0] = h[1] = h[2] = h[3] = h[4] = h[5] = None
        self._answered = None  # a new check: Envoy read the previous answer
        svc = self._svc
        pool: PoolState | None = None
        try:
            pool = svc.pool(pool_raw)
            # Without the optional headers (the common case) no decode and no call: 0 and band 0.
            min_version = min_weight_version(version_raw.decode("utf-8", "replace")) if version_raw is not None else 0
            objective = pool.objective(objective_raw.decode("utf-8", "replace")) if objective_raw is not None else None
            adm = pool.try_admit(min_version, objective)
        except AdmissionRefused as err:
            name = pool.name if pool is not None else pool_raw.decode("utf-8", "replace") if pool_raw is not None else None
            self._refuse(name, err)
            return
        envoy = svc.envoy(envoy_raw)
        pick = pick_raw == _PICK_VALUE
        self._eds = eds_raw is not None
        if adm is not None:
            self._admit(pool, adm, envoy, pick)
        else:
            self._held = asyncio.get_running_loop().create_task(self._hold(pool, min_version, envoy, pick, objective))

    # ------------------------------------------------------------ answers
    async def _hold(self, pool: PoolState, min_version: int, envoy: str, pick: bool, objective: ObjectiveClass | None) -> None:
        try:
            adm = await pool.admit(min_version, objective)
        except AdmissionRefused as err:
            self._held = None
            self._refuse(pool.name, err)
            return
        except asyncio.CancelledError:
            return  # connection gone: admit() already removed the entry
        self._held = None
        if self._closed:
            pool.finish(adm)  # released just as Envoy gave up: never answered, never counted
            return
        self._admit(pool, adm, envoy, pick)

    def _admit(self, pool: PoolState, adm: Admission, envoy: str, pick: bool) -> None:
        svc = self._svc
        order = svc.order(pool, adm, fallbacks=self._eds) if pick else None
        if order is not None and self._eds and svc.directory is not None and not svc.directory.known(order):
            self._held = asyncio.get_running_loop().create_task(self._until_known(pool, adm, envoy, order))
            return
        self._answer(pool, adm, envoy, order)

    async def _until_known(self, pool: PoolState, adm: Admission, envoy: str, order: tuple[str, ...]) -> None:
        """Answer once Envoy has the endpoints (an endpoint it does not know yet would get 503 from its cluster)."""
        directory = self._svc.directory
        assert directory is not None
        try:
            await directory.wait_known(order)
        except asyncio.CancelledError:
            pool.finish(adm)  # connection gone before the answer: never answered
            return
        self._held = None
        if self._closed:
            pool.finish(adm)
            return
        self._answer(pool, adm, envoy, order)

    def _answer(self, pool: PoolState, adm: Admission, envoy: str, order: tuple[str, ...] | None) -> None:
        answer, self._answered = self._svc.admitted(pool, adm, envoy, order)
        self._answered_at = asyncio.get_running_loop().time()
        self._reply(answer)

    def close(self) -> None:
        """Close the connection (the gate stops; held checks were answered by then)."""
        transport = getattr(self, "_transport", None)  # None before connection_made
        if transport is not None:
            transport.close()

    def _refuse(self, pool_name: str | None, err: AdmissionRefused) -> None:
        metrics.REFUSED.labels(pool=pool_name or "", reason=err.reason).inc()
        self._reply(refusal_answer(err))

    def _reply(self, answer: bytes) -> None:
        if not self._closed:
            self._transport.write(answer)
            if not self._parser.should_keep_alive():
                self._transport.close()


async def serve(svc: AuthzService, host: str, port: int, backlog: int = 4096) -> asyncio.Server:
    """Listen on ``host:port`` (0: a free port) in the running loop; returns the started server."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(svc.protocol, host, port, backlog=backlog, reuse_address=True)
