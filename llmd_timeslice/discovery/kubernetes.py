"""Kubernetes discovery: sampler pods found by label and **watched** (not polled); the serving label.

What a pod must carry (the label contract of ``manifests/guides/time-slicing``):

==========================================  ======================================================
``timeslice.io/group`` (label)              the accelerator group (upstream topology label); the
                                            default label selector is just this key
``timeslice.io/role`` (label)               ``sampler`` (set by the ``modelserver/sampler``
                                            component): the pod is one of the group's samplers.
                                            Any other role (``trainer``) only makes the group exist
``timeslice.io/job-id`` (label, optional)   the sampler's job id (upstream label); default: the pod
                                            name, which is what the sidecar patch passes as
                                            ``--job-id=$(POD_NAME)``
``timeslice.io/pool`` (annotation, opt.)    the InferencePool; default ``default_pool``
``timeslice.io/engine-port`` (annotation)   port the EPP routes to on the pod IP; default: the
                                            port named ``http`` (else the first port) of the
                                            container named ``modelserver`` (the llm-d guides'
                                            name), else of one named ``vllm`` (older manifests),
                                            else ``engine_port`` (8000)
``timeslice.io/sidecar-port`` (annotation)  the snapshot sidecar's gRPC port; default: the
                                            container port named ``ts-grpc`` (else
                                            ``sidecar_port``, 9001)
``timeslice.io/sleep-level``,               group settings (annotations on any member pod of the
``timeslice.io/drain-timeout-s``,           group; the lexically first pod wins on conflict, with a
``timeslice.io/lease-ttl-s``,               warning): sleep level 1|2, drain deadline (s), lease TTL
``timeslice.io/scheduling-policy``,         once heartbeating (s, 0: never), ``fifo`` |
``timeslice.io/sleep-level-policy``         ``priority`` | ``round_robin``, ``fixed`` | ``auto``
``timeslice.io/job-priority``,              per-job settings, on the job's own (non-sampler) pods,
``timeslice.io/job-sleep-level``            keyed by its job id: priority under the ``priority``
                                            policy (integer), the samplers' sleep level when this
                                            job acquires (1|2)
``timeslice.io/serving`` (label)            written by :class:`PodLabeler` (label fallback)
==========================================  ======================================================

Upstream's two labels, ``group`` and ``job-id``, are read in each spelling in use or proposed: ``timeslice.io/``
(what upstream's orchestrator selects by today: llm-d-incubation/llm-d-rl-time-slicing (6cf8e9b07c60)
``pkg/timeslice-orchestrator/infrastructure/kubernetes.go``, ``cmd/timesliceorchestrator/main.go``) and the two
domains its issue #43 (open) proposes instead, ``timeslicing.llm-d.ai/`` and ``timeslicing.k8s.io/``
(:data:`UPSTREAM_LABEL_DOMAINS`). A pod whose spellings disagree is skipped with a warning naming both. This
project writes ``timeslice.io/`` (upstream's orchestrator finds no pod by the others yet). A server-side selector
cannot OR two keys: with pods labelled in a new spelling only, set the selector to that key (``--selector
timeslicing.llm-d.ai/group``).

An annotation with a malformed value is ignored with a warning naming the pod, the key and the value
(docs/group-settings.md lists them all).

A pod becomes a member once it is Running with a pod IP and **Ready** (its engine loaded and its
sidecar answering); it stays one, whatever its readiness later (a sleeping engine may fail its
probe), until it is deleted, terminating, finished, or its IP or contract labels change.

Threading. The official ``kubernetes`` client is synchronous (urllib3): a watch is a blocking
read on a long-lived HTTP response. It runs in **one dedicated daemon thread** that lists, watches
(resuming from the last ``resourceVersion``, bookmarks on), re-lists on ``410 Gone`` and backs
off on errors, keeps the pod cache, and hands each *changed* group snapshot (immutable values)
to the event loop with ``loop.call_soon_threadsafe``. Why not ``asyncio.to_thread`` per call: a
watch blocks for minutes, so it would pin a worker of the loop's default executor for the
process's life, and stopping it would still need a second thread to close its socket; one owned
thread keeps the cache single-threaded, is stopped by shutting its socket down
(``Watch.stop()``), and leaves the executor to short calls. The PATCHes of :class:`PodLabeler`
are such short calls and do use ``asyncio.to_thread``. (Release 37 of the client also ships an
aiohttp-based ``kubernetes.aio`` package; it is new in that line, so the long-stable synchronous
API is used here.)
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge
from pydantic import TypeAdapter, ValidationError
from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from llmd_timeslice.domain.group_settings import GroupSettings, GroupSpec, SamplerEndpoint
from llmd_timeslice.watch_rounds import run_rounds, stop_watch_thread

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
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
RBAC_HINT = "Role llmd-timeslice-orchestrator in manifests/guides/time-slicing/base/orchestrator/rbac.yaml"

RELISTS = Counter("llmd_timeslice_discovery_relists_total", "Full pod lists (start, 410 Gone, errors).")
WATCH_ERRORS = Counter("llmd_timeslice_discovery_errors_total", "Kubernetes API errors of discovery.", ["reason"])
MEMBER_PODS = Gauge("llmd_timeslice_discovery_pods", "Pods that are members of a group, by role.", ["role"])
SERVING_PATCHES = Counter("llmd_timeslice_serving_label_patches_total", "Serving label patches.", ["result"])


class KubernetesError(RuntimeError):
    """A Kubernetes API call failed; the message says which call, why and what to fix."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def explain_api_error(exc: Exception, verb: str, what: str, namespace: str) -> KubernetesError:
    """One clear message for a failed call (``verb`` is the RBAC verb the call needs)."""
    status = getattr(exc, "status", None)
    detail = _api_message(exc)
    if status == 403:
        msg = (
            f"kubernetes API refused to {verb} {what} in namespace {namespace!r} (403 Forbidden: {detail}); the "
            f"orchestrator's ServiceAccount needs the RBAC verb {verb!r} on pods there ({RBAC_HINT}"
            + ("; `patch` is added by gateways/label-fallback" if verb == "patch" else "")
            + ")"
        )
    elif status == 401:
        msg = f"kubernetes API did not accept our credentials to {verb} {what} (401 Unauthorized: {detail})"
    elif status == 404:
        msg = f"kubernetes API: {what} not found in namespace {namespace!r} (404: {detail})"
    elif status is not None:
        msg = f"kubernetes API: {verb} {what} in namespace {namespace!r} failed: {status} {detail}"
    else:
        msg = f"kubernetes API unreachable to {verb} {what} in namespace {namespace!r}: {type(exc).__name__}: {exc}"
    return KubernetesError(msg, status)


