"""Where the orchestrator's state survives a restart (DESIGN.md §5, invariant 9).

``FileStateStore`` (local and Slurm-style set-ups) writes the JSON snapshot of
:meth:`~llmd_timeslice.orchestrator.groups.Orchestrator.snapshot` atomically (temporary file +
``os.replace``) on every change of a group's holder, lease or state. ``ConfigMapStateStore`` is
the cluster-mode counterpart (a ConfigMap through the official ``kubernetes`` client).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class StateStore(Protocol):
    def load(self) -> dict | None: ...
    def save(self, state: dict) -> None: ...


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
            raise ValueError(f"orchestrator state file {self.path} is not valid JSON ({exc}); fix or remove it "
                             "(removing it forgets current holders: samplers are woken at start)") from exc

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

    Writes are synchronous HTTP calls from the event loop: they happen once per group state change
    (a few per phase switch), not per request. A write that fails is logged and raises, so the switch
    that caused it fails loudly instead of running on state that would not survive a restart.

    Args:
        api_client: a ``kubernetes.client.ApiClient`` (see ``discovery.kubernetes.make_api_client``).
        namespace, name: where the ConfigMap lives.
    """

    KEY = "state.json"

    def __init__(self, api_client, namespace: str, name: str = "llmd-timeslice-orchestrator-state") -> None:
        from kubernetes import client

        self._api = client.CoreV1Api(api_client)
        self.namespace, self.name = namespace, name

    def load(self) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        try:
            cm = self._api.read_namespaced_config_map(self.name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise RuntimeError(f"reading ConfigMap {self.namespace}/{self.name}: HTTP {exc.status} {exc.reason}"
                               + (" (RBAC: the orchestrator needs `get` on configmaps)" if exc.status == 403 else "")
                               ) from None
        raw = (cm.data or {}).get(self.KEY)
        if not raw:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"ConfigMap {self.namespace}/{self.name} key {self.KEY} is not valid JSON ({exc}); "
                             "fix or delete it (deleting forgets current holders)") from exc

    def save(self, state: dict) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        body = client.V1ConfigMap(metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace,
                                                               labels={"app.kubernetes.io/name": "llmd-timeslice"}),
                                  data={self.KEY: json.dumps(state)})
        try:
            self._api.replace_namespaced_config_map(self.name, self.namespace, body)
        except ApiException as exc:
            if exc.status != 404:
                log.error("saving orchestrator state to ConfigMap %s/%s failed: HTTP %s", self.namespace, self.name,
                          exc.status)
                raise RuntimeError(f"saving state to ConfigMap {self.namespace}/{self.name}: HTTP {exc.status}"
                                   + (" (RBAC: needs `update`/`create` on configmaps)" if exc.status == 403 else "")
                                   ) from None
            self._api.create_namespaced_config_map(self.namespace, body)
