"""benchmarks.stream_floor: the do-nothing command floor under the orchestrator's cost per sampler (the scale
benchmark's quick run measures it end to end; here its bad input)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "args,named",
    [
        (["--samplers", "0"], "--samplers"),
        (["--switches", "-1"], "--switches"),
        (["--spread-ms", "-5"], "--spread-ms"),
        (["--transport", "quic"], "--transport"),
        (["--samplers", "many"], "--samplers"),
    ],
)
def test_bad_arguments_are_refused_naming_them(args, named, capsys):
    from benchmarks import stream_floor

    with pytest.raises(SystemExit) as exc:
        stream_floor.main(args)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_a_small_floor_measures_both_transports():
    """Two samplers, two switches, answers spread over 5 ms: each transport's CPU per switch is measured."""
    from benchmarks import stream_floor

    for transport in ("grpc", "tcp"):
        got = stream_floor.measure(2, 2, 0.005, transport)
        assert got["transport"] == transport and got["samplers"] == 2
        assert got["cpu_ms_per_switch"] > 0 and got["cpu_ms_per_sampler_switch"] == got["cpu_ms_per_switch"] / 2
