"""The snapshot benchmarks run end to end (tiny sizes) and the GPU one exits cleanly without CUDA."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.torch  # in the xdist worker that imports torch (tests/conftest.py)

# torch (through the benchmarks) is imported by the tests that need it: each pytest-xdist worker imports every
# test module, and torch alone is ~2 s of CPU.


def test_snapshot_benchmark_writes_ratio_to_copy_and_first_vs_steady(tmp_path):
    from benchmarks import snapshot

    out = tmp_path / "s.json"
    assert snapshot.main(["--out", str(out), "--params-m", "0.5", "--cycles", "3", "--device", "cpu"]) == 0
    res = json.loads(out.read_text())
    assert set(res["ratio_to_copy"]) == {"offload", "restore"} and res["target_ratio"] == 0.9
    assert res["first_cycle"]["offload_gbps"] > 0 and res["steady_state"]["restore_gbps"] > 0
    assert res["host_buffers_allocated_at_end"] == res["host_buffers_allocated_after_first_cycle"], "buffers reused"


def test_gpu_benchmark_exits_cleanly_without_cuda(tmp_path, capsys):
    import torch

    from benchmarks.gpu import snapshot_gpu

    out = tmp_path / "g.json"
    assert snapshot_gpu.main(["--out", str(out)]) == 0
    if not torch.cuda.is_available():
        assert "skipped" in json.loads(out.read_text())
        assert "CUDA is not available" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,named",
    [
        (["--params-m", "0"], "--params-m"),
        (["--params-m", "-1"], "--params-m"),
        (["--cycles", "2"], "--cycles"),
        (["--cycles", "x"], "--cycles"),
        (["--device", "bogus"], "--device"),
    ],
)
def test_bad_arguments_are_refused_before_the_run_naming_them(args, named, tmp_path, capsys):
    from benchmarks import snapshot

    with pytest.raises(SystemExit) as exc:
        snapshot.main(["--out", str(tmp_path / "s.json"), *args])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()


def test_an_unusable_out_is_refused_before_the_run(tmp_path, capsys):
    from benchmarks import snapshot

    with pytest.raises(SystemExit) as exc:
        snapshot.main(["--out", str(tmp_path)])  # a directory
    assert exc.value.code == 2 and "--out" in capsys.readouterr().err
