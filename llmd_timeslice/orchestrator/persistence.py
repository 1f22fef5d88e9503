"""Where the orchestrator's state survives a restart (DESIGN.md §5, invariant 9).

``FileStateStore`` (local and Slurm-style set-ups) writes the JSON snapshot of
:meth:`~llmd_timeslice.orchestrator.groups.Orchestrator.snapshot` atomically (temporary file +
``os.replace``) on every change of a group's holder, lease or state. A Kubernetes object store
(ConfigMap/Lease through the official client) is the cluster-mode counterpart; it is not written yet.
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