def _api_message(exc: Exception) -> str:
    body = getattr(exc, "body", None)
    if body:
        try:
            return json.loads(body).get("message") or str(body)[:200]
        except (ValueError, AttributeError):
            return str(body)[:200]
    return str(getattr(exc, "reason", "") or exc)


# --------------------------------------------------------------------------- api client
def default_namespace() -> str:
    """The pod's own namespace in a cluster, else the kubeconfig context's, else ``default``."""
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            ns = f.read().strip()
            if ns:
                return ns
    except OSError:
        pass
    try:
        from kubernetes import config

        _, active = config.list_kube_config_contexts()
        return (active or {}).get("context", {}).get("namespace") or "default"
    except Exception:
        return "default"


def make_api_client(kubeconfig: str | os.PathLike | None = None, host: str | None = None):
    """An ``ApiClient``: ``host`` (tests, ``kubectl proxy``), else in-cluster config, else a kubeconfig.

    Raises:
        KubernetesError: no usable configuration.
    """
    from kubernetes import client, config

    cfg = client.Configuration()
    if host:
        cfg.host = host
        return client.ApiClient(cfg)
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg)
        except config.ConfigException:
            pass
    import yaml

    try:
        config.load_kube_config(config_file=str(kubeconfig) if kubeconfig else None, client_configuration=cfg)
    except (config.ConfigException, OSError, TypeError, yaml.YAMLError) as exc:  # YAMLError: not YAML at all
        raise KubernetesError(
            f"no Kubernetes configuration: not in a cluster and no usable kubeconfig "
            f"({kubeconfig or os.environ.get('KUBECONFIG') or '~/.kube/config'}): {exc}"
        ) from exc
    return client.ApiClient(cfg)


