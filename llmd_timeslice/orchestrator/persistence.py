"""Where the orchestrator's state survives a restart (docs/architecture.md, "Invariants", 9).

``FileStateStore`` (local and Slurm-style set-ups) writes the JSON snapshot of
:meth:`~llmd_timeslice.orchestrator.groups.Orchestrator.snapshot` atomically (temporary file +
``os.replace``). ``ConfigMapStateStore`` is the cluster-mode counterpart (a ConfigMap through the
official ``kubernetes`` client), written with the ``resourceVersion`` it last read or wrote, so a second
orchestrator writing the same ConfigMap is refused (:class:`~llmd_timeslice.orchestrator.errors.StateConflict`)
instead of silently overwriting or being overwritten.

:class:`StatePersister` is how the groups write: each transition awaits ``save()``; writes run in a
worker thread (never blocking the event loop) and coalesce: while one write is in flight, every
transition that asks for one is covered by the next single write of the then-current state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from llmd_timeslice.orchestrator.errors import StateConflict

log = logging.getLogger(__name__)


class StateStore(Protocol):
    """Blocking load/save of the JSON state (called from a worker thread by :class:`StatePersister`)."""

    def load(self) -> dict | None: ...
    def save(self, state: dict) -> None: ...


class StatePersister:
    """Writes ``snapshot()`` to ``store`` when asked: awaited, coalesced, off the event loop.

    Args:
        store: where the state goes (its ``save`` runs in a worker thread).
        snapshot: builds the state to write (called in the event loop, right before each write).

    ``await save()`` returns once a write that started after the call has finished, and raises what that
    write raised. ``request()`` asks for a write without waiting (the writer task is kept here).
    """

    def __init__(self, store: StateStore, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.store = store
        self._snapshot = snapshot
        self._requested = 0
        self._written = 0
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None
        self.writes = 0
        self.failures = 0

    def request(self) -> asyncio.Future[None]:
        """Ask for a write of the current state; the returned future ends with it."""
        self._requested += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((self._requested, fut))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_loop(), name="state-writer")
        return fut

    async def save(self) -> None:
        """Write the current state (coalesced with concurrent calls). Raises what the store raised."""
        await self.request()

    async def _write_loop(self) -> None:
        while self._written < self._requested:
            generation = self._requested
            error: BaseException | None = None
            try:
                state = self._snapshot()
                await asyncio.to_thread(self.store.save, state)
                self.writes += 1
            except Exception as exc:
                self.failures += 1
                error = exc
            self._written = generation
            keep = []
            for gen, fut in self._waiting:
                if gen > generation:
                    keep.append((gen, fut))
                elif not fut.done():
                    if error is None:
                        fut.set_result(None)
                    else:
                        fut.set_exception(error)
                        fut.exception()  # a request() nobody awaits must not warn
            self._waiting = keep

    async def close(self) -> None:
        """Finish the write in flight (if any)."""
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)


class FileStateStore:
    """JSON file; ``load()`` returns None when the file does not exist yet.

    Raises (on load): ValueError naming the file when it is not valid JSON — the orchestrator then
    refuses to start rather than forget who holds which group.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def load(self) -> dict | None:
        if not self.path.exists():
            return None
        try:
            return json.loads(self.path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"orchestrator state file {self.path} is not valid JSON ({exc}); fix or remove it "
                "(removing it forgets current holders: samplers are woken at start)"
            ) from exc

    def save(self, state: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(state, f)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class ConfigMapStateStore:
    """Cluster mode: the snapshot in a ConfigMap (key ``state.json``) through the official ``kubernetes``
    client. RBAC: ``get``, ``create``, ``update`` on that ConfigMap (the guide's Role names it).

    Optimistic concurrency (the Kubernetes way): ``load()`` remembers the object's ``metadata.resourceVersion``
    and every ``save()`` replaces the object *at that version* (then remembers the new one). If someone else
    wrote it meanwhile, the API server answers 409 Conflict and ``save()`` raises
    :class:`~llmd_timeslice.orchestrator.errors.StateConflict` without writing; a ``create`` that finds the
    object already there (another writer created it first) is a conflict too. Calls are blocking HTTP; the
    orchestrator makes them from a worker thread (:class:`StatePersister`). Other failures raise
    ``RuntimeError`` naming the HTTP status (and the RBAC verb on 403).

    Args:
        api_client: a ``kubernetes.client.ApiClient`` (see ``discovery.kubernetes.make_api_client``).
        namespace, name: where the ConfigMap lives.
        request_timeout_s: most seconds one API call may take (an API server that does not answer fails the
            save instead of hanging it: a grant is then refused, and a deposed leader's stop is not held up).
    """

    KEY = "state.json"

    def __init__(
        self, api_client, namespace: str, name: str = "llmd-timeslice-orchestrator-state", request_timeout_s: float = 10.0
    ) -> None:
        from kubernetes import client

        self._api = client.CoreV1Api(api_client)
        self.request_timeout_s = request_timeout_s
        self.namespace, self.name = namespace, name
        self.resource_version: str | None = None
        """The version last read or written (None: not read yet, or the ConfigMap does not exist)."""

    def load(self) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        try:
            cm = self._api.read_namespaced_config_map(self.name, self.namespace, _request_timeout=self.request_timeout_s)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise RuntimeError(
                f"reading ConfigMap {self.namespace}/{self.name}: HTTP {exc.status} {exc.reason}"
                + (" (RBAC: the orchestrator needs `get` on configmaps)" if exc.status == 403 else "")
            ) from None
        self.resource_version = cm.metadata.resource_version if cm.metadata is not None else None
        raw = (cm.data or {}).get(self.KEY)
        if not raw:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"ConfigMap {self.namespace}/{self.name} key {self.KEY} is not valid JSON ({exc}); "
                "fix or delete it (deleting forgets current holders)"
            ) from exc

    def save(self, state: dict) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        where = f"ConfigMap {self.namespace}/{self.name}"
        meta = client.V1ObjectMeta(
            name=self.name,
            namespace=self.namespace,
            labels={"app.kubernetes.io/name": "llmd-timeslice"},
            resource_version=self.resource_version,
        )
        body = client.V1ConfigMap(metadata=meta, data={self.KEY: json.dumps(state)})
        try:
            if self.resource_version is None:
                written = self._api.create_namespaced_config_map(self.namespace, body, _request_timeout=self.request_timeout_s)
            else:
                written = self._api.replace_namespaced_config_map(
                    self.name, self.namespace, body, _request_timeout=self.request_timeout_s
                )
        except ApiException as exc:
            if exc.status == 409:
                log.error("saving orchestrator state: %s was written by someone else (409)", where)
                raise StateConflict(
                    f"{where} was changed by another writer since this orchestrator last read or wrote it "
                    f"(HTTP 409 at resourceVersion {self.resource_version or '(new)'}): is a second orchestrator "
                    "running against it? Nothing was overwritten; stop the other one (one replica, strategy "
                    "Recreate), then restart this one so that it reads the current state"
                ) from None
            if exc.status == 404 and self.resource_version is not None:
                self.resource_version = None  # deleted meanwhile: create it again
                return self.save(state)
            log.error("saving orchestrator state to %s failed: HTTP %s", where, exc.status)
            raise RuntimeError(
                f"saving state to {where}: HTTP {exc.status}"
                + (" (RBAC: needs `update`/`create` on configmaps)" if exc.status == 403 else "")
            ) from None
        self.resource_version = written.metadata.resource_version if written.metadata is not None else None
