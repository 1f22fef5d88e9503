"""The InferenceObjective objects of the gate's pools, read from the Kubernetes API where the cluster serves them.

``llmd-timeslice gate --objectives-from-kubernetes`` (docs/decisions/discover-what-the-cluster-serves.md):

1. **Discover.** Ask the discovery API which of ``llm-d.ai/v1alpha2`` and ``inference.networking.x-k8s.io/v1alpha2``
   serves the kind InferenceObjective (:mod:`epp_plugin.gate.objectives_discovery`) and read the first, the group the
   EPP reads (llm-d/llm-d-router ``pkg/epp/server/controller_config.go``; facts in
   :mod:`llmd_timeslice.domain.objectives`). With both served the legacy objects are ignored, as the EPP ignores them,
   and one warning says so.
2. **List, then watch** the chosen group's ``inferenceobjectives`` in the namespace, from the list's
   ``resourceVersion``: an :class:`~llmd_timeslice.informer.Informer` (the list-watch shared with the orchestrator's
   pod discovery), in a thread of its own. One watch request lasts at most ``recheck_s``; before the next, discovery is
   asked again, so a CRD installed after the gate started turns the bands on, a newly served preferred group is
   switched to (with a warning naming both), and a removed CRD (the watch or list answers 404) turns them off.
3. **Never take the data path down.** Neither group served, a 401/403, or an unreachable API server: the gate keeps
   serving with priority bands off (the ``x-gateway-inference-objective`` header is ignored, as on a gate without
   objectives) and says so once: one WARNING line, the gauge ``llmd_timeslice_gate_objectives_source`` and the
   ``objectives`` line of ``llmd-timeslice status``. It checks again every ``recheck_s`` (an unreachable API server:
   after a doubling wait, ``backoff_s`` up to ``backoff_max_s``). Once objects were read, a later 403 or outage keeps
   the last objects read (as the EPP's cache does) and reports the state; only a CRD that is gone drops them.

Like the EPP's reconciler (``pkg/epp/controller/inferenceobjective_reconciler.go``) an object counts only when its
``spec.poolRef.group`` is the InferencePool's group (``inference.networking.k8s.io``); the caller keeps those whose
``poolRef.name`` is one of its pools. An object that does not fit (a priority outside int32, no ``poolRef.name``)
is left out with one warning naming it; the others are used.

RBAC: ``get``/``list``/``watch`` on ``inferenceobjectives`` in both groups (the ``components/gate-objectives``
component of the Kubernetes guide); discovery needs nothing beyond the cluster's default ``system:discovery``.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from epp_plugin.gate import metrics
from epp_plugin.gate.objectives_discovery import DiscoveryError, served_group_versions
from llmd_timeslice.discovery.kubernetes import KubernetesError
from llmd_timeslice.domain.objectives import (
    GROUP_VERSIONS,
    GROUPS,
    PLURAL,
    POOL_GROUP,
    ObjectiveEntry,
    ObjectivesError,
    objective_from_k8s,
)
from llmd_timeslice.informer import Informer, Resource

log = logging.getLogger(__name__)

RBAC_HINT = "the component manifests/guides/time-slicing/components/gate-objectives"
RBAC_NEEDED = f"get, list and watch on {PLURAL} in the API groups {' and '.join(GROUPS)}"
_CANDIDATES = " nor ".join(f"{g}/{v}" for g, v in GROUP_VERSIONS)


class ObjectivesApiError(KubernetesError):
    """A Kubernetes API call on the InferenceObjectives failed in an unexpected way (not 401/403/404, not
    unreachable); the message says which call and why. Raised inside the informer's thread only, where it is retried."""


class SourceState(enum.StrEnum):
    """Where the gate's objectives stand (the ``state`` label of ``llmd_timeslice_gate_objectives_source``)."""

    READING = "reading"
    """Listing and watching ``group_version``: bands on."""
    NO_CRD = "no_crd"
    """The API server serves neither group: bands off until a CRD appears."""
    FORBIDDEN = "forbidden"
    """401/403 on discovery, list or watch: the ServiceAccount lacks the RBAC (or the token is refused)."""
    UNREACHABLE = "unreachable"
    """The API server could not be reached (or no Kubernetes configuration at all)."""


@dataclass(frozen=True)
class SourceStatus:
    """One reading of the objectives source: its ``state``, the ``group_version`` whose objects are applied (None:
    none, bands off), the group versions the API server ``served`` at the last discovery, how many usable
    ``objectives`` are applied, and ``detail``: one line saying why when not READING."""

    state: SourceState
    namespace: str
    group_version: str | None = None
    served: tuple[str, ...] = ()
    objectives: int = 0
    detail: str = ""

    @property
    def bands(self) -> bool:
        """Whether objectives (and so priority bands) are applied."""
        return self.group_version is not None


def _api_detail(exc: Exception) -> str:
    body = getattr(exc, "body", None) or ""
    try:
        return json.loads(body).get("message") or str(body)[:200]
    except (ValueError, AttributeError):
        return str(body)[:200] or str(exc)


