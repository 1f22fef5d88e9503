"""The environment ``VllmServer`` gives vLLM: kept caches and the executor of the CPU defaults (no vLLM started here:
the real servers of tests/snapshot/test_snapshot_vllm.py and tests/local/test_stack_up.py run with it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llmd_timeslice.engines import vllm_server
from llmd_timeslice.engines.vllm_server import VllmServer, vllm_cache_root


def _venv(tmp_path: Path) -> str:
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    return str(tmp_path / "venv" / "bin" / "python")


def _env(tmp_path: Path, python: str, extra: dict[str, str] | None = None, **kw) -> dict[str, str]:
    server = VllmServer(tmp_path / "model", 8000, tmp_path / "vllm.log", python=python, **kw)
    try:
        return server.environment(extra)
    finally:
        server.stop()  # removes the runtime directory environment() made


def test_caches_live_in_the_vllm_venv_even_when_torch_set_its_tmp_default_in_this_process(tmp_path, monkeypatch):
    monkeypatch.delenv(vllm_server.CACHE_ENV_VAR, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_someone")  # as torch leaves it after a compile
    python = _venv(tmp_path)
    env = _env(tmp_path, python)
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "venv" / "vllm-cache")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "venv" / "vllm-cache" / "inductor")
    assert env["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "0"
    assert env["TMPDIR"] == env["VLLM_RPC_BASE_PATH"] != env["VLLM_CACHE_ROOT"], "sockets stay private to one start"


def test_the_cache_root_variable_and_a_stack_files_env_choose_other_directories(tmp_path, monkeypatch):
    python = _venv(tmp_path)
    monkeypatch.setenv(vllm_server.CACHE_ENV_VAR, str(tmp_path / "elsewhere"))
    assert vllm_cache_root(python) == tmp_path / "elsewhere"
    assert _env(tmp_path, python)["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "elsewhere" / "inductor")
    assert _env(tmp_path, python, extra={"VLLM_CACHE_ROOT": "/mine"})["VLLM_CACHE_ROOT"] == "/mine"


def test_an_interpreter_outside_a_venv_keeps_vllms_own_cache_default(tmp_path, monkeypatch):
    monkeypatch.delenv(vllm_server.CACHE_ENV_VAR, raising=False)
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    (tmp_path / "bin").mkdir()
    python = str(tmp_path / "bin" / "python")  # no pyvenv.cfg beside bin/
    assert vllm_cache_root(python) is None
    env = _env(tmp_path, python)
    assert "VLLM_CACHE_ROOT" not in env
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(env["TMPDIR"])


@pytest.mark.parametrize("cpu_defaults", [True, False])
def test_only_the_cpu_defaults_run_the_model_in_the_engine_core_process(tmp_path, cpu_defaults):
    env = _env(tmp_path, sys.executable, default_args=cpu_defaults)
    assert (env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0") is cpu_defaults
