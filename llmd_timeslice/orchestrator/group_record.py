"""A group's persisted record: what survives a restart of the orchestrator, as a JSON-serialisable dict, and how it
is read back into the group's parts.

The record is one entry of the orchestrator's state (:meth:`Orchestrator.snapshot
<llmd_timeslice.orchestrator.groups.Orchestrator.snapshot>`, written by
:mod:`~llmd_timeslice.orchestrator.persistence`). Its keys:

=====================  ==========================================================================================
``state``, ``phase``   the wire state and the phase when saved
``holder``, ``lease``  the lease's job, fencing token, TTL and whether heartbeats armed its expiry
``loaded_job``         whose context the accelerators keep (the holder, or the deferred job of a DEFERRED group)
``last_token``         the latest fencing token handed out
``expired_jobs``       job -> why its lease was reclaimed
``weights``,           the latest published weight version, the last one that loaded, a rejected one (version,
``last_good``,         error), who published the latest
``rejected``,
``weights_publisher``
``sampler_versions``   sampler address -> the weight version it serves
``publishers``         jobs that published during their last grant
=====================  ==========================================================================================

Reading it back (:func:`load_record`) keeps what can be read: a weight version that no longer parses is logged and
left out; samplers no longer in the group are ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from llmd_timeslice.orchestrator.commands import GROUP_LOGGER
from llmd_timeslice.orchestrator.lease_queue import LeaseQueue
from llmd_timeslice.orchestrator.phases import GroupPhase, GroupState
from llmd_timeslice.orchestrator.sampler_fleet import SamplerFleet
from llmd_timeslice.orchestrator.weight_ledger import RejectedWeights, WeightLedger
from llmd_timeslice.weights.update import InvalidWeightUpdate, WeightUpdate

__all__ = ["group_record", "load_record"]

log = logging.getLogger(GROUP_LOGGER)


def group_record(
    state: GroupState, phase: GroupPhase, leases: LeaseQueue, ledger: WeightLedger, fleet: SamplerFleet
) -> dict[str, Any]:
    """The record of a group in ``phase`` (wire ``state``) with these parts."""
    lease = leases.lease
    return {
        "state": state.value,
        "phase": phase.value,
        "holder": leases.holder,
        "loaded_job": leases.deferred_job if phase is GroupPhase.DEFERRED else leases.holder,
        "last_token": leases.last_token,
        "lease": None
        if lease is None
        else {"job_id": lease.job_id, "token": lease.token, "ttl_s": lease.ttl_s, "armed": lease.expires_at is not None},
        "expired_jobs": dict(leases.expired_jobs),
        "weights": None if ledger.weights is None else ledger.weights.to_json(),
        "last_good": None if ledger.last_good is None else ledger.last_good.to_json(),
        "rejected": None if ledger.rejected is None else {"version": ledger.rejected.version, "error": ledger.rejected.error},
        "weights_publisher": ledger.publisher,
        "sampler_versions": dict(fleet.versions),
        "publishers": sorted(ledger.publishers),
    }


def load_record(
    group_id: str, d: dict[str, Any], leases: LeaseQueue, ledger: WeightLedger, fleet: SamplerFleet, known: Collection[str]
) -> GroupPhase | None:
    """Read record ``d`` of group ``group_id``, whose samplers are at ``known`` addresses now, into its parts.
    Returns the phase it restores: HELD (a holder; its lease is granted anew now and, if heartbeats had armed it,
    expires ``ttl_s`` from now), DEFERRED (no samplers, a deferred job's context kept), or None (the group's
    samplers decide)."""
    leases.last_token = int(d.get("last_token", 0))
    leases.expired_jobs = dict(d.get("expired_jobs") or {})
    for attr in ("weights", "last_good"):
        try:
            setattr(ledger, attr, WeightUpdate.from_json(d[attr]) if d.get(attr) else None)
        except (InvalidWeightUpdate, KeyError, TypeError, ValueError) as exc:
            log.error("group=%s persisted %s ignored: %s", group_id, attr, exc)
    rej = d.get("rejected")
    ledger.rejected = RejectedWeights(int(rej["version"]), str(rej.get("error", ""))) if rej else None
    ledger.publisher = d.get("weights_publisher")
    fleet.versions.update({a: int(v) for a, v in (d.get("sampler_versions") or {}).items() if a in known})
    ledger.publishers = set(d.get("publishers") or [])
    lease = d.get("lease")
    if d.get("holder") and lease:
        leases.restore_holder(
            d["holder"], lease["job_id"], int(lease["token"]), float(lease["ttl_s"]), armed=bool(lease.get("armed"))
        )
        return GroupPhase.HELD
    if d.get("state") == GroupState.IDLE_YIELDED.value and not known and d.get("loaded_job"):
        leases.deferred_job = d["loaded_job"]
        return GroupPhase.DEFERRED
    return None