# --------------------------------------------------------------------------- pods -> groups
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


# --------------------------------------------------------------------------- discovery
OnChange = Callable[[list[GroupSpec]], Awaitable[None] | None]


class KubernetesDiscovery:
    """Groups of sampler pods in one namespace, kept current by a list + watch.

    ``await start()`` lists once (and raises :class:`KubernetesError` if that fails: a missing RBAC
    verb, no API server), then a thread watches. Every change of the group snapshot is passed to
    ``on_change`` (sync or async, called in the event loop) and to each ``changes()`` iterator.

    Args:
        namespace: where the pods are.
        api_client: a ``kubernetes.client.ApiClient`` (see :func:`make_api_client`).
        label_selector: server-side selector of candidate pods.
        defaults: what pods do not say themselves.
        watch_timeout_s: server-side timeout of one watch request; the next one resumes from the
            last ``resourceVersion`` (the client's read timeout is 30 s above it).
        backoff_s / backoff_max_s: first and longest wait after an API error (doubling, plus up to ``backoff_s``
            of jitter; tenacity). A watch request that ended without an error starts the count again.
    """

    def __init__(
        self,
        namespace: str,
        api_client,
        *,
        label_selector: str = DEFAULT_LABEL_SELECTOR,
        defaults: DiscoveryDefaults | None = None,
        on_change: OnChange | None = None,
        watch_timeout_s: float = 300.0,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        page_size: int = 500,
    ) -> None:
        from kubernetes import client

        self.namespace = namespace
        self.label_selector = label_selector
        self.defaults = defaults or DiscoveryDefaults()
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.page_size = page_size
        self._core = client.CoreV1Api(api_client)
        # Owned by the watch thread (and by start() before the thread exists).
        self._pods: dict[str, dict] = {}
        self._admitted: set[str] = set()  # uids that were Ready once
        self._rv: str | None = None
        self._last_sent: tuple | None = None
        # Read in the event loop.
        self._groups: list[GroupSpec] = []
        self._pod_by_address: dict[str, str] = {}
        self._subscribers: list[asyncio.Queue] = []
        self._tasks: set[asyncio.Task] = set()  # async on_change calls in flight (kept: never collected mid-flight)
        self.relists = 0
        self.last_error: str = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._watch: Any = None  # the kubernetes.watch.Watch of the open watch request

    # ------------------------------------------------------------------ public
    def groups(self) -> list[GroupSpec]:
        """The current group snapshot (each call returns fresh copies)."""
        return [g.copy() for g in self._groups]

    def pod_for(self, sampler: SamplerEndpoint | str) -> str | None:
        """Name of the pod behind a sampler (or its address), if known."""
        address = sampler if isinstance(sampler, str) else sampler.address
        return self._pod_by_address.get(address)

    async def start(self) -> list[GroupSpec]:
        """List the pods (raises :class:`KubernetesError`), then start watching; returns the groups."""
        self._loop = asyncio.get_running_loop()
        try:
            await asyncio.to_thread(self._relist)
        except Exception as exc:
            raise explain_api_error(exc, "list", "pods", self.namespace) from exc
        snapshot = self._snapshot()
        self._last_sent = snapshot[0]
        self._deliver_now(snapshot)
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name=f"k8s-watch-{self.namespace}", daemon=True)
        self._thread.start()
        log.info(
            "kubernetes discovery: namespace=%s selector=%r groups=%s",
            self.namespace,
            self.label_selector,
            {g.group_id: [s.address for s in g.samplers] for g in self._groups},
        )
        return self.groups()

    async def stop(self) -> None:
        """Stop the watch (closes its connection) and end every ``changes()`` iterator."""
        self._stopping.set()
        if self._thread is not None:
            if not await stop_watch_thread(self._thread, self._stopping, lambda: self._watch):
                log.warning("kubernetes discovery: the watch thread did not stop within 5 s (left as a daemon)")
            self._thread = None
        for q in self._subscribers:
            q.put_nowait(None)

    async def changes(self) -> AsyncIterator[list[GroupSpec]]:
        """Each new group snapshot, from now on, until :meth:`stop`."""
        q: asyncio.Queue = asyncio.Queue()
        self._subscribers.append(q)
        try:
            while True:
                item = await q.get()
                if item is None:
                    return
                yield item
        finally:
            self._subscribers.remove(q)

    # ------------------------------------------------------------ watch thread
    def _relist(self) -> None:
        """Full list (paged); replaces the cache and the resourceVersion."""
        pods: dict[str, dict] = {}
        cont = None
        while True:
            kwargs: dict[str, Any] = {
                "label_selector": self.label_selector,
                "limit": self.page_size,
                "_preload_content": False,
                "_request_timeout": (10, 60),
            }
            if cont:
                kwargs["_continue"] = cont
            resp: Any = self._core.list_namespaced_pod(self.namespace, **kwargs)  # raw urllib3 response (no preload)
            try:
                if not 200 <= resp.status <= 299:
                    from kubernetes.client.exceptions import ApiException

                    raise ApiException(http_resp=resp)
                body = json.loads(resp.data)
            finally:
                resp.release_conn()
            for pod in body.get("items") or []:
                pods[_pod_key(pod)] = pod
            meta = body.get("metadata") or {}
            cont = meta.get("continue")
            if not cont:
                self._rv = meta.get("resourceVersion")
                break
        self._pods = pods
        self._admitted &= set(pods)
        self.relists += 1
        RELISTS.inc()

    def _watch_once(self) -> None:
        from kubernetes import watch

        w = watch.Watch()
        self._watch = w
        if self._stopping.is_set():
            return
        try:
            for ev in w.stream(
                self._core.list_namespaced_pod,
                self.namespace,
                label_selector=self.label_selector,
                resource_version=self._rv,
                allow_watch_bookmarks=True,
                timeout_seconds=max(1, int(self.watch_timeout_s)),
                _request_timeout=(10, self.watch_timeout_s + 30),
            ):
                if self._stopping.is_set():
                    return
                kind, obj = ev.get("type"), ev.get("raw_object") or {}
                rv = _meta(obj).get("resourceVersion")
                if kind == "BOOKMARK":
                    self._rv = rv or self._rv
                    continue
                key = _pod_key(obj)
                if kind in ("ADDED", "MODIFIED"):
                    self._pods[key] = obj
                elif kind == "DELETED":
                    self._pods.pop(key, None)
                    self._admitted.discard(key)
                self._rv = rv or self._rv
                self._publish()
        finally:
            self._watch = None

    def _run(self) -> None:
        """The watch thread: rounds of (list if needed, watch) until :meth:`stop`; API errors are retried after a
        doubling, jittered wait that :meth:`stop` cuts short (:func:`~llmd_timeslice.watch_rounds.run_rounds`)."""
        run_rounds(self._round, self._stopping, self.backoff_s, self.backoff_max_s, log)

    def _round(self) -> None:
        """List (when no resourceVersion is known), then one watch request. A 410 Gone ends the round normally
        (the next one re-lists at once); another API error is recorded and raised as :class:`KubernetesError`."""
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
            status = getattr(exc, "status", None)
            if status == 410:
                log.info("kubernetes discovery: watch expired (410 Gone: %s); re-listing", _api_message(exc))
                WATCH_ERRORS.labels(reason="gone").inc()
                self._rv = None
                return
            err = explain_api_error(exc, "watch" if self._rv else "list", "pods", self.namespace)
            self.last_error = str(err)
            WATCH_ERRORS.labels(reason=str(status or type(exc).__name__)).inc()
            raise err from exc

    def _snapshot(self) -> tuple[tuple, list[GroupSpec], dict[str, str]]:
        members = []
        for key, pod in self._pods.items():
            m = pod_member(pod, self.defaults)
            if m is None:
                self._admitted.discard(key)
                continue
            if key not in self._admitted:
                if not _is_ready(pod):
                    continue
                self._admitted.add(key)
            members.append(m)
        specs = build_groups(members, self.defaults)
        by_address = {m.sampler.address: m.name for m in members if m.sampler is not None}
        for role in {m.role or "none" for m in members} | {"sampler"}:
            MEMBER_PODS.labels(role=role).set(sum(1 for m in members if (m.role or "none") == role))
        fingerprint = tuple((g.group_id, tuple(g.samplers), g.settings()) for g in specs)
        return fingerprint, specs, by_address

    def _publish(self) -> None:
        """From the watch thread: hand a changed snapshot to the loop."""
        snapshot = self._snapshot()
        if snapshot[0] == self._last_sent:
            return
        self._last_sent = snapshot[0]
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._deliver_now, snapshot)
            except RuntimeError:  # loop closed meanwhile
                pass

    def _deliver_now(self, snapshot: tuple[tuple, list[GroupSpec], dict[str, str]]) -> None:
        _, specs, by_address = snapshot
        self._groups = specs
        self._pod_by_address = by_address
        if self._thread is None:
            return  # start(): the caller gets the groups as the return value
        log.info("kubernetes discovery: groups now %s", {g.group_id: [s.address for s in g.samplers] for g in specs})
        for q in self._subscribers:
            q.put_nowait(self.groups())
        if self.on_change is not None:
            res = self.on_change(self.groups())
            if asyncio.iscoroutine(res):
                task = asyncio.get_running_loop().create_task(res)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(_log_failure)


