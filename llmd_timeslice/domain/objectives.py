"""Priority objectives of held traffic: which InferenceObjective a request names, its priority band, each band's
longest hold and hold deadline (issue 26; docs/gate.md, "Priority bands"). No I/O here.

One model, three sources: the gate's ``--objectives FILE`` (YAML with ``objectives`` and ``priority_bands``), the
stack file's top-level sections of the same names, and on Kubernetes the pool's InferenceObjective objects
(:func:`objective_from_k8s`; the bands still come from the file).

Facts from the Gateway API Inference Extension (kubernetes-sigs/gateway-api-inference-extension, branch
``release-1.5``, commit 1e46715cf4e14ca7631f84a06c320ac21080008a; the API left that repository's main in #2973,
commit 88fd4792d162):

* kind ``InferenceObjective``, group ``inference.networking.x-k8s.io``, version ``v1alpha2``, plural
  ``inferenceobjectives``, namespaced (``config/crd/bases/inference.networking.x-k8s.io_inferenceobjectives.yaml``);
* ``spec.priority`` (``apix/v1alpha2/inferenceobjective_types.go``): Go ``*int``, CRD ``type: integer`` without a
  format; higher is served first, negative values are allowed, unset is read as 0 by the EPP
  (``pkg/epp/requestcontrol/director.go``, ``getInferenceObjective``); negative means sheddable
  (``pkg/epp/util/request/sheddable.go``, ``IsSheddable``: ``priority < 0``);
* ``spec.poolRef`` ``{group (default inference.networking.k8s.io), kind (default InferencePool), name}``: the EPP
  keeps an objective only when ``poolRef.name`` and ``poolRef.group`` name its pool
  (``pkg/epp/controller/inferenceobjective_reconciler.go``);
* the request header ``x-gateway-inference-objective`` (``pkg/epp/metadata/consts.go``, ``ObjectiveKey``) carries
  the objective's ``metadata.name`` (``pkg/epp/datastore/datastore.go``, ``ObjectiveGet`` keys by name);
* an unknown name: the EPP logs it and serves the request at the default priority 0 (``getInferenceObjective``).
  This gate answers 400 ``unknown_objective`` instead, once it knows objectives at all: a typo otherwise turns
  an eval request into rollout traffic that waits a whole training phase without anyone noticing.

The same kind under the llm-d group (llm-d/llm-d-router, commit ebab687927f5331c1b39defcb579a07951bce56c; moved
there in #1169, commit 0fb6a7c51, first released in v0.9.0):

* group ``llm-d.ai``, version ``v1alpha2``, plural ``inferenceobjectives``, namespaced
  (``config/crd/bases/llm-d.ai_inferenceobjectives.yaml``; ``apix/v1alpha2/doc.go``, ``+groupName=llm-d.ai``);
* the same spec with one difference: ``spec.priority`` is Go ``*int32`` (CRD ``format: int32``), so the API server
  refuses what this project refuses; ``spec.poolRef`` has the same defaults (``apix/v1alpha2/shared_types.go``,
  ``PoolObjectReference``); the EPP's reconciler keeps an objective when ``poolRef.name`` is its pool and
  ``poolRef.group`` its ``--pool-group`` (default ``inference.networking.k8s.io``, ``pkg/epp/server/options.go``),
  for objects of either group (``pkg/epp/controller/inferenceobjective_reconciler.go``);
* which group the EPP reads (``pkg/epp/server/controller_config.go``, ``populateWithDiscovery``): once, at its
  start, it asks the discovery API for ``llm-d.ai/v1alpha2`` then ``inference.networking.x-k8s.io/v1alpha2``
  (``ServerResourcesForGroupVersion``; a group version counts when its resource list has the kind
  ``InferenceObjective``, an error counts as absent) and takes the first found; with both served it reads only
  ``llm-d.ai`` and logs that it ignores the legacy objects; with neither it runs without objectives.
  :data:`GROUP_VERSIONS` keeps that order.

Range: the upstream type is Go ``int`` (64 bits on 64-bit builds, 32 on 32-bit ones) and the API server stores any
int64; this project takes the int32 range, the one every build of the EPP reads the same and the width of
``HoldPressure.band`` / ``YieldRequested.band`` on the wire. Larger values are refused with a line naming them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

OBJECTIVE_HEADER = "x-gateway-inference-objective"
"""Request header naming the request's InferenceObjective (GIE ``pkg/epp/metadata/consts.go``, ``ObjectiveKey``)."""
LLMD_GROUP = "llm-d.ai"
"""InferenceObjective's group in llm-d-router (since v0.9.0): the one its EPP prefers."""
LEGACY_GROUP = "inference.networking.x-k8s.io"
"""InferenceObjective's group in the Gateway API Inference Extension (``release-1.5`` and before)."""
VERSION = "v1alpha2"
GROUP_VERSIONS: tuple[tuple[str, str], ...] = ((LLMD_GROUP, VERSION), (LEGACY_GROUP, VERSION))
"""The group versions that serve InferenceObjective, in the order the EPP prefers them (``controller_config.go``,
``supportedInferenceAPIGVs``)."""
GROUPS: tuple[str, ...] = tuple(g for g, _ in GROUP_VERSIONS)
PLURAL = "inferenceobjectives"
KIND = "InferenceObjective"
POOL_GROUP = "inference.networking.k8s.io"
"""Default ``spec.poolRef.group`` of an InferenceObjective: the group of the InferencePool."""
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
MAX_HOLD_CAP_S = 3600.0
"""Envoy caps a hold (the gate's ``max_hold_s`` is at most this)."""

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

