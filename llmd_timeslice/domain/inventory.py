"""The inventory: every group with its samplers and settings, as the orchestrator starts with it (no I/O here:
the file loader is :func:`llmd_timeslice.discovery.static.load_inventory`; the stack file and Kubernetes
discovery produce one too)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmd_timeslice.domain.group_settings import GroupSpec


class Inventory(BaseModel):
    """The whole inventory file."""

    model_config = ConfigDict(extra="forbid")
    groups: list[GroupSpec] = Field(min_length=1)

    @field_validator("groups")
    @classmethod
    def _unique(cls, groups: list[GroupSpec]) -> list[GroupSpec]:
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
        """Each group's own copy (the inventory stays as it was read)."""
        return [g.copy() for g in self.groups]
