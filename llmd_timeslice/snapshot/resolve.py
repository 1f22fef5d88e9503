"""Which backend serves a job's snapshot/restore, decided per request.

Order (first that applies wins):

1. the request's explicit ``backend_config`` (``app_endpoint`` vLLM/SGLang, ``app_channel``, ``cuda``);
2. a workload registered on ``WorkloadChannel`` for that job;
3. the pod's annotations (a dict given at construction; from the pod's metadata in Kubernetes):
   ``snapshot.timeslice.io/backend`` (pod-wide) or ``snapshot.timeslice.io/backend.<job_id>``
   (one job) = ``vllm`` | ``sglang`` | ``cuda`` | ``workload_channel``, with
   ``snapshot.timeslice.io/endpoint`` (engine URL, default ``http://127.0.0.1:8000``),
   ``snapshot.timeslice.io/pids`` (comma-separated, for ``cuda``) and
   ``snapshot.timeslice.io/mode`` (``offload`` | ``discard``: the mode when the request leaves it unset);
   else upstream's spelling (llm-d-incubation/llm-d-rl-time-slicing PR #159, open: ``pkg/snapshot-agent/utils/
   pod-utils.go`` at d2cbb6fd6697): ``timeslice.io/backend`` = a ``BackendConfig`` field name (``cuda``,
   ``app_endpoint``, ``app_channel``, ``direct_memory``, ...) or ``noop``, with the optional
   ``timeslice.io/backend-config`` holding that field's message as protojson (e.g. ``{"endpoints":
   ["http://localhost:8000"]}`` for ``app_endpoint``). It is resolved as if the request had carried that
   ``BackendConfig``; a malformed config, an unknown name, or one this sidecar does not serve fails the request
   naming the annotation (never a silent fall-through). Ours wins where a pod carries both; this project writes
   ours;
4. the job's default backend (the sidecar's ``--job-id`` / ``--engine-url``).

The mode is always resolved here (never UNSPECIFIED past this point): the request's, else the
registered workload's default, else the annotation's, else OFFLOAD.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import json_format

from llmd_timeslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from llmd_timeslice.snapshot.backends.base import SnapshotBackend, SuspendMode
from llmd_timeslice.snapshot.backends.registry import SNAPSHOT_BACKENDS, backend_class
from llmd_timeslice.snapshot.channel import PB_TO_MODE, WorkloadRegistry

ANNOTATION_PREFIX = "snapshot.timeslice.io/"
#: Upstream's pod annotations naming a job's backend (module doc, 3.).
UPSTREAM_BACKEND_ANNOTATION = "timeslice.io/backend"
UPSTREAM_BACKEND_CONFIG_ANNOTATION = "timeslice.io/backend-config"
DEFAULT_ENDPOINT = "http://127.0.0.1:8000"


class ResolveError(Exception):
    """No backend for this request; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Resolution:
    backend: SnapshotBackend
    mode: SuspendMode
    tags: list[str]
    source: str  # request | workload_channel | annotation | default


