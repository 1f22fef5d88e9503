"""benchmarks.stream_floor: the do-nothing command floor under the orchestrator's cost per sampler (the scale
benchmark's quick run measures both transports end to end: tests/benchmarks/test_scale_bench.py; here its bad input)."""

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
        (["--spread-ms", "nan"], "--spread-ms"),
        (["--spread-ms", "inf"], "--spread-ms"),
        (["--out", "/proc"], "--out"),
    ],
)
def test_bad_arguments_are_refused_naming_them(args, named, capsys):
    from benchmarks import stream_floor

    with pytest.raises(SystemExit) as exc:
        stream_floor.main(args)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