Priority = Annotated[
    int,
    Field(
        ge=INT32_MIN,
        le=INT32_MAX,
        strict=True,
        description="InferenceObjective `spec.priority`: higher first, negative = sheddable (int32 range).",
    ),
]


class ObjectivesError(ValueError):
    """An objectives source is unusable; ``errors`` holds one line per problem (``where: what``)."""

    def __init__(self, errors: list[str], source: str = "objectives") -> None:
        super().__init__("; ".join(f"{source}: {e}" for e in errors))
        self.errors = errors
        self.source = source


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ObjectiveEntry(_Strict):
    """One InferenceObjective as the gate knows it."""

    name: str = Field(
        min_length=1,
        max_length=253,
        description="The objective's name (`metadata.name`; the value of `x-gateway-inference-objective`).",
    )
    pool: str | None = Field(None, min_length=1, description="Its InferencePool (unset: the gate's default pool).")
    priority: Priority = 0
    max_hold_s: float | None = Field(
        None, gt=0, le=MAX_HOLD_CAP_S, description="Longest hold of its requests (unset: its band's), seconds."
    )

    @model_validator(mode="after")
    def _name(self) -> ObjectiveEntry:
        if not _DNS_SUBDOMAIN.match(self.name):
            raise ValueError(
                f"name {self.name!r} is not a Kubernetes object name (lower-case letters, digits, '-' and '.'; "
                "the header names an InferenceObjective's metadata.name)"
            )
        return self


class PriorityBandEntry(_Strict):
    """The settings of one priority band (every request whose objective has this priority)."""

    priority: Priority
    max_hold_s: float | None = Field(
        None, gt=0, le=MAX_HOLD_CAP_S, description="Longest hold in this band (unset: the gate's max_hold_s), seconds."
    )
    hold_deadline_s: float | None = Field(
        None,
        gt=0,
        description="Hold the band should not exceed: the gate tells the orchestrator while the band holds requests "
        "(HoldPressure), which may ask the holder to yield; at most the band's max_hold_s. Unset: none.",
    )

    @model_validator(mode="after")
    def _deadline_within_hold(self) -> PriorityBandEntry:
        if self.hold_deadline_s is not None and self.max_hold_s is not None and self.hold_deadline_s > self.max_hold_s:
            raise ValueError(
                f"hold_deadline_s {self.hold_deadline_s:g} is above the band's max_hold_s {self.max_hold_s:g}: "
                "a request would be refused before its deadline"
            )
        return self