class BackendResolver:
    """Resolves (job, request config) to a backend; backends built on demand are kept and reused
    (a restore must reach the instance that did the snapshot, e.g. to know vLLM's sleep level)."""

    def __init__(
        self,
        defaults: dict[str, SnapshotBackend],
        registry: WorkloadRegistry,
        annotations: dict[str, str] | None = None,
        command_timeout_s: float = 300.0,
        backend_kwargs: dict | None = None,
    ) -> None:
        self.defaults = defaults
        self.registry = registry
        self.annotations = dict(annotations or {})
        self.command_timeout_s = command_timeout_s
        self.backend_kwargs = dict(backend_kwargs or {})
        self.built: dict[tuple, SnapshotBackend] = {}

    def _ann(self, key: str, job_id: str | None = None) -> str | None:
        if job_id is not None and (v := self.annotations.get(f"{ANNOTATION_PREFIX}{key}.{job_id}")):
            return v
        return self.annotations.get(ANNOTATION_PREFIX + key)

    def _ann_mode(self) -> SuspendMode | None:
        v = (self._ann("mode") or "").lower()
        return {"offload": SuspendMode.OFFLOAD, "discard": SuspendMode.DISCARD}.get(v)

    def _build(self, name: str, job_id: str, **kw) -> SnapshotBackend:
        target = backend_class(name).target
        if target == "channel":
            key: tuple = (name, job_id)
            if key not in self.built:
                self.built[key] = SNAPSHOT_BACKENDS.create(
                    name, registry=self.registry, job_id=job_id, command_timeout_s=self.command_timeout_s
                )
            return self.built[key]
        key = (name, tuple(kw["pids"])) if target == "pids" else (name, kw["base_url"].rstrip("/"))
        default = self.defaults.get(job_id)
        if default is not None and default.name == name and key[1] == getattr(default, "base_url", None):
            return default
        if key not in self.built:
            extra = self.backend_kwargs if target == "endpoint" else {}
            try:
                self.built[key] = SNAPSHOT_BACKENDS.create(name, **kw, **extra)
            except ValueError as exc:
                raise ResolveError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        return self.built[key]

    def _channel_mode(self, job_id: str) -> SuspendMode:
        ch = self.registry.get(job_id)
        return ch.default_mode if ch is not None else SuspendMode.OFFLOAD

    def _endpoint_backend(self, name: str, job_id: str, endpoints: list[str]) -> SnapshotBackend:
        if len(endpoints) > 1:
            raise ResolveError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(endpoints)} endpoints for job {job_id!r}; a sidecar job has one engine endpoint",
            )
        if endpoints:
            url = endpoints[0] if "://" in endpoints[0] else f"http://{endpoints[0]}"
            return self._build(name, job_id, base_url=url)
        default = self.defaults.get(job_id)
        if default is not None and (default.name == name or default.name not in ("vllm", "sglang")):
            return default  # the job's own engine (or a stand-in for it)
        return self._build(name, job_id, base_url=self._ann("endpoint", job_id) or DEFAULT_ENDPOINT)

    def _pids(self, job_id: str, given: list[int]) -> list[int]:
        pids = list(given) or [int(p) for p in (self._ann("pids", job_id) or "").replace(" ", "").split(",") if p]
        if not pids:
            raise ResolveError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"cuda backend for job {job_id!r} needs pids (explicit_target or the {ANNOTATION_PREFIX}pids annotation)",
            )
        return pids

    def resolve(self, job_id: str, cfg: pb.BackendConfig | None) -> Resolution:
        which = cfg.WhichOneof("backend") if cfg is not None else None
        if cfg is not None and which == "app_endpoint":
            c = cfg.app_endpoint
            if c.app == pb.APP_SGLANG:
                backend = self._endpoint_backend("sglang", job_id, list(c.endpoints))
            elif c.app in (pb.APP_VLLM, pb.APP_UNSPECIFIED):
                if c.app == pb.APP_UNSPECIFIED and not c.endpoints and job_id in self.defaults:
                    backend = self.defaults[job_id]
                else:
                    backend = self._endpoint_backend("vllm", job_id, list(c.endpoints))
            else:
                raise ResolveError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown app {c.app}")
            mode = self._wire_mode(c.mode) or self._ann_mode() or SuspendMode.OFFLOAD
            return Resolution(backend, mode, list(c.tags), "request")
        if cfg is not None and which == "app_channel":
            if self.registry.get(job_id) is None:
                raise ResolveError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"app_channel requested but no workload registered for job {job_id!r} on "
                    "WorkloadChannel; start the trainer's workload client first",
                )
            ch = cfg.app_channel
            mode = self._wire_mode(ch.mode) or self._channel_mode(job_id)
            return Resolution(self._build("workload_channel", job_id), mode, list(ch.tags), "request")
        if cfg is not None and which == "cuda":
            pids = self._pids(job_id, list(cfg.cuda.explicit_target.pids))
            return Resolution(self._build("cuda", job_id, pids=pids), SuspendMode.OFFLOAD, [], "request")
        if which is not None:
            raise ResolveError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"backend config {which!r} is not served by this sidecar "
                "(it serves app_endpoint vLLM/SGLang, app_channel and cuda)",
            )
        if self.registry.get(job_id) is not None:
            return Resolution(self._build("workload_channel", job_id), self._channel_mode(job_id), [], "workload_channel")
        if name := self._ann("backend", job_id):
            mode = self._ann_mode() or SuspendMode.OFFLOAD
            if name not in SNAPSHOT_BACKENDS:
                raise ResolveError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"pod annotation names unknown snapshot backend {name!r}; known: {', '.join(SNAPSHOT_BACKENDS.names())}",
                )
            target = backend_class(name).target  # what the registered backend is built for
            if target == "pids":
                return Resolution(self._build(name, job_id, pids=self._pids(job_id, [])), SuspendMode.OFFLOAD, [], "annotation")
            if target == "endpoint":
                return Resolution(self._endpoint_backend(name, job_id, []), mode, [], "annotation")
            return Resolution(self._build(name, job_id), mode, [], "annotation")
        if upstream := self._upstream_backend_config():
            resolved = self.resolve(job_id, upstream)
            return Resolution(resolved.backend, resolved.mode, resolved.tags, "annotation")
        if job_id in self.defaults:
            return Resolution(self.defaults[job_id], self._ann_mode() or SuspendMode.OFFLOAD, [], "default")
        raise ResolveError(
            grpc.StatusCode.NOT_FOUND,
            f"unknown job {job_id!r} on this sidecar; it serves {sorted(self.defaults)} and registered "
            f"workloads {sorted(self.registry.channels)}",
        )

    def _upstream_backend_config(self) -> pb.BackendConfig | None:
        """The ``BackendConfig`` upstream's ``timeslice.io/backend`` (+ ``-config``) annotations declare, or None
        when the pod declares none. Raises ResolveError naming the annotation: an unknown or unserved name
        (FAILED_PRECONDITION), a config that is not that message's protojson (INVALID_ARGUMENT)."""
        name = (self.annotations.get(UPSTREAM_BACKEND_ANNOTATION) or "").strip()
        if not name:
            return None
        fields = pb.BackendConfig.DESCRIPTOR.oneofs_by_name["backend"].fields
        if name not in {f.name for f in fields}:
            raise ResolveError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"pod annotation {UPSTREAM_BACKEND_ANNOTATION}={name!r} is not a backend this sidecar serves "
                "(it serves app_endpoint, app_channel and cuda; 'noop' is not served)",
            )
        cfg = pb.BackendConfig()
        raw = self.annotations.get(UPSTREAM_BACKEND_CONFIG_ANNOTATION) or "{}"
        try:
            json_format.Parse(raw, getattr(cfg, name))
        except json_format.ParseError as exc:
            raise ResolveError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"pod annotation {UPSTREAM_BACKEND_CONFIG_ANNOTATION} is not protojson of BackendConfig.{name}: {exc}",
            ) from exc
        getattr(cfg, name).SetInParent()  # "{}" still selects the field
        return cfg

    @staticmethod
    def _wire_mode(m: pb.SuspendMode) -> SuspendMode | None:
        if m == pb.SUSPEND_MODE_UNSPECIFIED:
            return None
        if m not in PB_TO_MODE:
            raise ResolveError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown suspend mode {m}")
        return PB_TO_MODE[m]

    async def close(self) -> None:
        for b in [*self.defaults.values(), *self.built.values()]:
            await b.close()
