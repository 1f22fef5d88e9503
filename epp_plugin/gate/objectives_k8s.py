"""The InferenceObjective objects of the gate's pools, read from the Kubernetes API where the cluster serves them.

``llmd-timeslice gate --objectives-from-kubernetes`` (docs/decisions/discover-what-the-cluster-serves.md):

1. **Discover.** Ask the discovery API which of ``llm-d.ai/v1alpha2`` and ``inference.networking.x-k8s.io/v1alpha2``
   serves the kind InferenceObjective (:mod:`epp_plugin.gate.objectives_discovery`) and read the first, the group the
   EPP reads (llm-d/llm-d-router ``pkg/epp/server/controller_config.go``; facts in
   :mod:`llmd_timeslice.domain.objectives`). With both served the legacy objects are ignored, as the EPP ignores them,
   and one warning says so.
2. **List, then watch** the chosen group's ``inferenceobjectives`` in the namespace, from the list's
   ``resourceVersion``, in a thread. One watch request lasts at most ``recheck_s``; before the next, discovery is
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
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
from llmd_timeslice.watch_rounds import run_rounds, stop_watch_thread

log = logging.getLogger(__name__)

RBAC_HINT = "the component manifests/guides/time-slicing/components/gate-objectives"
RBAC_NEEDED = f"get, list and watch on {PLURAL} in the API groups {' and '.join(GROUPS)}"
_CANDIDATES = " nor ".join(f"{g}/{v}" for g, v in GROUP_VERSIONS)


class ObjectivesApiError(KubernetesError):
    """A Kubernetes API call on the InferenceObjectives failed in an unexpected way (not 401/403/404, not
    unreachable); the message says which call and why. Raised inside the watch thread only, where it is retried."""


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
        self._gv: str | None = None  # the group version whose objects are held (owned by the watch thread)
        self._objects: dict[str, dict] = {}  # name -> object of _gv
        self._rv: str | None = None
        self._reading = False  # _objects is a complete list of _gv
        self._served: tuple[str, ...] = ()
        self._failures = 0
        self._last: list[ObjectiveEntry] | None = None
        self.status = SourceStatus(SourceState.UNREACHABLE, namespace, detail="not checked yet")
        self._logged: tuple[SourceState, str | None] | None = None
        self.rejected: dict[str, str] = {}
        """Objects left out, by name: why (one line)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._watch: Any = None

    def entries(self) -> list[ObjectiveEntry]:
        """The usable objectives of the objects held now (sorted by name)."""
        out = []
        rejected = {}
        for name in sorted(self._objects):
            obj = self._objects[name]
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
        return self.entries() if self._reading else None

    async def start(self) -> list[ObjectiveEntry] | None:
        """Discover and list once, then keep them current in a thread. Never raises: without the CRD, the RBAC or
        an API server that answers, the bands are off (:attr:`status` says why) and the thread keeps checking.
        Returns :meth:`current`."""
        self._loop = asyncio.get_running_loop()
        try:
            await asyncio.to_thread(self._sync)
        except ObjectivesApiError as exc:  # e.g. a 5xx: the watch thread retries it; the gate starts all the same
            self._set(SourceState.UNREACHABLE, str(exc))
        self._last = self.current()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name=f"objectives-watch-{self.namespace}", daemon=True)
        self._thread.start()
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
        self._stopping.set()
        if self._thread is not None:
            await stop_watch_thread(self._thread, self._stopping, lambda: self._watch)
            self._thread = None
        metrics.set_objectives_source(self.namespace, None, None)

    # ------------------------------------------------------------ state
    def _set(self, state: SourceState, detail: str = "") -> None:
        """Record the state; one log line when the state or the group version read changes."""
        gv = self._gv if self._reading else None
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
            log.warning("InferenceObjectives: %s; keeping the %d objects of %s last read", detail, len(self._objects), gv)

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
        self._gv, self._rv, self._objects, self._reading = None, None, {}, False

    def _sync(self) -> bool:
        """Discovery, then a list when needed; records the state. True when the chosen group is being read."""
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
            return False
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
            return False
        if served[0] != self._gv:
            if self._gv is not None:
                log.warning(
                    "InferenceObjectives: now reading %s (was %s): the API server serves it now and the EPP prefers "
                    "it; the objects of %s are no longer used",
                    served[0],
                    self._gv,
                    self._gv,
                )
            self._drop()
            self._gv = served[0]
        if self._rv is None:
            try:
                self._relist()
            except Exception as exc:
                status = _status_of(exc)
                if status == 404:  # the CRD went between discovery and list
                    self._drop()
                    self._set(SourceState.NO_CRD, f"{_CANDIDATES} went away while listing; checking again")
                    return False
                if status in (None, 401, 403):
                    self._fail(exc, "list")
                    return False
                raise ObjectivesApiError(
                    f"kubernetes API: list {PLURAL} ({self._gv}) in namespace {self.namespace!r} failed: {status} "
                    f"{_api_detail(exc)}",
                    status,
                ) from exc
            self._reading = True
        self._failures = 0
        self._set(SourceState.READING)
        return True

    # ------------------------------------------------------------ watch thread
    def _group_version(self) -> tuple[str, str]:
        assert self._gv is not None
        group, version = self._gv.split("/")
        return group, version

    def _relist(self) -> None:
        group, version = self._group_version()
        resp: Any = self._api.list_namespaced_custom_object(
            group, version, self.namespace, PLURAL, _preload_content=False, _request_timeout=(10, 60)
        )
        try:
            body = json.loads(resp.data)
        finally:
            resp.release_conn()
        self._objects = {(o.get("metadata") or {}).get("name", ""): o for o in body.get("items") or []}
        self._rv = (body.get("metadata") or {}).get("resourceVersion")

    def _watch_once(self) -> None:
        from kubernetes import watch

        group, version = self._group_version()
        w = watch.Watch()
        self._watch = w
        if self._stopping.is_set():
            return
        try:
            for ev in w.stream(
                self._api.list_namespaced_custom_object,
                group,
                version,
                self.namespace,
                PLURAL,
                resource_version=self._rv,
                allow_watch_bookmarks=True,
                timeout_seconds=max(1, int(self.recheck_s)),
                _request_timeout=(10, self.recheck_s + 30),
            ):
                if self._stopping.is_set():
                    return
                kind, obj = ev.get("type"), ev.get("raw_object") or ev.get("object") or {}
                meta = obj.get("metadata") or {}
                if kind == "BOOKMARK":
                    self._rv = meta.get("resourceVersion") or self._rv
                    continue
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        self._rv = None
                        return
                    continue
                if kind in ("ADDED", "MODIFIED"):
                    self._objects[meta.get("name", "")] = obj
                elif kind == "DELETED":
                    self._objects.pop(meta.get("name", ""), None)
                self._rv = meta.get("resourceVersion") or self._rv
                self._publish()
        finally:
            self._watch = None

    def _wait_s(self) -> float:
        """The pause before the next check: a doubling wait while unreachable, else ``recheck_s``."""
        if self.status.state is SourceState.UNREACHABLE:
            self._failures += 1
            return min(self.backoff_max_s, self.backoff_s * 2 ** (self._failures - 1))
        return self.recheck_s

    def _round(self) -> None:
        """Discovery (and a list when needed), then one watch request; a standing condition (no CRD, refused,
        unreachable) is recorded and waited out here; anything else is raised to :func:`run_rounds`."""
        if self._stopping.is_set():
            return
        ok = self._sync()
        self._publish()
        if not ok:
            self._stopping.wait(self._wait_s())
            return
        try:
            self._watch_once()
        except Exception as exc:
            if self._stopping.is_set():
                return
            status = _status_of(exc)
            if status in (404, 410):  # 404: the CRD went (discovery says so next); 410: too old, list again
                self._rv = None
                return
            if status in (None, 401, 403):
                self._fail(exc, "watch")
                self._publish()
                self._stopping.wait(self._wait_s())
                return
            raise ObjectivesApiError(
                f"kubernetes API: watch {PLURAL} ({self._gv}) in namespace {self.namespace!r} failed: {status} "
                f"{_api_detail(exc)}",
                status,
            ) from exc
        self._set(SourceState.READING)  # the objects' count after the watch's changes

    def _run(self) -> None:
        run_rounds(self._round, self._stopping, self.backoff_s, self.backoff_max_s, log)

    def _publish(self) -> None:
        entries = self.current()
        if entries == self._last:
            return
        self._last = entries
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self.on_change, None if entries is None else list(entries))
            except RuntimeError:
                pass
