"""Speculative decoding after a wake (issue 38 §4, vllm-project/vllm#52479): the draft acceptance read from vLLM's
``spec_decode`` counters (a /metrics page shaped like vLLM 0.32's, ``vllm/v1/spec_decode/metrics.py``)."""

from __future__ import annotations

import pytest

from llmd_timeslice.snapshot.backends.base import SuspendMode
from llmd_timeslice.snapshot.backends.vllm import SpecDecodeCollapsed, VllmBackend
from llmd_timeslice.snapshot.backends.vllm_spec_decode import AcceptanceCheck, SpecDecodeCounters, parse_spec_decode
from tests.support.fake_engines import FakeVllm

# The counter families as prometheus-client exposes vLLM 0.32's SpecDecodingProm (two engine cores).
VLLM_PAGE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 40.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 120.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 80.0
# HELP vllm:spec_decode_num_draft_tokens_created Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_created gauge
vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="m"} 1.7e+09
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 90.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 50.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 30.0
"""


def test_counters_from_a_page_shaped_like_vllms_summed_over_engine_cores():
    assert parse_spec_decode(VLLM_PAGE) == SpecDecodeCounters(draft_tokens=200.0, accepted_tokens=140.0)
    assert parse_spec_decode("vllm:num_requests_running 0\n") is None  # speculative decoding off


def test_acceptance_collapse_against_the_versions_reference():
    check = AcceptanceCheck(0.5)
    assert check.observe(3, 0.7) is None  # the reference
    assert check.observe(3, 0.6) is None
    why = check.observe(3, 0.05)
    assert "5% of the probe's draft tokens accepted, against 70%" in why and "vllm#52479" in why
    assert SpecDecodeCounters(200, 140).acceptance_since(SpecDecodeCounters(200, 140)) is None
    with pytest.raises(ValueError, match="spec_decode_min_acceptance_ratio"):
        AcceptanceCheck(2)


async def test_a_wake_whose_acceptance_collapsed_is_reported_and_fails():
    eng = FakeVllm().start()
    eng.spec_tokens = 3
    b = VllmBackend(eng.url, memory_reader=lambda: None)
    try:
        await b.suspend(SuspendMode.DISCARD, [])  # idle: the probe's reference and its acceptance (70%) recorded
        await b.resume([])
        assert b.spec_decode.references == {0: pytest.approx(0.7)}
        eng.collapse_spec_next_wake = True
        await b.suspend(SuspendMode.DISCARD, [])
        with pytest.raises(SpecDecodeCollapsed, match=r"0% of the probe's draft tokens accepted, against 70%"):
            await b.resume([])
    finally:
        await b.close()
        eng.stop()


async def test_without_speculative_decoding_nothing_is_checked():
    eng = FakeVllm().start()
    b = VllmBackend(eng.url, memory_reader=lambda: None)
    try:
        await b.suspend(SuspendMode.OFFLOAD, [])
        await b.resume([])
        assert b.spec_decode.references == {} and b._spec_decode_off
    finally:
        await b.close()
        eng.stop()
