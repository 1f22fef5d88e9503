"""The pod model of Kubernetes discovery: the labels and annotations a member pod carries, a pod (a dict as the
API server returns it) read into a :class:`PodMember`, and members assembled into groups (:func:`build_groups`). No
I/O; the list-watch that feeds it is :class:`~llmd_timeslice.discovery.kubernetes.KubernetesDiscovery` (whose
module doc gives the labels, annotations and their upstream sources)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from llmd_timeslice.domain.group_settings import GroupSettings, GroupSpec, SamplerEndpoint

log = logging.getLogger(__name__)

LABEL_GROUP = "timeslice.io/group"
LABEL_ROLE = "timeslice.io/role"
LABEL_JOB_ID = "timeslice.io/job-id"
LABEL_SERVING = "timeslice.io/serving"
ANNOTATION_POOL = "timeslice.io/pool"
ANNOTATION_ENGINE_PORT = "timeslice.io/engine-port"
ANNOTATION_SIDECAR_PORT = "timeslice.io/sidecar-port"
ROLE_SAMPLER = "sampler"
SIDECAR_PORT_NAME = "ts-grpc"
ENGINE_CONTAINERS = ("modelserver", "vllm")
"""Names of the vLLM container, in order of preference: ``modelserver`` is what the llm-d guides name it
(llm-d/llm-d ``guides/optimized-baseline/modelserver/gpu/vllm/base``, commit 05b03f75739f); ``vllm`` is kept for
older manifests."""
DEFAULT_LABEL_SELECTOR = LABEL_GROUP
#: The domains upstream's ``group`` / ``job-id`` labels are read under, in order (module doc): today's first, then
#: the two llm-d-rl-time-slicing issue #43 proposes.
UPSTREAM_LABEL_DOMAINS = ("timeslice.io", "timeslicing.llm-d.ai", "timeslicing.k8s.io")


@dataclass(frozen=True)
class DiscoveryDefaults:
    """What a pod does not say itself (durations in seconds)."""

    default_pool: str = "default"
    engine_port: int = 8000
    sidecar_port: int = 9001
    settings: GroupSettings = field(default_factory=GroupSettings)
    """The settings of a group whose pods do not say (the orchestrator's flags may change the defaults)."""


@dataclass(frozen=True)
class PodMember:
    """One member pod, as discovery understood it. ``settings``: the group settings its annotations give
    (field -> value); ``job_settings``: its job's own (field -> this job's value: a map field's entry, or for a
    list field whether the job is in it), for ``job_id``."""

    name: str
    group: str
    role: str
    sampler: SamplerEndpoint | None
    settings: tuple[tuple[str, Any], ...] = ()
    job_id: str = ""
    job_settings: tuple[tuple[str, Any], ...] = ()


def _meta(pod: dict) -> dict:
    return pod.get("metadata") or {}


def _pod_key(pod: dict) -> str:
    """The pod's uid (its name where the uid is missing)."""
    return str(_meta(pod).get("uid") or _meta(pod).get("name") or "")


def _port(value: Any) -> int | None:
    try:
        p = int(str(value))
    except (TypeError, ValueError):
        return None
    return p if 0 < p < 65536 else None


def _annotations(scope: str) -> dict[str, str]:
    return {
        str(extra["annotation"]): name
        for name, f in GroupSettings.model_fields.items()
        if isinstance(extra := f.json_schema_extra, dict) and extra.get("scope") == scope
    }


GROUP_ANNOTATIONS: dict[str, str] = _annotations("group")
"""Annotation -> GroupSettings field: group settings any member pod may carry (declared on the fields of
:class:`~llmd_timeslice.domain.group_settings.GroupSettings`)."""
JOB_ANNOTATIONS: dict[str, str] = _annotations("job")
"""Annotation -> GroupSettings field keyed by job: settings a job's own (non-sampler) pods carry."""
_FLAG = TypeAdapter(bool)


def _group_value(fld: str, text: str) -> Any:
    """The group setting ``fld`` parsed from an annotation (raises ValidationError)."""
    return getattr(GroupSettings.model_validate({fld: text}), fld)


def _job_value(fld: str, job: str, text: str) -> Any:
    """This job's entry of the per-job field ``fld``, parsed from an annotation (raises ValidationError)."""
    if isinstance(getattr(GroupSettings(), fld), list):  # a set of jobs: the annotation says whether this one is in
        return _FLAG.validate_python(text)
    return getattr(GroupSettings.model_validate({fld: {job: text}}), fld)[job]


def _annotation(name: str, ann: dict, key: str, parse: Callable[[str], Any]) -> Any:
    """The parsed value of annotation ``key`` (None when absent, or malformed: logged, naming pod and value)."""
    if key not in ann:
        return None
    try:
        return parse(str(ann[key]).strip())
    except ValidationError as exc:
        why = "; ".join(e["msg"] for e in exc.errors(include_url=False))
        log.warning("pod %s: annotation %s=%r is invalid (%s); ignored", name, key, ann[key], why)
        return None


def _container_port(pod: dict, container: str | None, port_name: str | None) -> int | None:
    for c in (pod.get("spec") or {}).get("containers") or []:
        if container is not None and c.get("name") != container:
            continue
        for p in c.get("ports") or []:
            if port_name is None or p.get("name") == port_name:
                return _port(p.get("containerPort"))
    return None


def _engine_container_port(pod: dict) -> int | None:
    """The engine's port from the first container named as in :data:`ENGINE_CONTAINERS` that exists."""
    names = {c.get("name") for c in (pod.get("spec") or {}).get("containers") or []}
    for container in ENGINE_CONTAINERS:
        if container in names:
            return _container_port(pod, container, "http") or _container_port(pod, container, None)
    return None


def _is_ready(pod: dict) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


class _SpellingsDisagree(ValueError):
    """A pod carries one upstream label in several spellings with different values."""


def upstream_label(labels: dict, name: str) -> str | None:
    """The value of upstream's label ``name`` (``group``, ``job-id``) in any of :data:`UPSTREAM_LABEL_DOMAINS`;
    None when absent or empty. Raises _SpellingsDisagree (naming each key and value) when they differ."""
    found = {k: v for d in UPSTREAM_LABEL_DOMAINS if (v := labels.get(k := f"{d}/{name}"))}
    if len(set(found.values())) > 1:
        raise _SpellingsDisagree(", ".join(f"{k}={v!r}" for k, v in found.items()))
    return next(iter(found.values()), None)


def pod_member(pod: dict, defaults: DiscoveryDefaults) -> PodMember | None:
    """The member a pod makes (readiness not considered), or None when it cannot be one."""
    meta = _meta(pod)
    name = meta.get("name") or ""
    labels = meta.get("labels") or {}
    ann = meta.get("annotations") or {}
    status = pod.get("status") or {}
    try:
        group, job_label = upstream_label(labels, "group"), upstream_label(labels, "job-id")
    except _SpellingsDisagree as exc:
        log.warning("pod %s skipped: its labels spell one upstream label with different values: %s", name, exc)
        return None
    if not group or meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    role = labels.get(LABEL_ROLE, "")
    settings = tuple(
        (fld, v)
        for key, fld in GROUP_ANNOTATIONS.items()
        if (v := _annotation(name, ann, key, functools.partial(_group_value, fld))) is not None
    )
    job_id = job_label or name
    if role != ROLE_SAMPLER:
        job_settings = tuple(
            (fld, v)
            for key, fld in JOB_ANNOTATIONS.items()
            if (v := _annotation(name, ann, key, functools.partial(_job_value, fld, job_id))) is not None
        )
        return PodMember(name, group, role, None, settings, job_id, job_settings)
    ip = status.get("podIP")
    if not ip:
        return None
    engine_port = _port(ann.get(ANNOTATION_ENGINE_PORT)) or _engine_container_port(pod) or defaults.engine_port
    sidecar_port = (
        _port(ann.get(ANNOTATION_SIDECAR_PORT)) or _container_port(pod, None, SIDECAR_PORT_NAME) or defaults.sidecar_port
    )
    host = f"[{ip}]" if ":" in ip else ip
    sampler = SamplerEndpoint(
        pool=ann.get(ANNOTATION_POOL) or defaults.default_pool,
        address=f"{host}:{engine_port}",
        sidecar=f"{host}:{sidecar_port}",
        job_id=job_id,
    )
    return PodMember(name, group, role, sampler, settings, job_id)


def _first_wins(gid: str, what: str, values: dict[str, Any]) -> Any:
    """The value of the lexically first pod in ``values`` (pod name -> value), warning when pods disagree."""
    if any(v != values[min(values)] for v in values.values()):
        log.warning(
            "group %s: pods disagree on the %s (%s); using pod %s's",
            gid,
            what,
            {k: getattr(v, "value", v) for k, v in values.items()},
            min(values),
        )
    return values[min(values)]


def build_groups(members: Iterable[PodMember], defaults: DiscoveryDefaults) -> list[GroupSpec]:
    """Group specs from member pods: samplers sorted by pod name, groups by id, settings from annotations."""
    by_group: dict[str, list[PodMember]] = {}
    for m in sorted(members, key=lambda m: m.name):
        by_group.setdefault(m.group, []).append(m)
    specs = []
    for gid in sorted(by_group):
        ms = by_group[gid]
        spec = GroupSpec(gid)
        spec.apply_settings(defaults.settings)
        for fld in GROUP_ANNOTATIONS.values():
            values = {m.name: dict(m.settings)[fld] for m in ms if fld in dict(m.settings)}
            if values:
                setattr(spec, fld, _first_wins(gid, fld.replace("_", " "), values))
        for fld in JOB_ANNOTATIONS.values():
            by_job: dict[str, dict[str, Any]] = {}
            for m in ms:
                if (v := dict(m.job_settings).get(fld)) is not None:
                    by_job.setdefault(m.job_id, {})[m.name] = v
            target = getattr(spec, fld)
            for job, values in sorted(by_job.items()):
                value = _first_wins(gid, f"{fld.replace('_', ' ')} of job {job}", values)
                if isinstance(target, dict):
                    target[job] = value
                elif value and job not in target:
                    target.append(job)
        seen: set[str] = set()
        for m in ms:
            if m.sampler is None:
                continue
            if m.sampler.address in seen:
                log.warning("group %s: pod %s has the address %s of another pod; skipped", gid, m.name, m.sampler.address)
                continue
            seen.add(m.sampler.address)
            spec.samplers.append(m.sampler)
        specs.append(spec)
    return specs
