"""The InferenceObjective objects of the gate's pools, read from the Kubernetes API (list + watch).

``llmd-timeslice gate --objectives-from-kubernetes``: the gate lists the namespace's InferenceObjectives
(``inference.networking.x-k8s.io/v1alpha2``, plural ``inferenceobjectives``; facts and their sources in
:mod:`llmd_timeslice.domain.objectives`) once at start, then watches them from the list's ``resourceVersion`` in a
thread (a 410 Gone re-lists; other API errors are retried after a doubling, jittered wait). Like the EPP's own
reconciler (GIE ``pkg/epp/controller/inferenceobjective_reconciler.go``) it keeps an object only when its
``spec.poolRef.group`` is the InferencePool's group (``inference.networking.k8s.io``); the caller keeps those whose
``poolRef.name`` is one of its pools. An object that does not fit (a priority outside int32, no ``poolRef.name``)
is left out with one warning naming it; the others are used.

RBAC: ``get``/``list``/``watch`` on ``inferenceobjectives`` in the group above, nothing else (the
``components/gate-objectives`` component of the Kubernetes guide).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from llmd_timeslice.discovery.kubernetes import KubernetesError
from llmd_timeslice.domain.objectives import (
    GROUP,
    PLURAL,
    POOL_GROUP,
    VERSION,
    ObjectiveEntry,
    ObjectivesError,
    objective_from_k8s,
)
from llmd_timeslice.watch_rounds import run_rounds, stop_watch_thread

log = logging.getLogger(__name__)

RBAC_HINT = "the component manifests/guides/time-slicing/components/gate-objectives"


class ObjectivesApiError(KubernetesError):
    """Listing the InferenceObjectives failed; the message says why and what to fix."""


def _explain(exc: Exception, verb: str, namespace: str) -> ObjectivesApiError:
    status = getattr(exc, "status", None)
    body = getattr(exc, "body", None) or ""
    try:
        detail = json.loads(body).get("message") or str(body)[:200]
    except (ValueError, AttributeError):
        detail = str(body)[:200] or str(exc)
    what = f"{PLURAL}.{GROUP} in namespace {namespace!r}"
    if status == 403:
        return ObjectivesApiError(
            f"kubernetes API refused to {verb} {what} (403 Forbidden: {detail}); the gate's ServiceAccount needs "
            f"get, list and watch on them ({RBAC_HINT})"
        )
    if status == 404:
        return ObjectivesApiError(
            f"kubernetes API has no {what} (404: {detail}): is the InferenceObjective CRD ({GROUP}/{VERSION}) installed?"
        )
    if status is not None:
        return ObjectivesApiError(f"kubernetes API: {verb} {what} failed: {status} {detail}")
    return ObjectivesApiError(f"kubernetes API unreachable to {verb} {what}: {type(exc).__name__}: {exc}")


class ObjectiveWatch:
    """The namespace's InferenceObjectives, kept current by a list + watch; see the module docstring.

    Args:
        namespace: where the objects are (the pool's namespace: an objective's poolRef names a pool there).
        api_client: a ``kubernetes.client.ApiClient`` (:func:`llmd_timeslice.discovery.kubernetes.make_api_client`).
        on_change: called in the event loop with the usable objectives (``ObjectiveEntry``, pool = ``poolRef.name``)
            after each change.
        watch_timeout_s: server-side timeout of one watch request (the next resumes from the last resourceVersion).
        backoff_s / backoff_max_s: first and longest wait after an API error, seconds.
    """

    def __init__(
        self,
        namespace: str,
        api_client,
        on_change: Callable[[list[ObjectiveEntry]], None],
        *,
        watch_timeout_s: float = 300.0,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        from kubernetes import client

        self.namespace = namespace
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self._api = client.CustomObjectsApi(api_client)
        self._objects: dict[str, dict] = {}  # name -> object (owned by the watch thread after start)
        self._rv: str | None = None
        self._last: list[ObjectiveEntry] | None = None
        self.rejected: dict[str, str] = {}
        """Objects left out, by name: why (one line)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._watch: Any = None

    def entries(self) -> list[ObjectiveEntry]:
        """The usable objectives now (sorted by name)."""
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

    async def start(self) -> list[ObjectiveEntry]:
        """List once (raises :class:`ObjectivesApiError`), then watch in a thread; returns the objectives."""
        self._loop = asyncio.get_running_loop()
        try:
            await asyncio.to_thread(self._relist)
        except Exception as exc:
            raise _explain(exc, "list", self.namespace) from exc
        self._last = self.entries()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name=f"objectives-watch-{self.namespace}", daemon=True)
        self._thread.start()
        log.info("InferenceObjectives in %s: %s", self.namespace, {e.name: (e.pool, e.priority) for e in self._last})
        return list(self._last)

    async def stop(self) -> None:
        """Stop the watch (closes its connection)."""
        self._stopping.set()
        if self._thread is not None:
            await stop_watch_thread(self._thread, self._stopping, lambda: self._watch)
            self._thread = None

    # ------------------------------------------------------------ watch thread
    def _relist(self) -> None:
        resp: Any = self._api.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, _preload_content=False, _request_timeout=(10, 60)
        )
        try:
            if not 200 <= resp.status <= 299:
                from kubernetes.client.exceptions import ApiException

                raise ApiException(http_resp=resp)
            body = json.loads(resp.data)
        finally:
            resp.release_conn()
        self._objects = {(o.get("metadata") or {}).get("name", ""): o for o in body.get("items") or []}
        self._rv = (body.get("metadata") or {}).get("resourceVersion")

    def _watch_once(self) -> None:
        from kubernetes import watch

        w = watch.Watch()
        self._watch = w
        if self._stopping.is_set():
            return
        try:
            for ev in w.stream(
                self._api.list_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                resource_version=self._rv,
                allow_watch_bookmarks=True,
                timeout_seconds=max(1, int(self.watch_timeout_s)),
                _request_timeout=(10, self.watch_timeout_s + 30),
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

    def _round(self) -> None:
        if self._stopping.is_set():
            return
        try:
            if self._rv is None:
                self._relist()
                self._publish()
            self._watch_once()
        except Exception as exc:
            if self._stopping.is_set():
                return
            if getattr(exc, "status", None) == 410:
                self._rv = None
                return
            raise _explain(exc, "watch" if self._rv else "list", self.namespace) from exc

    def _run(self) -> None:
        run_rounds(self._round, self._stopping, self.backoff_s, self.backoff_max_s, log)

    def _publish(self) -> None:
        entries = self.entries()
        if entries == self._last:
            return
        self._last = entries
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self.on_change, list(entries))
            except RuntimeError:
                pass
