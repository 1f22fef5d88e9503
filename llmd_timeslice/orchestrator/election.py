"""Leader election of the orchestrator replicas on a ``coordination.k8s.io/v1`` Lease, with a term for fencing.

The election itself is the ``kubernetes`` client's (``kubernetes.leaderelection``, kubernetes 37.0.2:
``leaderelection.py``, ``resourcelock/leaselock.py``): a candidate reads the Lease, takes it when it is free or
its holder has not renewed it for ``leaseDurationSeconds`` (as observed locally), and the leader renews it every
``retry_period_s``, giving up (stepping down) when it could not renew for ``renew_deadline_s``. Every write is a
replace at the ``resourceVersion`` it read, so of two candidates racing for a free Lease the API server lets one
win (the other gets 409 Conflict). That library is synchronous and thread-based and lacks three things this
orchestrator needs; :class:`TermLeaseLock` adds them to the library's ``LeaseLock`` (docs/decisions/leader-election.md):

- an ``ApiClient`` of our own (``LeaseLock`` builds ``CoordinationV1Api()`` on the default configuration);
- ``spec.leaseTransitions`` kept as client-go keeps it (+1 whenever the holder changes;
  k8s.io/client-go tools/leaderelection/leaderelection.go, ``tryAcquireOrRenew``): the library leaves it as it
  was. The **term** of a leader is ``leaseTransitions + 1`` of the Lease it wrote when it took over: it grows
  with every takeover, and the orchestrator sends it with every command (fencing);
- a way out: the library's ``run()`` loops forever (no context to cancel, no release on cancel, unlike
  client-go's ``ReleaseOnCancel``). :meth:`LeaderElector.stop` makes the lock raise, which ends the library's
  loop, and ``release=True`` first hands the Lease back (holder cleared), so a rolling update's new replica
  takes over at its next retry instead of after a whole lease duration.

:class:`LeaderElector` bridges the election thread to the asyncio orchestrator: ``await wait_leading()``
returns the term once this candidate leads; ``lost`` is set (from the thread, through
``loop.call_soon_threadsafe``) when the library stops leading or the lock sees another holder.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

log = logging.getLogger(__name__)


class ElectionStopped(Exception):
    """Raised inside the election thread by the lock once :meth:`LeaderElector.stop` was called."""


class TermLeaseLock(LeaseLock):
    """The library's ``LeaseLock`` (its record format and conversions) with its three calls redone: on our
    ``ApiClient``, each with a timeout, keeping ``leaseTransitions``, and raising :class:`ElectionStopped` once
    stopped. The election logic (when to take, renew, give up) stays the library's.

    Args:
        api_client: a ``kubernetes.client.ApiClient`` (``discovery.kubernetes.make_api_client``).
        name, namespace: the Lease.
        identity: this candidate (unique per process: a restarted process is a new holder, so a new term).
    """

    def __init__(self, api_client, name: str, namespace: str, identity: str) -> None:
        super().__init__(name, namespace, identity)
        self.api_instance = client.CoordinationV1Api(api_client)
        self.stopped = threading.Event()
        self.calling = threading.Lock()
        """Held while one of the library's calls (``get``, ``create``, ``update``) runs: once :attr:`stopped` is set and
        this lock taken, the election thread writes the Lease no more (its next call raises)."""
        self.term = 0
        """``leaseTransitions + 1`` of the Lease this candidate last wrote as holder (0: never held)."""
        self.observed_holder: str | None = None
        self.on_observed: Callable[[str | None], None] | None = None
        """Called in the election thread with the holder read from the Lease."""
        self.request_timeout_s: float | None = None
        """Most seconds one API call may take (the library passes none: a call to an unreachable API server would
        hang, and the leader would never step down by itself); :class:`LeaderElector` sets ``renew_deadline_s``."""

    def _check(self) -> None:
        if self.stopped.is_set():
            raise ElectionStopped

    def get(self, name, namespace):
        with self.calling:
            return self._get(name, namespace)

    def create(self, name, namespace, election_record):
        with self.calling:
            return self._create(name, namespace, election_record)

    def update(self, name, namespace, updated_record):
        with self.calling:
            return self._update(name, namespace, updated_record)

    def _get(self, name, namespace):
        self._check()
        try:
            lease = self.api_instance.read_namespaced_lease(name, namespace, _request_timeout=self.request_timeout_s)
        except Exception as exc:  # ApiException (the library's case) or no answer in time (urllib3): a failed try
            if not isinstance(exc, ApiException):
                log.warning("reading Lease %s/%s: %r", namespace, name, exc)
            return False, exc
        self.lease_reference = lease
        ok, record = True, self.get_lock_object(lease)
        if ok:
            self.observed_holder = record.holder_identity
            if self.on_observed is not None:
                self.on_observed(record.holder_identity)
        return ok, record

    def _create(self, name, namespace, election_record):
        self._check()
        body = client.V1Lease(metadata={"name": name}, spec=self.get_lease_spec(election_record))
        body.spec.lease_transitions = 0
        try:
            self.lease_reference = self.api_instance.create_namespaced_lease(
                namespace, body, _request_timeout=self.request_timeout_s
            )
        except Exception as exc:  # 409 AlreadyExists: another candidate created it first
            log.info("creating Lease %s/%s failed: %s", namespace, name, getattr(exc, "status", repr(exc)))
            return False
        self.term = int(self.lease_reference.spec.lease_transitions or 0) + 1
        return True

    def _update(self, name, namespace, updated_record):
        self._check()
        ref = self.lease_reference
        if ref is None:
            return False
        ref.spec = ref.spec or client.V1LeaseSpec()
        if ref.spec.holder_identity != updated_record.holder_identity:
            ref.spec.lease_transitions = int(ref.spec.lease_transitions or 0) + 1  # as client-go does
        ref.spec = self.get_lease_spec(updated_record, ref.spec)
        try:
            # At the resourceVersion read: a 409 Conflict when another candidate wrote the Lease meanwhile.
            self.api_instance.replace_namespaced_lease(name, namespace, ref, _request_timeout=self.request_timeout_s)
        except Exception as exc:
            log.info("updating Lease %s/%s failed: %s", namespace, name, getattr(exc, "status", repr(exc)))
            return False
        self.term = int(self.lease_reference.spec.lease_transitions or 0) + 1
        return True

    def release(self) -> bool:
        """Clear the holder if it is this candidate (a replace at the version read; a 409 means someone else
        wrote it meanwhile: nothing to release). Returns True when released."""
        try:
            lease = self.api_instance.read_namespaced_lease(self.name, self.namespace, _request_timeout=self.request_timeout_s)
        except Exception as exc:
            log.warning("releasing Lease %s/%s: read failed: %s", self.namespace, self.name, getattr(exc, "status", repr(exc)))
            return False
        if lease.spec is None or lease.spec.holder_identity != self.identity:
            return False
        lease.spec.holder_identity = None
        lease.spec.lease_duration_seconds = 1
        try:
            self.api_instance.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=self.request_timeout_s)
        except Exception as exc:
            log.warning("releasing Lease %s/%s: %s", self.namespace, self.name, getattr(exc, "status", repr(exc)))
            return False
        return True


def check_timings(lease_duration_s: float, renew_deadline_s: float, retry_period_s: float) -> None:
    """The library's own rules (``electionconfig.Config``, which calls ``sys.exit`` instead) as one-line errors.

    Raises:
        ValueError: naming the setting that breaks a rule.
    """
    if int(lease_duration_s) != lease_duration_s:
        raise ValueError(f"lease_duration_s must be whole seconds (the Lease's leaseDurationSeconds), got {lease_duration_s:g}")
    if retry_period_s < 1:
        raise ValueError(f"retry_period_s must be at least 1 s (kubernetes.leaderelection), got {retry_period_s:g}")
    if renew_deadline_s <= 1.2 * retry_period_s:
        raise ValueError(f"renew_deadline_s ({renew_deadline_s:g}) must be above 1.2 x retry_period_s ({1.2 * retry_period_s:g})")
    if lease_duration_s <= renew_deadline_s:
        raise ValueError(f"lease_duration_s ({lease_duration_s:g}) must be above renew_deadline_s ({renew_deadline_s:g})")


class LeaderElector:
    """One candidate of the election, for an asyncio program.

    Args:
        api_client: ``kubernetes.client.ApiClient``.
        namespace, name: the Lease (RBAC: ``get``, ``create``, ``update`` on leases in that namespace).
        identity: this candidate's id (the pod name plus a per-process suffix).
        lease_duration_s: seconds a follower waits, after it last saw the Lease change, before taking it
            (whole seconds; Kubernetes controllers use 15).
        renew_deadline_s: seconds the leader keeps retrying a failed renewal before it steps down (10).
        retry_period_s: seconds between attempts, both to take and to renew (2; at least 1).

    Raises:
        ValueError: timings the library refuses (:func:`check_timings`).
    """

    def __init__(
        self,
        api_client,
        namespace: str,
        name: str,
        identity: str,
        lease_duration_s: float = 15,
        renew_deadline_s: float = 10,
        retry_period_s: float = 2,
    ) -> None:
        check_timings(lease_duration_s, renew_deadline_s, retry_period_s)
        self.identity = identity
        # An ApiClient of its own without urllib3's retries (3 by default): one Lease call takes at most
        # renew_deadline_s, so a leader cut off from the API server gives up after about renew_deadline_s.
        cfg = copy.deepcopy(api_client.configuration)
        cfg.retries = 0
        self._api = client.ApiClient(cfg)
        self.lock = TermLeaseLock(self._api, name, namespace, identity)
        self.lock.request_timeout_s = renew_deadline_s
        self.lease_duration_s, self.renew_deadline_s, self.retry_period_s = (
            int(lease_duration_s),
            renew_deadline_s,
            retry_period_s,
        )
        self.leading = asyncio.Event()
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self.acquired_at: float | None = None  # time.monotonic() when this candidate took the Lease
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def term(self) -> int:
        return self.lock.term if self.leading.is_set() else 0

    @property
    def leader(self) -> str | None:
        """The holder of the Lease as last read (None: free or not read yet)."""
        return self.lock.observed_holder

    def start(self) -> None:
        """Start campaigning (in a daemon thread)."""
        self._loop = asyncio.get_running_loop()
        self.lock.on_observed = self._observed
        cfg = electionconfig.Config(
            self.lock,
            lease_duration=self.lease_duration_s,
            renew_deadline=self.renew_deadline_s,
            retry_period=self.retry_period_s,
            onstarted_leading=self._started,
            onstopped_leading=self._stopped,
        )
        self._thread = threading.Thread(target=self._run, args=(cfg,), name="leader-election", daemon=True)
        self._thread.start()

    def _run(self, cfg: Any) -> None:
        try:
            leaderelection.LeaderElection(cfg).run()
        except ElectionStopped:
            return
        except Exception as exc:  # the library let an API error through: leading (if we were) is over
            log.exception("leader election failed")
            self._lose(f"leader election failed: {exc!r}")
            return
        if not self.lock.stopped.is_set():
            self._lose("the Lease could not be renewed within renew_deadline_s")

    def _started(self) -> None:
        # The library calls this in its own thread after it took the Lease; returning does not end leading.
        self.acquired_at = time.monotonic()
        log.info("%s leads (Lease %s/%s, term %d)", self.identity, self.lock.namespace, self.lock.name, self.lock.term)
        self._call(self.leading.set)

    def _stopped(self) -> None:
        if not self.lock.stopped.is_set():
            self._lose("stopped leading (the Lease could not be renewed in time)")

    def _observed(self, holder: str | None) -> None:
        if self.leading.is_set() and holder != self.identity and not self.lost.is_set():
            self._lose(f"the Lease is held by {holder!r} now")

    def _lose(self, why: str) -> None:
        def set_lost() -> None:
            if not self.lost.is_set():
                self.lost_reason = why
                self.lost.set()

        self._call(set_lost)

    def _call(self, fn) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn)
            except RuntimeError:  # the loop closed meanwhile
                pass

    async def wait_leading(self) -> int:
        """Return this candidate's term once it leads."""
        await self.leading.wait()
        return self.lock.term

    async def stop(self, release: bool = False) -> None:
        """Stop campaigning or leading; with ``release`` (and leading), then hand the Lease back, once no Lease call of
        the election thread is in flight (at most one call's timeout, ``renew_deadline_s``), so that no renewal writes
        it again; not waiting for the thread's sleep between renewals (up to ``retry_period_s``): its next call raises
        :class:`ElectionStopped`.

        Without ``release`` nothing waits for the election thread: it ends at its next call of the lock
        (:class:`ElectionStopped`) or when the call in flight returns. A deposed leader cut off from the API server
        thus exits at once instead of waiting out its hung Lease call (``renew_deadline_s``)."""
        self.lock.stopped.set()
        if not release:
            self._api.close()  # idle connections only: a call in flight ends by itself
            return
        idle = await asyncio.to_thread(self.lock.calling.acquire, True, self.renew_deadline_s + 1.0)
        try:
            if idle and self.leading.is_set() and not self.lost.is_set():
                released = await asyncio.to_thread(self.lock.release)
                log.info("%s released the Lease: %s", self.identity, released)
        finally:
            if idle:
                self.lock.calling.release()
        if idle:
            self._api.close()