def _status_of(exc: Exception) -> int | None:
    return getattr(exc, "status", None) or None  # the client reports an unreachable server as status 0


class ObjectiveWatch:
    """The namespace's InferenceObjectives from the group the cluster serves; see the module docstring.

    Args:
        namespace: where the objects are (the pool's namespace: an objective's poolRef names a pool there).
        api_client: a ``kubernetes.client.ApiClient`` (:func:`llmd_timeslice.discovery.kubernetes.make_api_client`).
        on_change: called in the event loop after each change with the usable objectives (``ObjectiveEntry``,
            pool = ``poolRef.name``), or None when none are read (bands off).
        recheck_s: longest watch request, and the wait between discovery checks while no group is served or the
            objects are forbidden, seconds.
        backoff_s / backoff_max_s: first and longest wait after the API server was unreachable (or an unexpected
            API error), seconds.
    """

    def __init__(
        self,
        namespace: str,
        api_client,
        on_change: Callable[[list[ObjectiveEntry] | None], None],
        *,
        recheck_s: float = 60.0,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        from kubernetes import client

        self.namespace = namespace
        self.on_change = on_change
        self.recheck_s = recheck_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self._api_client = api_client
        self._api = client.CustomObjectsApi(api_client)
        # Owned by the informer's thread (and by start() before the thread exists).
        self._gv: str | None = None  # the group version whose objects are held
        self._objectives = Informer(
            "InferenceObjectives",
            None,  # named once discovery chose a group version
            on_change=self._changed,
            before_round=self._discover,
            on_error=self._read_failed,
            after_watch=lambda: self._set(SourceState.READING),  # the objects' count after the watch's changes
            watch_timeout_s=recheck_s,
            backoff_s=backoff_s,
            backoff_max_s=backoff_max_s,
            log=log,
        )
        self._served: tuple[str, ...] = ()
        self._failures = 0
        self._last: list[ObjectiveEntry] | None = None
        self.status = SourceStatus(SourceState.UNREACHABLE, namespace, detail="not checked yet")
        self._logged: tuple[SourceState, str | None] | None = None
        self.rejected: dict[str, str] = {}
        """Objects left out, by name: why (one line)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watching = False

    def entries(self) -> list[ObjectiveEntry]:
        """The usable objectives of the objects held now (sorted by name)."""
        out = []
        rejected = {}
        objects = self._objectives.objects
        for name in sorted(objects):
            obj = objects[name]
            try:
                group, entry = objective_from_k8s(obj)
            except ObjectivesError as exc:
                rejected[name] = str(exc)
                continue
            if group == POOL_GROUP:
                out.append(entry)
        for name, why in rejected.items():
            if self.rejected.get(name) != why:
                log.warning("%s: left out", why)
        self.rejected = rejected
        return out

    def current(self) -> list[ObjectiveEntry] | None:
        """The objectives to apply now: None while none were read (bands off)."""
        return self.entries() if self._objectives.synced else None

    async def start(self) -> list[ObjectiveEntry] | None:
        """Discover and list once, then keep them current in the informer's thread. Never raises: without the CRD,
        the RBAC or an API server that answers, the bands are off (:attr:`status` says why) and the informer keeps
        checking. Returns :meth:`current`."""
        self._loop = asyncio.get_running_loop()
        try:
            await asyncio.to_thread(self._objectives.sync)
        except ObjectivesApiError as exc:  # e.g. a 5xx: the informer retries it; the gate starts all the same
            self._set(SourceState.UNREACHABLE, str(exc))
        self._failures = 0  # the start's check does not lengthen the first wait
        self._last = self.current()
        self._watching = True
        self._objectives.start()
        if self._last is not None:
            log.info(
                "InferenceObjectives (%s) in %s: %s",
                self._gv,
                self.namespace,
                {e.name: (e.pool, e.priority) for e in self._last},
            )
        return None if self._last is None else list(self._last)

    async def stop(self) -> None:
        """Stop the watch (closes its connection) and withdraw this source's gauge series."""
        await self._objectives.stop()
        self._watching = False
        metrics.set_objectives_source(self.namespace, None, None)

    # ------------------------------------------------------------ state
    def _set(self, state: SourceState, detail: str = "") -> None:
        """Record the state; one log line when the state or the group version read changes."""
        gv = self._gv if self._objectives.synced else None
        self.status = SourceStatus(state, self.namespace, gv, self._served, len(self.entries()) if gv else 0, detail)
        metrics.set_objectives_source(self.namespace, state.value, gv)
        key = (state, gv)
        if key == self._logged:
            return
        self._logged = key
        if state is SourceState.READING:
            log.info("InferenceObjectives: reading %s in namespace %r; priority bands on", gv, self.namespace)
        elif gv is None:
            log.warning("InferenceObjectives: %s; priority bands off (the objective header is ignored)", detail)
        else:
            n = len(self._objectives.objects)
            log.warning("InferenceObjectives: %s; keeping the %d objects of %s last read", detail, n, gv)

    def _fail(self, exc: Exception, verb: str) -> SourceState:
        """A refused or unreachable call: the state and its one line."""
        status = _status_of(exc)
        what = f"{PLURAL}.{(self._gv or '').split('/')[0]} in namespace {self.namespace!r}"
        if status in (401, 403):
            code = "401 Unauthorized" if status == 401 else "403 Forbidden"
            self._set(
                SourceState.FORBIDDEN,
                f"kubernetes API refused to {verb} {what} ({code}: {_api_detail(exc)}); the gate's ServiceAccount "
                f"needs {RBAC_NEEDED} ({RBAC_HINT})",
            )
            return SourceState.FORBIDDEN
        self._set(SourceState.UNREACHABLE, f"kubernetes API unreachable to {verb} {what}: {type(exc).__name__}: {exc}")
        return SourceState.UNREACHABLE

    def _drop(self) -> None:
        """No group version is read: its objects are forgotten (bands off)."""
        self._gv = None
        self._objectives.reset()

    def _use(self, gv: str) -> None:
        """Read ``gv`` from now on: its objects are listed afresh at the next round."""
        self._gv = gv
        group, version = gv.split("/")
        self._objectives.reset(Resource(self._api.list_namespaced_custom_object, (group, version, self.namespace, PLURAL)))

    def _not_read(self) -> float:
        """The objects could not be read this round (the state says why): publish, then wait before the next."""
        self._publish()
        return self._wait_s()

    # ------------------------------------------------------------ the informer's hooks (its thread)
    def _discover(self) -> float | None:
        """Before each round: which group version to read (discovery). None to list (when needed) and watch it;
        seconds to wait otherwise (none served, discovery refused or unreachable: the state says so)."""
        try:
            served = tuple(served_group_versions(self._api_client))
        except DiscoveryError as exc:
            if exc.status in (401, 403):
                self._set(
                    SourceState.FORBIDDEN,
                    f"kubernetes discovery API refused ({exc}); the gate's ServiceAccount needs the cluster's "
                    "default ClusterRole system:discovery (bound to system:authenticated)",
                )
            elif exc.status is None:
                self._set(SourceState.UNREACHABLE, f"kubernetes API unreachable for discovery: {exc}")
            else:
                raise ObjectivesApiError(f"kubernetes discovery API failed: {exc}", exc.status) from exc
            return self._not_read()
        if served and len(served) > 1 and served != self._served:
            log.warning(
                "InferenceObjectives: the API server serves %s; reading %s and ignoring the others' objects, as the EPP does",
                " and ".join(served),
                served[0],
            )
        self._served = served
        if not served:
            self._drop()
            self._set(
                SourceState.NO_CRD,
                f"the API server serves neither {_CANDIDATES} (no InferenceObjective CRD); checking again every "
                f"{self.recheck_s:g} s",
            )
            return self._not_read()
        if served[0] != self._gv:
            if self._gv is not None:
                log.warning(
                    "InferenceObjectives: now reading %s (was %s): the API server serves it now and the EPP prefers "
                    "it; the objects of %s are no longer used",
                    served[0],
                    self._gv,
                    self._gv,
                )
            self._use(served[0])
        if self._objectives.resource_version is not None:  # no list needed: reading already
            self._failures = 0
            self._set(SourceState.READING)
            self._publish()
        return None

    def _changed(self, relisted: bool) -> None:
        if relisted:
            self._failures = 0
            self._set(SourceState.READING)
        self._publish()

    def _read_failed(self, exc: Exception, verb: str) -> float:
        """A list or watch of the objects failed (not 410 Gone: the informer lists again): a CRD that went, a refusal
        or an unreachable API server is recorded and waited out; anything else is raised to the informer's back-off."""
        status = _status_of(exc)
        if verb == "list":
            if status == 404:  # the CRD went between discovery and list
                self._drop()
                self._set(SourceState.NO_CRD, f"{_CANDIDATES} went away while listing; checking again")
                return self._not_read()
            if status in (None, 401, 403):
                self._fail(exc, "list")
                return self._not_read()
        else:
            if status == 404:  # the CRD went: discovery says so next round
                self._objectives.relist_next()
                return 0.0
            if status in (None, 401, 403):
                self._fail(exc, "watch")
                return self._not_read()
        raise ObjectivesApiError(
            f"kubernetes API: {verb} {PLURAL} ({self._gv}) in namespace {self.namespace!r} failed: {status} {_api_detail(exc)}",
            status,
        ) from exc

    def _wait_s(self) -> float:
        """The pause before the next check: a doubling wait while unreachable, else ``recheck_s``."""
        if self.status.state is SourceState.UNREACHABLE:
            self._failures += 1
            return min(self.backoff_max_s, self.backoff_s * 2 ** (self._failures - 1))
        return self.recheck_s

    def _publish(self) -> None:
        if not self._watching:
            return  # start(): the caller gets the objectives as the return value
        entries = self.current()
        if entries == self._last:
            return
        self._last = entries
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self.on_change, None if entries is None else list(entries))
            except RuntimeError:
                pass
