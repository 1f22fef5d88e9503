"""A published weight version: a monotonic integer plus where the weights are and how to load them.

The wire form is ``llmd_timeslice.v1alpha1.WeightUpdate`` (weights.proto); this dataclass is what the
client, the orchestrator and the sidecar pass around, validated once at each edge.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from llmd_timeslice.api.llmd_timeslice.v1alpha1 import weights_pb2

SOURCE_FILES = "files"
"""A safetensors directory with a ``weights-manifest.json`` (see :mod:`llmd_timeslice.weights.manifest`)."""
SOURCE_VLLM_WEIGHT_TRANSFER = "vllm_weight_transfer"
"""vLLM's weight-transfer API (NCCL or CUDA IPC engine; GPU set-ups)."""
SOURCES = (SOURCE_FILES, SOURCE_VLLM_WEIGHT_TRANSFER)

MAX_VERSION = 2**62


class InvalidWeightUpdate(ValueError):
    """A weight update is malformed (bad version, unknown source, missing location); the message says which."""


@dataclass(frozen=True)
class WeightUpdate:
    """Weight version ``version`` (> 0, monotonic per group) to load from ``source``.

    ``location``: for ``files`` the directory as the sampler sees it (a shared volume in Kubernetes);
    ``update_info``: for ``vllm_weight_transfer`` the object vLLM's ``POST /update_weights`` takes
    (names, dtype_names, shapes...).
    """

    version: int
    source: str = SOURCE_FILES
    location: str = ""
    update_info: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or not 0 < self.version < MAX_VERSION:
            raise InvalidWeightUpdate(f"weight version must be an integer in [1, 2^62), got {self.version!r}")
        if self.source not in SOURCES:
            raise InvalidWeightUpdate(f"unknown weight source {self.source!r}; known: {', '.join(SOURCES)}")
        if self.source == SOURCE_FILES and not self.location:
            raise InvalidWeightUpdate("a 'files' weight update needs a location (the safetensors directory)")
        if self.source == SOURCE_VLLM_WEIGHT_TRANSFER and not self.update_info:
            raise InvalidWeightUpdate("a 'vllm_weight_transfer' weight update needs update_info (names, dtypes, shapes)")

    def to_pb(self) -> weights_pb2.WeightUpdate:
        return weights_pb2.WeightUpdate(
            version=self.version,
            source=self.source,
            location=self.location,
            update_info_json=json.dumps(self.update_info) if self.update_info else "",
        )

    @classmethod
    def from_pb(cls, msg: weights_pb2.WeightUpdate) -> WeightUpdate:
        """Raises :class:`InvalidWeightUpdate` (also for ``update_info_json`` that is not a JSON object)."""
        info: dict = {}
        if msg.update_info_json:
            try:
                info = json.loads(msg.update_info_json)
            except ValueError as exc:
                raise InvalidWeightUpdate(f"update_info_json is not JSON: {exc}") from None
            if not isinstance(info, dict):
                raise InvalidWeightUpdate("update_info_json must be a JSON object")
        return cls(msg.version, msg.source, msg.location, info)

    def to_json(self) -> dict:
        return {"version": self.version, "source": self.source, "location": self.location, "update_info": self.update_info}

    @classmethod
    def from_json(cls, d: dict) -> WeightUpdate:
        return cls(int(d["version"]), d.get("source", SOURCE_FILES), d.get("location", ""), dict(d.get("update_info") or {}))
