"""Weight versions of a group as records: a version samplers refused (:class:`RejectedWeights`) and a problem kept
for a publisher's next acquire (:class:`SyncProblem`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RejectedWeights", "SyncProblem"]


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
