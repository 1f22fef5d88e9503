"""The vLLM backend's semantic probe: greedy tokens (``temperature 0``, ``ignore_eos``, ``return_token_ids``) of
fixed prompts, through the base model and every LoRA adapter ``GET /v1/models`` lists, compared with a reference
recorded per weight version when that version first served; with speculative decoding, the draft acceptance too
(docs/snapshot.md, "vLLM facts the backend relies on", "Semantic probe").

Raises :class:`ProbeMismatch` (wrong tokens: the engine is put back to sleep at level 2 and its weights marked
unusable) or :class:`SpecDecodeCollapsed`."""

from __future__ import annotations

import logging

from llmd_timeslice.snapshot.backends.base import BackendError
from llmd_timeslice.snapshot.backends.vllm_http import EngineHttp
from llmd_timeslice.snapshot.backends.vllm_spec_decode import AcceptanceCheck, SpecDecodeCounters, parse_spec_decode

log = logging.getLogger(__name__)

PROBE_PROMPTS = ("The capital of France is", "1, 2, 3, 4, 5,", "def fibonacci(n):", "Once upon a time")
"""Fixed prompts of the semantic probe (greedy tokens compared with a reference per weight version)."""
PROBE_TOKENS = 8


class SpecDecodeCollapsed(BackendError):
    """The engine is awake and answers right, but its speculative decoding's draft acceptance collapsed after the
    wake (:mod:`~llmd_timeslice.snapshot.backends.vllm_spec_decode`)."""


class ProbeMismatch(BackendError):
    """The engine's greedy tokens for the probe prompts differ from the reference of the weight version it should
    serve: it is awake but its weights are wrong (a bad reload, corrupted memory)."""


class SemanticProbe(EngineHttp):
    """The probe's part of :class:`~llmd_timeslice.snapshot.backends.vllm.VllmBackend` (which sets the attributes
    below and provides :meth:`sleep`)."""

    probe_prompts: tuple[str, ...]
    probe_tokens: int
    probe_max_mismatched_prompts: int
    probe_references: dict[int, dict[str, list[list[int]]]]
    weight_version: int
    weights_unusable: str | None
    level: int | None
    spec_decode: AcceptanceCheck
    _spec_decode_off: bool

    async def sleep(self, level: int, mode: str | None = None) -> None:
        raise NotImplementedError

    async def _served_models(self) -> list[str]:
        """``GET /v1/models``: the base model's name, then each LoRA adapter's (vLLM lists an adapter with its base
        model in ``parent``: ``vllm/entrypoints/openai/models/serving.py`` in vLLM 0.32)."""
        r = await self._get("/v1/models")
        try:
            cards = r.json()["data"]
            base = [c["id"] for c in cards if not c.get("parent")]
            adapters = sorted(c["id"] for c in cards if c.get("parent"))
        except (ValueError, KeyError, TypeError) as exc:
            raise BackendError(f"vLLM {self.base_url} /v1/models gave no model: {r.text[:200]}") from exc
        if not base:
            raise BackendError(f"vLLM {self.base_url} /v1/models lists no base model: {r.text[:200]}")
        return base[:1] + adapters

    async def _greedy_tokens(self, model: str) -> list[list[int]]:
        """Greedy token ids of each probe prompt through ``model`` (text where the engine returns no token ids)."""
        r = await self._post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": list(self.probe_prompts),
                "max_tokens": self.probe_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        try:
            choices = sorted(r.json()["choices"], key=lambda c: c.get("index", 0))
            out = [list(c["token_ids"]) if c.get("token_ids") is not None else [c["text"]] for c in choices]
        except (ValueError, KeyError, TypeError) as exc:
            raise BackendError(f"vLLM {self.base_url} probe completion is malformed: {r.text[:200]}") from exc
        if len(out) != len(self.probe_prompts):
            raise BackendError(
                f"vLLM {self.base_url} probe completion returned {len(out)} choices for "
                f"{len(self.probe_prompts)} prompts: {r.text[:200]}"
            )
        return out

    async def _probe_tokens(self) -> dict[str, list[list[int]]]:
        """Served model name -> greedy token ids of each probe prompt: the base model and every LoRA adapter."""
        return {m: await self._greedy_tokens(m) for m in await self._served_models()}

    async def _spec_counters(self) -> SpecDecodeCounters | None:
        """The engine's speculative-decoding counters (None: it exports none, i.e. runs without
        ``--speculative-config``; asked once, then never again)."""
        if self._spec_decode_off:
            return None
        counters = parse_spec_decode((await self._get("/metrics")).text)
        self._spec_decode_off = counters is None
        return counters

    async def _probe_tokens_measured(self) -> tuple[dict[str, list[list[int]]], float | None]:
        """:meth:`_probe_tokens` and the draft acceptance over those requests (None: no speculative decoding)."""
        before = await self._spec_counters()
        got = await self._probe_tokens()
        after = await self._spec_counters() if before is not None else None
        return got, (after.acceptance_since(before) if before is not None and after is not None else None)

    async def _probe(self) -> None:
        """The semantic probe (this module's doc): compare with the reference of the version served, or record it. An
        adapter first seen now is recorded; one no longer served is forgotten (a warning: its requests get vLLM's 404)."""
        got, acceptance = await self._probe_tokens_measured()
        ref = self.probe_references.get(self.weight_version)
        if ref is None:
            self.probe_references[self.weight_version] = got
            self.spec_decode.observe(self.weight_version, acceptance)
            return
        for model, tokens in got.items():
            ref.setdefault(model, tokens)
        for model in sorted(set(ref) - set(got)):  # unloaded, or lost with a restart: its requests get vLLM's 404
            log.warning(
                "engine %s no longer serves LoRA adapter %r (GET /v1/models); forgetting its probe reference",
                self.base_url,
                model,
            )
            del ref[model]
        wrong = [(m, i) for m in ref for i, (a, b) in enumerate(zip(ref[m], got[m], strict=True)) if a != b]
        if len(wrong) <= self.probe_max_mismatched_prompts:
            if collapsed := self.spec_decode.observe(self.weight_version, acceptance):
                raise SpecDecodeCollapsed(
                    f"vLLM {self.base_url}: {collapsed}; the endpoint stays out of service: restart the engine (or "
                    "its pod) to load the draft model again"
                )
            return
        base = next(iter(got))
        m, i = wrong[0]
        of = "" if m == base else f" through LoRA adapter {m!r}"
        adapters = [a for a in ref if a != base]
        why = (
            f"vLLM {self.base_url} is awake but answers the probe prompts differently from weight version "
            f"{self.weight_version}'s reference (recorded when that version first served"
            f"{', base model and LoRA adapters ' + ', '.join(map(repr, adapters)) if adapters else ''}): "
            f"{len(wrong)} of {len(ref) * len(self.probe_prompts)} prompts differ, e.g. {self.probe_prompts[i]!r}{of} "
            f"-> {got[m][i]} instead of {ref[m][i]}"
        )
        self.weights_unusable = why
        try:  # out of service and back to a state the next restore repairs: weights discarded, reloaded on wake
            await self.sleep(2, "abort")
            self.level = 2
        except BackendError as exc:
            log.error("engine %s could not be put back to sleep after the failed probe: %s", self.base_url, exc)
        raise ProbeMismatch(
            f"{why}; its weights are wrong (a bad reload?): the engine was put back to sleep and stays "
            "out of service; the next restore reloads its weights"
        )
