"""Static inventory file: groups and their samplers (endpoint + sidecar).

Gates are not listed: each gate replica subscribes to the orchestrator (``--orchestrator``).

YAML (or JSON) shape, validated with unknown keys refused; each group entry is a
:class:`~llmd_timeslice.domain.group_settings.GroupSpec` (every setting of docs/group-settings.md, its defaults there)::

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

import yaml
from pydantic import ValidationError

from llmd_timeslice import yaml_files
from llmd_timeslice.domain.inventory import Inventory


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
