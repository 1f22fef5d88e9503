"""The snapshot backends a sidecar can serve, by name: the one registry that the sidecar's command line
(``llmd-timeslice sidecar --backend``), its per-request resolution (:mod:`llmd_timeslice.snapshot.resolve`) and
the pod annotation ``snapshot.timeslice.io/backend`` choose from (:mod:`llmd_timeslice.plugins`). The in-tree
backends are registered here, explicitly: importing a backend's module registers nothing."""

from __future__ import annotations

from llmd_timeslice.plugins import Registry
from llmd_timeslice.snapshot.backends.base import SnapshotBackend
from llmd_timeslice.snapshot.backends.cuda import CudaCheckpointBackend
from llmd_timeslice.snapshot.backends.sglang import SglangBackend
from llmd_timeslice.snapshot.backends.vllm import VllmBackend
from llmd_timeslice.snapshot.channel import WorkloadChannelBackend

SNAPSHOT_BACKENDS: Registry[SnapshotBackend] = Registry("snapshot backend")
"""Name -> backend class (a class is its factory; its capabilities and ``target`` can be read without building it)."""
for _cls in (VllmBackend, SglangBackend, CudaCheckpointBackend, WorkloadChannelBackend):
    SNAPSHOT_BACKENDS.register(_cls.name, _cls)


def backend_class(name: str) -> type[SnapshotBackend]:
    """The class registered as ``name``. Raises :class:`~llmd_timeslice.plugins.UnknownPlugin` (a ``ValueError``
    whose one line lists the known names)."""
    cls = SNAPSHOT_BACKENDS.factory(name)
    assert isinstance(cls, type) and issubclass(cls, SnapshotBackend)  # every registration above is a class
    return cls


def job_default_backend(name: str, *, engine_url: str, pids: list[int], **engine_kwargs) -> SnapshotBackend | None:
    """A sidecar job's default backend ``name`` (the sidecar's ``--backend``): on the engine at ``engine_url``
    (``endpoint`` backends, with ``engine_kwargs``), on ``pids`` (``pids`` backends), or None for a ``channel``
    backend (the job registers over WorkloadChannel). Raises :class:`~llmd_timeslice.plugins.UnknownPlugin`."""
    target = backend_class(name).target
    if target == "endpoint":
        return SNAPSHOT_BACKENDS.create(name, base_url=engine_url, **engine_kwargs)
    if target == "pids":
        return SNAPSHOT_BACKENDS.create(name, pids=pids)
    return None