def _transient(exc: BaseException) -> bool:
    """An API failure worth repeating: 5xx, 429 or no answer at all (connection)."""
    status = getattr(exc, "status", None)
    return isinstance(exc, Exception) and (status is None or status == 429 or status >= 500)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("discovery on_change failed: %s", task.exception(), exc_info=task.exception())


# --------------------------------------------------------------------------- serving label
class PodLabeler:
    """Keeps ``timeslice.io/serving`` on sampler pods (strategic merge patch on the pod's labels).

    Args:
        namespace: the pods' namespace.
        api_client: a ``kubernetes.client.ApiClient``.
        pod_for: sampler -> pod name (e.g. :meth:`KubernetesDiscovery.pod_for`).
        attempts / backoff_s: tries for transient failures (5xx, 429, connection), doubling wait (tenacity).

    A 403 is never retried: its message names the missing RBAC verb (``patch``). A pod that is gone
    (404) is logged and skipped: a deleted pod serves nothing either way.
    """

    def __init__(
        self,
        namespace: str,
        api_client,
        pod_for: Callable[[SamplerEndpoint], str | None] | None = None,
        attempts: int = 3,
        backoff_s: float = 0.2,
    ) -> None:
        from kubernetes import client

        self.namespace = namespace
        self._core = client.CoreV1Api(api_client)
        self._pod_for = pod_for
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s

    def patch_serving(self, pod: str, serving: bool) -> None:
        """Set the label on one pod (blocking). Raises :class:`KubernetesError`."""
        body = {"metadata": {"labels": {LABEL_SERVING: "true" if serving else "false"}}}
        try:
            for attempt in Retrying(
                retry=retry_if_exception(_transient),
                stop=stop_after_attempt(self.attempts),
                wait=wait_exponential(multiplier=self.backoff_s),
                reraise=True,
            ):
                with attempt:
                    self._core.patch_namespaced_pod(
                        pod, self.namespace, body, _content_type=STRATEGIC_MERGE_PATCH, _request_timeout=(5, 10)
                    )
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                SERVING_PATCHES.labels(result="gone").inc()
                log.warning("serving label: pod %s/%s is gone; nothing to label", self.namespace, pod)
                return
            SERVING_PATCHES.labels(result="error").inc()
            raise explain_api_error(exc, "patch", f"pod {pod!r}", self.namespace) from exc
        SERVING_PATCHES.labels(result="ok").inc()

    async def set_serving(self, sampler: SamplerEndpoint, serving: bool) -> None:
        """The :class:`~llmd_timeslice.orchestrator.actions.ServingLabeler` hook."""
        pod = self._pod_for(sampler) if self._pod_for is not None else None
        if pod is None:
            raise KubernetesError(f"serving label: no pod known for sampler {sampler.address} (job {sampler.job_id})")
        await asyncio.to_thread(self.patch_serving, pod, serving)
