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

Watching. The pods are one :class:`~llmd_timeslice.informer.Informer` (the list-watch shared with the gate's
InferenceObjective reader): it lists, watches from the last ``resourceVersion`` (bookmarks on), re-lists on ``410
Gone`` and backs off on errors, in a thread of its own that keeps the pod cache; each *changed* group snapshot
(immutable values) is handed to the event loop with ``loop.call_soon_threadsafe``. The PATCHes of
:class:`PodLabeler` are short calls and use ``asyncio.to_thread``. (Release 37 of the client also ships an
aiohttp-based ``kubernetes.aio`` package; it is new in that line, so the long-stable synchronous API is used here.)
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable

from prometheus_client import Counter, Gauge
from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from llmd_timeslice.discovery.pods import (
    ANNOTATION_ENGINE_PORT,
    ANNOTATION_POOL,
    ANNOTATION_SIDECAR_PORT,
    DEFAULT_LABEL_SELECTOR,
    ENGINE_CONTAINERS,
    GROUP_ANNOTATIONS,
    JOB_ANNOTATIONS,
    LABEL_GROUP,
    LABEL_JOB_ID,
    LABEL_ROLE,
    LABEL_SERVING,
    ROLE_SAMPLER,
    SIDECAR_PORT_NAME,
    UPSTREAM_LABEL_DOMAINS,
    DiscoveryDefaults,
    PodMember,
    _is_ready,
    _pod_key,
    build_groups,
    pod_member,
    upstream_label,
)
from llmd_timeslice.domain.group_settings import GroupSpec, SamplerEndpoint
from llmd_timeslice.informer import Informer, Resource, api_message

log = logging.getLogger(__name__)

__all__ = [  # the pod model is re-exported: it was imported from here before the split
    "ANNOTATION_ENGINE_PORT",
    "ANNOTATION_POOL",
    "ANNOTATION_SIDECAR_PORT",
    "DEFAULT_LABEL_SELECTOR",
    "ENGINE_CONTAINERS",
    "GROUP_ANNOTATIONS",
    "JOB_ANNOTATIONS",
    "LABEL_GROUP",
    "LABEL_JOB_ID",
    "LABEL_ROLE",
    "LABEL_SERVING",
    "MEMBER_PODS",
    "RBAC_HINT",
    "RELISTS",
    "ROLE_SAMPLER",
    "SERVING_PATCHES",
    "SIDECAR_PORT_NAME",
    "STRATEGIC_MERGE_PATCH",
    "UPSTREAM_LABEL_DOMAINS",
    "WATCH_ERRORS",
    "DiscoveryDefaults",
    "KubernetesDiscovery",
    "KubernetesError",
    "OnChange",
    "PodLabeler",
    "PodMember",
    "build_groups",
    "default_namespace",
    "explain_api_error",
    "make_api_client",
    "pod_member",
    "upstream_label",
]

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
    detail = api_message(exc)
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
        core = client.CoreV1Api(api_client)
        self._pods = Informer(
            "kubernetes discovery",
            Resource(core.list_namespaced_pod, (namespace,), {"label_selector": label_selector}),
            key=_pod_key,
            on_change=self._changed,
            on_error=self._watch_failed,
            on_gone=lambda: WATCH_ERRORS.labels(reason="gone").inc(),
            watch_timeout_s=watch_timeout_s,
            backoff_s=backoff_s,
            backoff_max_s=backoff_max_s,
            page_size=page_size,
            log=log,
        )
        # Owned by the informer's thread (and by start() before the thread exists).
        self._admitted: set[str] = set()  # uids that were Ready once
        self._last_sent: tuple | None = None
        # Read in the event loop.
        self._groups: list[GroupSpec] = []
        self._pod_by_address: dict[str, str] = {}
        self._subscribers: list[asyncio.Queue] = []
        self._tasks: set[asyncio.Task] = set()  # async on_change calls in flight (kept: never collected mid-flight)
        self.last_error: str = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watching = False

    @property
    def relists(self) -> int:
        """Full pod lists so far (start, 410 Gone, errors)."""
        return self._pods.relists

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
            await asyncio.to_thread(self._pods.list)
        except Exception as exc:
            raise explain_api_error(exc, "list", "pods", self.namespace) from exc
        RELISTS.inc()
        snapshot = self._snapshot()
        self._last_sent = snapshot[0]
        self._deliver_now(snapshot)
        self._watching = True
        self._pods.start()
        log.info(
            "kubernetes discovery: namespace=%s selector=%r groups=%s",
            self.namespace,
            self.label_selector,
            {g.group_id: [s.address for s in g.samplers] for g in self._groups},
        )
        return self.groups()

    async def stop(self) -> None:
        """Stop the watch (closes its connection) and end every ``changes()`` iterator."""
        await self._pods.stop()
        self._watching = False
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

    # ------------------------------------------------------------ the informer's thread
    def _changed(self, relisted: bool) -> None:
        if relisted:
            RELISTS.inc()
        self._publish()

    def _watch_failed(self, exc: Exception, verb: str) -> float:
        """A list or watch failed (not 410 Gone): recorded, then raised as :class:`KubernetesError` for the informer
        to retry after its back-off."""
        err = explain_api_error(exc, verb, "pods", self.namespace)
        self.last_error = str(err)
        WATCH_ERRORS.labels(reason=str(getattr(exc, "status", None) or type(exc).__name__)).inc()
        raise err from exc

    def _snapshot(self) -> tuple[tuple, list[GroupSpec], dict[str, str]]:
        pods = self._pods.objects
        self._admitted &= set(pods)  # a pod deleted or gone from a list is admitted afresh
        members = []
        for key, pod in pods.items():
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
        """From the informer's thread: hand a changed snapshot to the loop."""
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
        if not self._watching:
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
