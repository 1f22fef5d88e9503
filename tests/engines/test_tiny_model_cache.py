"""The tiny Llama's build cache: one build per seed and library versions, a fresh copy for every user of it. The
build itself is exercised by every real-vLLM test (they serve what it writes); here it is counted, not run."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmd_timeslice.engines import tiny_model
from llmd_timeslice.engines.tiny_model import CACHE_ENV_VAR, build_tiny_llama, tiny_model_cache_dir


@pytest.fixture
def builds(monkeypatch) -> list[Path]:
    """Replace the ~6 s build by one writing the required files (their names are what the copy must carry)."""
    done: list[Path] = []

    def fake_build(out_dir: Path, seed: int) -> Path:
        done.append(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir.parent / f".{out_dir.name}.fake"
        tmp.mkdir()
        for name in tiny_model._REQUIRED_FILES:
            (tmp / name).write_text(f"{name} for seed {seed}")
        tiny_model._move_in(tmp, out_dir, seed)
        tmp.rmdir()
        return out_dir

    monkeypatch.setattr(tiny_model, "_build", fake_build)
    return done


def test_a_second_workdir_gets_a_copy_of_the_cached_build_without_building_again(tmp_path, monkeypatch, builds):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    first = build_tiny_llama(tmp_path / "a" / "tiny-llama")
    second = build_tiny_llama(tmp_path / "b" / "tiny-llama")
    assert len(builds) == 1 and builds[0].parent == tmp_path / "cache", builds
    for name in tiny_model._REQUIRED_FILES:
        assert (first / name).read_text() == (second / name).read_text() == f"{name} for seed 0"
    assert not second.is_symlink() and (second / "config.json").stat().st_ino != (first / "config.json").stat().st_ino
    assert tiny_model._is_complete(second, 0)
    build_tiny_llama(tmp_path / "c", seed=1)
    assert len(builds) == 2, "another seed is another build"


def test_an_interrupted_cache_entry_is_built_again_not_copied(tmp_path, monkeypatch, builds):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    build_tiny_llama(tmp_path / "a")
    (builds[0] / tiny_model._MARKER).unlink()  # as if the build had stopped before its last step
    out = build_tiny_llama(tmp_path / "b")
    assert len(builds) == 2 and tiny_model._is_complete(out, 0)


def test_an_empty_cache_variable_builds_in_place(tmp_path, monkeypatch, builds):
    monkeypatch.setenv(CACHE_ENV_VAR, "")
    assert tiny_model_cache_dir() is None
    out = build_tiny_llama(tmp_path / "m")
    assert builds == [out]


def test_the_default_cache_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tiny_model_cache_dir() == tmp_path / "llmd-timeslice" / "tiny-llama"