class Objectives(_Strict):
    """``objectives`` and ``priority_bands``: the gate's file, the stack file's sections (docs/gate.md)."""

    objectives: list[ObjectiveEntry] = Field(default_factory=list)
    priority_bands: list[PriorityBandEntry] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> Objectives:
        seen: dict[tuple[str | None, str], int] = {}
        for i, o in enumerate(self.objectives):
            key = (o.pool, o.name)
            if key in seen:
                where = f" of pool {o.pool!r}" if o.pool else ""
                raise ValueError(f"objectives[{i}]: objective {o.name!r}{where} is also objectives[{seen[key]}]")
            seen[key] = i
        bands: dict[int, int] = {}
        for i, b in enumerate(self.priority_bands):
            if b.priority in bands:
                raise ValueError(f"priority_bands[{i}]: band {b.priority} is also priority_bands[{bands[b.priority]}]")
            bands[b.priority] = i
        return self

    def check(self, max_hold_s: float, default_pool: str | None = None) -> list[str]:
        """Problems against a gate whose ``max_hold_s`` (and ``default_pool``) is given: a band's or an objective's
        longest hold above it (Envoy's check and route timeouts are rendered from the gate's), a hold deadline above
        the band's longest hold, an objective without a pool named twice in the default pool. One line each."""
        out = []
        if default_pool is not None:
            seen: dict[tuple[str, str], int] = {}
            for i, o in enumerate(self.objectives):
                key = (o.pool or default_pool, o.name)
                if key in seen and (o.pool is None) != (self.objectives[seen[key]].pool is None):
                    out.append(f"objectives[{i}]: objective {o.name!r} of pool {key[0]!r} is also objectives[{seen[key]}]")
                seen.setdefault(key, i)
        for i, b in enumerate(self.priority_bands):
            if b.max_hold_s is not None and b.max_hold_s > max_hold_s:
                out.append(
                    f"priority_bands[{i}].max_hold_s: {b.max_hold_s:g} is above the gate's max_hold_s {max_hold_s:g} "
                    "(Envoy's timeouts are rendered from the gate's)"
                )
            longest = b.max_hold_s if b.max_hold_s is not None else max_hold_s
            if b.hold_deadline_s is not None and b.hold_deadline_s > longest:
                out.append(
                    f"priority_bands[{i}].hold_deadline_s: {b.hold_deadline_s:g} is above the band's longest hold "
                    f"{longest:g} s: a request would be refused before its deadline"
                )
        for i, o in enumerate(self.objectives):
            if o.max_hold_s is not None and o.max_hold_s > max_hold_s:
                out.append(
                    f"objectives[{i}] ({o.name}).max_hold_s: {o.max_hold_s:g} is above the gate's max_hold_s {max_hold_s:g}"
                )
        return out

    def for_pool(self, pool: str, default_pool: str, max_hold_s: float) -> PoolPriorities:
        """What one pool's gate core needs (:class:`PoolPriorities`): its objectives (those naming ``pool``, and
        those naming none when ``pool`` is ``default_pool``) and every band."""
        bands = {
            b.priority: Band(b.priority, b.max_hold_s if b.max_hold_s is not None else max_hold_s, b.hold_deadline_s)
            for b in self.priority_bands
        }
        pp = PoolPriorities(bands=bands, default_max_hold_s=max_hold_s)
        for o in self.objectives:
            if (o.pool or default_pool) != pool:
                continue
            band = pp.band(o.priority)
            pp.objectives[o.name] = ObjectiveClass(o.name, band, o.max_hold_s if o.max_hold_s is not None else band.max_hold_s)
        return pp

    def merged(self, objectives: list[ObjectiveEntry]) -> Objectives:
        """These bands with ``objectives`` (e.g. the InferenceObjective objects read on Kubernetes) in place of the
        file's own."""
        return Objectives(objectives=objectives, priority_bands=self.priority_bands)


@dataclass(frozen=True, slots=True)
class Band:
    """One band as the gate core uses it: ``priority``, ``max_hold_s`` (seconds), ``hold_deadline_s`` or None."""

    priority: int
    max_hold_s: float
    hold_deadline_s: float | None = None

    @property
    def sheddable(self) -> bool:
        """Negative priority (GIE ``IsSheddable``): refused at once while the pool sleeps."""
        return self.priority < 0


@dataclass(frozen=True, slots=True)
class ObjectiveClass:
    """One objective resolved against its band: ``max_hold_s`` is the objective's own or its band's."""

    name: str
    band: Band
    max_hold_s: float


