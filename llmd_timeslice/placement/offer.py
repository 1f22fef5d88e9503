"""The accelerators on offer and where a plan's lease groups go on them (no I/O).

An :class:`Offer` is a list of node pools: ``count`` nodes of ``accelerators`` each, with ``host_memory`` bytes of
host memory per node. :func:`parse_offer` reads the command line's short form, ``COUNTxACCELERATORS:HOST_MEMORY``
(``64x8:2TiB``; several pools comma separated).

:func:`place_groups` puts lease groups on nodes, first fit by decreasing size: a group of at most one node's
accelerators goes on one node; a larger group takes whole nodes of one pool (its accelerators a multiple of theirs is
not required: the remainder of its last node stays free for nothing else). The *residency constraint*: the host bytes
of a group (the states of its workers put aside while another one holds it) are spread over its nodes by their
accelerators, and no node may hold more than its host memory. It returns each group's node names, or raises
:class:`DoesNotFit` naming the first group that fits nowhere and why.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ByteSize, ConfigDict, Field, TypeAdapter, ValidationError


class NodePool(BaseModel):
    """``count`` identical nodes: ``accelerators`` each and ``host_memory`` bytes of host memory each."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("node", min_length=1)
    count: int = Field(1, ge=1)
    accelerators: int = Field(ge=1)
    host_memory: ByteSize = Field(ByteSize(2**40), description="Host memory per node (default 1 TiB).")


class Offer(BaseModel):
    """The nodes a plan may use."""

    model_config = ConfigDict(extra="forbid")

    nodes: list[NodePool] = Field(min_length=1)

    @property
    def accelerators(self) -> int:
        """Accelerators offered in all."""
        return sum(p.count * p.accelerators for p in self.nodes)

    def describe(self) -> str:
        """``64 nodes x 8 accelerators, 2.0 TiB host memory each`` (pools joined by ``; ``)."""
        return "; ".join(
            f"{p.count} node{'s' if p.count > 1 else ''} x {p.accelerators} accelerators, "
            f"{p.host_memory.human_readable(decimal=False)} host memory each"
            for p in self.nodes
        )


_SHORT = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*(?::\s*(\S+))?\s*$")


def parse_offer(text: str) -> Offer:
    """``COUNTxACCELERATORS[:HOST_MEMORY]`` pools, comma separated (``64x8:2TiB``, ``2x8:1TiB,4x4:512GiB``).

    Raises:
        ValueError: one line naming the part that is not of that form.
    """
    pools: list[NodePool] = []
    for i, part in enumerate(p for p in text.split(",") if p.strip()):
        m = _SHORT.match(part)
        if not m:
            raise ValueError(f"offer {part.strip()!r}: expected COUNTxACCELERATORS[:HOST_MEMORY], e.g. 64x8:2TiB")
        try:
            memory = TypeAdapter(ByteSize).validate_python(m.group(3)) if m.group(3) else ByteSize(2**40)
            pools.append(NodePool(name=f"pool{i}", count=int(m.group(1)), accelerators=int(m.group(2)), host_memory=memory))
        except ValidationError as exc:
            raise ValueError(f"offer {part.strip()!r}: {exc.errors()[0]['msg']}") from None
    if not pools:
        raise ValueError("offer: no node pool given (e.g. 64x8:2TiB)")
    return Offer(nodes=pools)


class DoesNotFit(ValueError):
    """A group fits on no node of the offer; ``group`` names it, the message says why in one line."""

    def __init__(self, group: str, why: str) -> None:
        super().__init__(f"{group}: {why}")
        self.group = group
        self.why = why


@dataclass(frozen=True)
class GroupNeed:
    """What a lease group needs of the offer: its accelerators and the host bytes of its workers' states."""

    name: str
    accelerators: int
    host_bytes: int


@dataclass
class _Node:
    name: str
    pool: str
    accelerators: int
    host_memory: int
    free_accelerators: int = 0
    free_memory: int = 0
    groups: list[str] = field(default_factory=list)


def _nodes(offer: Offer) -> list[_Node]:
    out = []
    for p in offer.nodes:
        for i in range(p.count):
            name = f"{p.name}-{i}" if p.count > 1 else p.name
            out.append(_Node(name, p.name, p.accelerators, int(p.host_memory), p.accelerators, int(p.host_memory)))
    return out


def fits_anywhere(need: GroupNeed, offer: Offer) -> str | None:
    """Why ``need`` fits on no empty node set of the offer (None: it fits on some, alone)."""
    best_why = None
    for p in offer.nodes:
        n = math.ceil(need.accelerators / p.accelerators)
        if n > p.count:
            best_why = best_why or (
                f"needs {need.accelerators} accelerators, pool {p.name} has {p.count * p.accelerators} "
                f"({p.count} x {p.accelerators})"
            )
            continue
        per_node = need.host_bytes * min(p.accelerators, need.accelerators) / need.accelerators if need.accelerators else 0
        if per_node > p.host_memory:
            best_why = (
                f"its states need {ByteSize(int(per_node)).human_readable(decimal=False)} of host memory per node, "
                f"pool {p.name}'s nodes have {p.host_memory.human_readable(decimal=False)}"
            )
            continue
        return None
    return best_why or "no node pool"


def place_groups(needs: Sequence[GroupNeed], offer: Offer) -> dict[str, list[str]]:
    """Each group's node names (first fit, largest groups first; see the module docstring).

    Raises:
        DoesNotFit: the first group (in that order) with no room left, naming what it needs and what is left.
    """
    nodes = _nodes(offer)
    placed: dict[str, list[str]] = {}
    for need in sorted(needs, key=lambda g: (-g.accelerators, -g.host_bytes, g.name)):
        alone = fits_anywhere(need, offer)
        if alone is not None:
            raise DoesNotFit(need.name, alone)
        chosen = _first_fit(need, nodes)
        if chosen is None:
            free = sum(n.free_accelerators for n in nodes)
            raise DoesNotFit(
                need.name,
                f"needs {need.accelerators} accelerators and "
                f"{ByteSize(need.host_bytes).human_readable(decimal=False)} of host memory; the groups placed before "
                f"it leave {free} accelerators, none with room for it",
            )
        share = need.host_bytes / need.accelerators if need.accelerators else 0.0
        left = need.accelerators
        for n in chosen:
            take = min(left, n.free_accelerators)
            n.free_memory -= math.ceil(share * take)
            n.free_accelerators = 0 if len(chosen) > 1 else n.free_accelerators - take
            n.groups.append(need.name)
            left -= take
        placed[need.name] = [n.name for n in chosen]
    return placed


def _first_fit(need: GroupNeed, nodes: list[_Node]) -> list[_Node] | None:
    share = need.host_bytes / need.accelerators if need.accelerators else 0.0
    for n in nodes:  # within one node
        if need.accelerators <= n.free_accelerators and share * need.accelerators <= n.free_memory:
            return [n]
    by_pool: dict[str, list[_Node]] = {}
    for n in nodes:  # whole empty nodes of one pool
        if n.free_accelerators == n.accelerators and need.accelerators > n.accelerators:
            by_pool.setdefault(n.pool, []).append(n)
    for pool_nodes in by_pool.values():
        k = math.ceil(need.accelerators / pool_nodes[0].accelerators)
        ok = [n for n in pool_nodes if share * min(n.accelerators, need.accelerators) <= n.free_memory]
        if len(ok) >= k:
            return ok[:k]
    return None
