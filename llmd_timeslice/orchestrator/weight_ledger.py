"""The weight ledger of one group: the weight versions its jobs published, which one the samplers converge to, the
last one that loaded, a version they rejected, and the problems of a publisher's version kept for its next acquire.

A publish (:meth:`WeightLedger.check_publish`, :meth:`WeightLedger.publish`) records the version the samplers load
at their next wake; that wake's outcome comes back in :meth:`WeightLedger.take_wake`. The records are
:class:`RejectedWeights` and :class:`SyncProblem`. The group's actor
(:class:`~llmd_timeslice.orchestrator.group.Group`) calls it from its handlers, on its one task.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from llmd_timeslice.domain.switches import SwitchRecord
from llmd_timeslice.orchestrator.commands import GROUP_LOGGER
from llmd_timeslice.orchestrator.errors import InvalidArgument, StaleWeightVersion
from llmd_timeslice.weights.update import WeightUpdate

__all__ = ["RejectedWeights", "SyncProblem", "WeightLedger"]

log = logging.getLogger(GROUP_LOGGER)


@dataclass(frozen=True)
class RejectedWeights:
    """A published weight version that samplers refused; ``error`` gives each sampler's reason."""

    version: int
    error: str


@dataclass(frozen=True)
class SyncProblem:
    """One weight-version problem kept for the publisher's next acquire: sampler address -> why, of ``n`` samplers
    woken with ``version``; ``kind``: ``rejected`` (by all; not retried), ``refused`` (those serve their last good
    version) or ``not_loaded`` (those stay out of service). Told only for the samplers still without it then."""

    version: int
    kind: str
    reasons: dict[str, str]
    n: int
    serving: int = 0  # rejected: the version the samplers serve instead

    def text(self, reasons: dict[str, str]) -> str:
        """The message for ``reasons`` (a subset of :attr:`reasons`)."""
        k, v, why = len(reasons), self.version, "; ".join(f"{a}: {e}" for a, e in sorted(reasons.items()))
        if self.kind == "rejected":
            return (
                f"weight version {v} was rejected by {k} of {self.n} sampler(s) and is not retried until a newer "
                f"version is published; they serve version {self.serving}: {why}"
            )
        if self.kind == "refused":
            return f"weight version {v} was refused by {k} of {self.n} sampler(s), which serve their last good version: {why}"
        return (
            f"weight version {v} did not load on {k} of {self.n} sampler(s) woken with it, which stay out of service at "
            f"their old version: {why}"
        )


class WeightLedger:
    """The weight versions of group ``group_id`` (log lines name it)."""

    def __init__(self, group_id: str) -> None:
        self.group_id = group_id
        self.weights: WeightUpdate | None = None
        """The latest published weight version."""
        self.publisher: str | None = None
        """The job that published :attr:`weights`."""
        self.publishers: set[str] = set()
        """Jobs that published a weight version during their last grant (the ``auto`` sleep level policy)."""
        self.published_in_grant = False
        self.last_good: WeightUpdate | None = None
        """The latest version that loaded and nobody rejected."""
        self.rejected: RejectedWeights | None = None
        self.sync_errors: dict[str, list[SyncProblem]] = {}
        """Job -> the problems of the version it published, told at its next acquire."""

    @property
    def target(self) -> WeightUpdate | None:
        """The version every wake converges to: the latest published one, or the last good one while that is
        rejected."""
        if self.weights is not None and self.rejected is not None and self.rejected.version == self.weights.version:
            return self.last_good
        return self.weights

    def ahead_of(self, serving_version: int) -> bool:
        """Whether the target is a version above ``serving_version`` (not served yet)."""
        target = self.target
        return target is not None and serving_version < target.version

    def check_publish(self, weights: object, sampler_versions: Mapping[str, int]) -> WeightUpdate:
        """``weights`` as a version to publish, newer than every one published or served (``sampler_versions``:
        address -> version). Raises InvalidArgument (not a WeightUpdate), StaleWeightVersion."""
        if not isinstance(weights, WeightUpdate):
            raise InvalidArgument("weights must be a WeightUpdate")
        latest = max(self.weights.version if self.weights else 0, max(sampler_versions.values(), default=0))
        if weights.version <= latest:
            raise StaleWeightVersion(
                f"weight version {weights.version} is not newer than group {self.group_id!r}'s "
                f"latest ({latest}); versions must increase"
            )
        return weights

    def publish(self, job: str, weights: WeightUpdate) -> None:
        """``job`` (the holder) publishes ``weights`` (:meth:`check_publish`): the new target; a rejection of an
        older version no longer applies."""
        self.weights = weights
        self.publisher = job
        self.publishers.add(job)
        self.published_in_grant = True
        self.rejected = None

    def new_grant(self) -> None:
        """A job was granted the lease: it has published nothing in this grant yet."""
        self.published_in_grant = False

    def released(self, job: str) -> None:
        """``job`` gave the lease up: one that published nothing in this grant no longer counts as a publisher."""
        if not self.published_in_grant:
            self.publishers.discard(job)

    def take_wake(self, rec: SwitchRecord, serving_version: int) -> None:
        """The outcome of a wake that loaded ``rec.weights`` (the samplers' versions already merged; they serve up to
        ``serving_version`` now): a version nobody could load is rejected (not retried until a newer one is
        published), one that loaded anywhere is the last good one, and the problems are kept for the publisher's next
        acquire."""
        w = rec.weights
        if w is None:
            return
        publisher = self.publisher or rec.job_id
        n = len(rec.sampler_versions)
        loaded = [a for a, v in rec.sampler_versions.items() if v == w.version and a not in rec.sampler_errors]
        problems: list[SyncProblem] = []
        if rec.weights_rejected:
            reasons = "; ".join(f"{a}: {e}" for a, e in sorted(rec.weights_rejected.items()))
            if not loaded and self.weights is not None and w.version == self.weights.version:
                self.rejected = RejectedWeights(w.version, reasons)
                problems.append(SyncProblem(w.version, "rejected", dict(rec.weights_rejected), n, serving_version))
            else:
                problems.append(SyncProblem(w.version, "refused", dict(rec.weights_rejected), n))
            log.error("group=%s %s", self.group_id, problems[-1].text(problems[-1].reasons))
        if loaded and (self.last_good is None or w.version > self.last_good.version):
            self.last_good = w
        if rec.sampler_errors:
            problems.append(SyncProblem(w.version, "not_loaded", dict(rec.sampler_errors), n))
        if problems:
            self.sync_errors[publisher] = problems

    def sync_error_for(self, job: str, out_of_service: Mapping[str, str], versions: Mapping[str, int]) -> str:
        """The weight-version problems kept for ``job`` since it published (popped: told once), about the samplers
        still without that version in service (``out_of_service``: address -> why; ``versions``: address -> the
        version it serves) only: what a repair or a restarted engine fixed meanwhile is not told (logged instead).
        "" when nothing is still wrong."""
        problems = self.sync_errors.pop(job, [])
        texts, repaired = [], []
        for p in problems:
            still = {a: why for a, why in p.reasons.items() if a in out_of_service or versions.get(a, 0) < p.version}
            repaired += sorted(set(p.reasons) - set(still))
            if still:
                texts.append(p.text(still))
        if repaired:
            log.info(
                "group=%s weight-version problems of job %s on %s were repaired before its next acquire: not reported",
                self.group_id,
                job,
                repaired,
            )
        return "; ".join(texts)
