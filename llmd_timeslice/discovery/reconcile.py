"""The reconcile loop of Kubernetes discovery: each discovered group snapshot applied to the orchestrator by
one worker per group, failures retried with back-off.

:class:`~llmd_timeslice.discovery.kubernetes.KubernetesDiscovery` watches the pods (list, watch from the last
``resourceVersion``, re-list on ``410 Gone``, back-off on API errors) and hands every changed snapshot to
:meth:`Reconciler.submit` (its ``on_change``). The reconciler turns a snapshot into the desired spec of each
group (a group gone from discovery keeps existing with no samplers: it may hold a lease) and gives it to that
group's worker, in the style of kopf's per-object workers (nolar/kopf ``kopf/_core/reactor/queueing.py``, commit 079390ce,
``watcher`` and ``worker``: one sequential worker per object, objects in parallel, a new event interrupting the
worker's sleeps):

* a worker applies only its group's **latest** desired spec (snapshots that came while it was busy are
  skipped), through :meth:`~llmd_timeslice.orchestrator.groups.Orchestrator.update_spec` (the group's own
  task applies it between phase switches: :mod:`llmd_timeslice.discovery.sync` says how);
* a group that takes long (a switch in flight, a wake of new samplers) holds back only itself;
* a failed apply (**partial failure**: the other groups apply regardless) is logged naming the group,
  counted (``llmd_timeslice_discovery_applies_total{result="error"}``, :attr:`Reconciler.failures`) and
  retried after a doubling wait with jitter (``backoff_s`` up to ``backoff_max_s``) with the then-latest spec,
  until it applies; a newer snapshot for that group cuts the wait short; a success starts the count again.

A spec equal to the group's current one (samplers and settings) is not sent.
"""

from __future__ import annotations

import asyncio
import logging
import random

from prometheus_client import Counter

from llmd_timeslice.discovery.sync import desired_specs, differs
from llmd_timeslice.domain.group_settings import GroupSpec
from llmd_timeslice.orchestrator.groups import Orchestrator

log = logging.getLogger(__name__)

APPLIES = Counter(
    "llmd_timeslice_discovery_applies_total", "Discovered group specs applied to the orchestrator, by result.", ["result"]
)


class Reconciler:
    """Applies discovered group snapshots to an orchestrator, one worker per group (module docstring).

    Args:
        backoff_s / backoff_max_s: first and longest wait (seconds) before a failed apply is tried again
            (doubling, plus up to ``backoff_s`` of jitter).

    :meth:`submit` may be called before :meth:`start` (discovery runs before the orchestrator exists): the
    latest snapshot is kept and applied once started.
    """

    def __init__(self, *, backoff_s: float = 0.5, backoff_max_s: float = 30.0) -> None:
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.orch: Orchestrator | None = None
        self.failures: dict[str, int] = {}
        """Group id -> failed applies so far (all time)."""
        self.last_error: dict[str, str] = {}
        """Group id -> why its last apply failed ("" once one applied)."""
        self._latest: list[GroupSpec] | None = None
        self._workers: dict[str, _GroupWorker] = {}
        self._closed = False

    def start(self, orchestrator: Orchestrator) -> None:
        """Apply to ``orchestrator`` from now on, starting with the latest snapshot submitted."""
        self.orch = orchestrator
        if self._latest is not None:
            self.submit(self._latest)

    def submit(self, specs: list[GroupSpec]) -> None:
        """A new group snapshot (discovery's ``on_change``; called in the event loop): each group's desired spec
        goes to its worker, replacing one it has not applied yet."""
        self._latest = [s.copy() for s in specs]
        if self.orch is None or self._closed:
            return
        for spec in desired_specs(self.orch, self._latest):
            w = self._workers.get(spec.group_id)
            if w is None:
                w = self._workers[spec.group_id] = _GroupWorker(self, spec.group_id)
            w.offer(spec)

    async def settled(self) -> None:
        """Return once every worker applied its latest desired spec (or found nothing to change)."""
        while True:
            busy = [w.idle.wait() for w in self._workers.values() if not w.idle.is_set()]
            if not busy:
                return
            await asyncio.gather(*busy)

    async def close(self) -> None:
        """Stop the workers (an apply in flight is cancelled); later snapshots are ignored."""
        self._closed = True
        tasks = [w.task for w in self._workers.values() if w.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _wait_s(self, attempt: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1)) + random.uniform(0, self.backoff_s)


class _GroupWorker:
    """One group's worker: applies the latest spec offered, retrying failures (see the module docstring)."""

    def __init__(self, owner: Reconciler, group_id: str) -> None:
        self.owner = owner
        self.group_id = group_id
        self.want: GroupSpec | None = None
        self.idle = asyncio.Event()
        self.idle.set()
        self._wake = asyncio.Event()
        self.task: asyncio.Task | None = None

    def offer(self, spec: GroupSpec) -> None:
        self.want = spec
        self.idle.clear()
        self._wake.set()
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run(), name=f"reconcile-{self.group_id}")

    async def _run(self) -> None:
        owner = self.owner
        orch = owner.orch
        assert orch is not None  # offered only once started
        while True:
            await self._wake.wait()
            self._wake.clear()
            spec = self.want
            assert spec is not None
            g = orch.groups.get(self.group_id)
            attempt = 0
            if g is None or differs(g.spec, spec):
                while True:
                    try:
                        await orch.update_spec(spec)
                    except Exception as exc:
                        attempt += 1
                        owner.failures[self.group_id] = owner.failures.get(self.group_id, 0) + 1
                        owner.last_error[self.group_id] = str(exc)
                        APPLIES.labels(result="error").inc()
                        wait_s = owner._wait_s(attempt)
                        log.warning(
                            "group %s: applying the discovered spec failed (attempt %d): %s; retrying in %.1f s",
                            self.group_id,
                            attempt,
                            exc,
                            wait_s,
                        )
                        try:  # a newer spec for this group cuts the wait short
                            await asyncio.wait_for(self._wake.wait(), wait_s)
                        except TimeoutError:
                            pass
                        self._wake.clear()
                        spec = self.want  # the latest by now
                        assert spec is not None
                        continue
                    APPLIES.labels(result="ok").inc()
                    owner.last_error[self.group_id] = ""
                    if attempt:
                        log.info("group %s: discovered spec applied after %d failed attempt(s)", self.group_id, attempt)
                    break
            if not self._wake.is_set():
                self.idle.set()