@dataclass
class PoolPriorities:
    """The objectives of one pool by name and the declared bands by priority; an undeclared band has the gate's
    ``max_hold_s`` and no deadline."""

    bands: dict[int, Band] = field(default_factory=dict)
    objectives: dict[str, ObjectiveClass] = field(default_factory=dict)
    default_max_hold_s: float = 600.0

    def band(self, priority: int) -> Band:
        got = self.bands.get(priority)
        return got if got is not None else Band(priority, self.default_max_hold_s)


def load_objectives(data: Any, source: str = "objectives") -> Objectives:
    """Validate parsed YAML (a mapping with ``objectives`` / ``priority_bands``; None or ``{}``: nothing).

    Raises:
        ObjectivesError: one line per problem, naming the field (``priority_bands[0].hold_deadline_s: ...``).
    """
    from llmd_timeslice import yaml_files

    if data is None:
        return Objectives()
    if not isinstance(data, dict):
        raise ObjectivesError([f"expected a mapping with objectives and priority_bands, got {type(data).__name__}"], source)
    try:
        return Objectives.model_validate(data)
    except ValidationError as exc:
        raise ObjectivesError(yaml_files.validation_lines(exc, Objectives), source) from None


def load_objectives_file(path: str | Path, max_hold_s: float | None = None, default_pool: str | None = None) -> Objectives:
    """Read and validate an objectives file (``llmd-timeslice gate --objectives FILE``); with ``max_hold_s`` (the
    gate's, and its ``default_pool``) also :meth:`Objectives.check`.

    Raises:
        FileNotFoundError: no such file.
        ObjectivesError: not YAML, a key twice, unknown keys, bad values; one line per problem.
    """
    import yaml

    from llmd_timeslice import yaml_files

    try:
        data = yaml_files.load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ObjectivesError([yaml_files.error_text(exc)], str(path)) from None
    objectives = load_objectives(data, str(path))
    if max_hold_s is not None:
        problems = objectives.check(max_hold_s, default_pool)
        if problems:
            raise ObjectivesError(problems, str(path))
    return objectives


def objective_from_k8s(obj: dict) -> tuple[str, ObjectiveEntry]:
    """``(poolRef.group, entry)`` of an InferenceObjective object as the API server returns it, of either group
    (``llm-d.ai/v1alpha2`` or ``inference.networking.x-k8s.io/v1alpha2``: the same spec; see the module docstring).
    ``spec.priority`` unset: 0; ``spec.poolRef.group`` unset (an object stored before its CRD defaulted it):
    ``inference.networking.k8s.io``, the CRDs' default; an annotation ``timeslice.io/max-hold-s`` sets the objective's
    longest hold.

    Raises:
        ObjectivesError: the object does not fit (a priority outside int32, no poolRef.name).
    """
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    ref = spec.get("poolRef") or {}
    name = meta.get("name") or ""
    data: dict[str, Any] = {"name": name, "pool": ref.get("name") or None, "priority": spec.get("priority", 0)}
    raw_hold = (meta.get("annotations") or {}).get(MAX_HOLD_ANNOTATION)
    where = f"InferenceObjective {meta.get('namespace', '')}/{name}"
    if raw_hold is not None:
        try:
            data["max_hold_s"] = float(raw_hold)
        except ValueError:
            raise ObjectivesError([f"annotation {MAX_HOLD_ANNOTATION}: expected seconds, got {raw_hold!r}"], where) from None
    if data["pool"] is None:
        raise ObjectivesError(["spec.poolRef.name: required"], where)
    try:
        entry = ObjectiveEntry.model_validate(data)
    except ValidationError as exc:
        from llmd_timeslice import yaml_files

        lines = [line.replace("priority:", "spec.priority:", 1) for line in yaml_files.validation_lines(exc, ObjectiveEntry)]
        raise ObjectivesError(lines, where) from None
    return ref.get("group") or POOL_GROUP, entry


MAX_HOLD_ANNOTATION = "timeslice.io/max-hold-s"
"""Annotation of an InferenceObjective: its requests' longest hold at the gate, seconds (the API has no such field)."""
