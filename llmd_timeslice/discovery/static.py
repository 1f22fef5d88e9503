"""Static inventory file: groups and their samplers (endpoint + sidecar).

Gates are not listed: each gate replica subscribes to the orchestrator (``--orchestrator``).

YAML (or JSON) shape, validated with unknown keys refused::

    groups:
      - group_id: rollout-0
        sleep_level: 1                 # 1 = offload weights to host, 2 = discard
        sleep_level_policy: auto       # fixed (default) | auto: level 2 for jobs that publish weight versions
        drain_timeout_s: 60
        samplers:
          - {pool: default, address: "127.0.0.1:8001", sidecar: "127.0.0.1:9101", job_id: sampler-0}
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llmd_timeslice import yaml_files
from llmd_timeslice.addresses import check_host_port
from llmd_timeslice.orchestrator.switch import GroupSpec, SamplerEndpoint, SchedulingPolicy, SleepLevelPolicy


class SamplerEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pool: str = "default"
    address: str = Field(description="ip:port the EPP routes to (vLLM's OpenAI server).")
    sidecar: str = Field(description="host:port of the sampler's snapshot sidecar.")
    job_id: str = Field(description="Sampler job id the sidecar serves.")

    _check = field_validator("address", "sidecar")(classmethod(lambda cls, v: check_host_port(v)))


class GroupEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_id: str = Field(min_length=1)
    sleep_level: int = Field(1, ge=1, le=2)
    drain_timeout_s: float = Field(60.0, gt=0, le=3600)
    lease_ttl_s: float = Field(30.0, ge=0, le=3600, description="Lease TTL once the holder heartbeats (0: never expire).")
    policy: Literal["fifo", "priority", "round_robin"] = Field("fifo", description="Scheduling policy of the waiters.")
    job_priorities: dict[str, int] = Field(default_factory=dict, description="Per-job priority (priority policy).")
    sleep_level_policy: Literal["fixed", "auto"] = Field(
        "fixed",
        description="fixed: sleep_level for every job; auto: level 2 (discard) for a job that published a "
        "weight version at its previous grant (the weights will be replaced anyway), else sleep_level.",
    )
    job_sleep_levels: dict[str, Literal[1, 2]] = Field(
        default_factory=dict, description="Per-job sleep level (overrides the policy)."
    )
    samplers: list[SamplerEntry] = Field(default_factory=list)
    # temporary: replaced by the domain model (llmd_timeslice/domain/group_settings.py, GroupSettings)
    yield_request_bands: list[int] | None = None
    yield_request_fraction: float = Field(0.5, gt=0, le=1)
    min_training_s: float = Field(10.0, ge=0, allow_inf_nan=False)
    job_yield_opt_out: list[str] = Field(default_factory=list)


class Inventory(BaseModel):
    """The whole inventory file."""

    model_config = ConfigDict(extra="forbid")
    groups: list[GroupEntry] = Field(min_length=1)

    @field_validator("groups")
    @classmethod
    def _unique(cls, groups: list[GroupEntry]) -> list[GroupEntry]:
        ids = [g.group_id for g in groups]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"duplicate group_id {dup}")
        addrs = [s.address for g in groups for s in g.samplers]
        dup = sorted({a for a in addrs if addrs.count(a) > 1})
        if dup:
            raise ValueError(f"sampler address listed twice: {dup}")
        return groups

    def group_specs(self) -> list[GroupSpec]:
        return [
            GroupSpec(
                g.group_id,
                [SamplerEndpoint(s.pool, s.address, s.sidecar, s.job_id) for s in g.samplers],
                g.sleep_level,
                g.drain_timeout_s,
                g.lease_ttl_s,
                SchedulingPolicy(g.policy),
                dict(g.job_priorities),
                SleepLevelPolicy(g.sleep_level_policy),
                dict(g.job_sleep_levels),
                g.yield_request_bands,  # temporary: replaced by the domain model
                g.yield_request_fraction,
                g.min_training_s,
                list(g.job_yield_opt_out),
            )
            for g in self.groups
        ]


class InventoryError(ValueError):
    """An inventory file is unusable; ``errors`` holds one line per problem (``where: what``), ``path`` the file."""

    def __init__(self, errors: list[str], path: str | Path) -> None:
        super().__init__("; ".join(f"{path}: {e}" for e in errors))
        self.errors = errors
        self.path = path


INVENTORY_KEYS = ("groups",)
"""Top-level keys of an inventory file."""


def looks_like_inventory(data: object) -> bool:
    """Whether parsed YAML is meant as an inventory: a mapping whose only key is ``groups`` (a stack file also has
    ``groups``, but with ``stack`` or ``engines``)."""
    return isinstance(data, dict) and set(data) == set(INVENTORY_KEYS)


def load_inventory(path: str | Path) -> Inventory:
    """Parse and validate an inventory file (through :mod:`llmd_timeslice.yaml_files`: a key given twice is refused).

    Raises:
        FileNotFoundError: no such file.
        InventoryError: not YAML, not a mapping, unknown keys (with the closest known one), missing fields or
            malformed addresses; one line per problem, naming the field (``groups[0].sleep_level: ...``).
    """
    try:
        data = yaml_files.load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise InventoryError([yaml_files.error_text(exc)], path) from None
    if data is None or data == {}:
        raise InventoryError(["the file is empty: an inventory lists its groups (groups: [...])"], path)
    if not isinstance(data, dict):
        raise InventoryError([f"expected a mapping with groups, got {type(data).__name__}"], path)
    try:
        return Inventory.model_validate(data)
    except ValidationError as exc:
        raise InventoryError(yaml_files.validation_lines(exc, Inventory), path) from None
