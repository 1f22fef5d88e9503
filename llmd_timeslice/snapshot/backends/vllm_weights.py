"""Weight loaders for the vLLM backend: how a published weight version gets into a sleeping engine.

Both run between ``wake_up?tags=weights`` and ``wake_up?tags=kv_cache`` (the engine takes no
requests then) and return the bytes they moved (None where unknown):

* :class:`FilesWeightLoader` (source ``files``): check the directory's structure against its manifest
  (:func:`~llmd_timeslice.weights.manifest.check_weight_files`: version, every file present at its size,
  readable safetensors headers) *before* vLLM sees it (on vLLM 0.32 a reload that fails -- bad path,
  unreadable or truncated file -- kills the engine core), then ``POST /collective_rpc {"method":
  "reload_weights", "kwargs": {"weights_path": DIR}}`` while the checksum of every byte
  (:meth:`~llmd_timeslice.weights.manifest.CheckedWeights.verify_contents`) runs alongside on threads, reading
  the same files as the engine: one pass over the bytes, not two in series. A version whose bytes fail the
  checksum has been loaded by then: the load fails, the engine stays asleep (kv cache not woken, so nothing is
  served from those weights) with its weights marked unusable, and the next plain wake reloads the last good
  version (docs/weights.md). Needs vLLM's in-place reload with ``weights_path``
  (``vllm/model_executor/model_loader/reload``; checked on vLLM 0.32 CPU) and ``VLLM_SERVER_DEV_MODE=1``.
* :class:`WeightTransferLoader` (source ``vllm_weight_transfer``): vLLM's weight-transfer API
  (``--weight-transfer-config``; NCCL or CUDA IPC engines; GPU): ``POST /init_weight_transfer_engine``
  (once, with ``init_info``), ``/start_weight_update``, ``/update_weights {"update_info": ...}``
  (returns once the trainer's send has arrived), ``/finish_weight_update {"weight_version": "N"}``.
  Routes of ``vllm/entrypoints/rl/online/api_router.py`` (vLLM 0.32, dev mode); vLLM 0.19.1 has
  ``/init_weight_transfer_engine`` and ``/update_weights`` only (``vllm/entrypoints/serve/rlhf/api_router.py``), and
  the loader then sends the update alone (:mod:`~llmd_timeslice.snapshot.backends.vllm_capabilities`). The trainer sends
  (e.g. ``NCCLTrainerWeightTransferEngine``) after its yield returns. Exercised here only against an
  HTTP look-alike: it needs a GPU.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import httpx

from llmd_timeslice.snapshot.backends.base import BackendError
from llmd_timeslice.snapshot.backends.vllm_capabilities import VllmCapabilities
from llmd_timeslice.weights.manifest import WeightManifestError, check_weight_files
from llmd_timeslice.weights.update import SOURCE_FILES, SOURCE_VLLM_WEIGHT_TRANSFER, WeightUpdate


class WeightEngine(Protocol):
    """What a loader needs of the engine (``VllmBackend`` is one): its URL, the routes it serves, a POST that must
    answer 200, and vLLM's ``reload_weights``."""

    base_url: str

    async def capabilities(self) -> VllmCapabilities: ...

    async def post_checked(self, path: str, **kw) -> httpx.Response: ...

    async def reload_weights(self, weights_path: str | None = None, nbytes: int | None = None) -> None: ...


class WeightLoader(Protocol):
    """Loads ``update`` into ``engine`` (asleep, weights woken). Raises BackendError."""

    async def load(self, engine: WeightEngine, update: WeightUpdate) -> int | None: ...


class FilesWeightLoader:
    """Source ``files``: structure check, then vLLM ``reload_weights(weights_path=...)`` with the checksum of every
    byte computed alongside (module doc). ``last_check_s`` holds the seconds the checksum took in the last load
    (it overlaps the reload)."""

    last_check_s: float | None = None

    async def load(self, engine: WeightEngine, update: WeightUpdate) -> int | None:
        try:
            checked = await asyncio.to_thread(check_weight_files, update.location, update.version)
        except WeightManifestError as exc:
            raise BackendError(f"weight version {update.version} not loaded: {exc}") from None
        hashing = asyncio.ensure_future(asyncio.to_thread(self._timed_check, checked))
        try:
            await engine.reload_weights(update.location, checked.bytes)
        finally:
            try:
                nbytes = await hashing  # never left running: its outcome decides the load even when the reload failed
            except WeightManifestError as exc:
                raise BackendError(f"weight version {update.version} failed its manifest check while loading: {exc}") from None
        return nbytes

    def _timed_check(self, checked) -> int:
        t0 = time.perf_counter()
        try:
            return checked.verify_contents()
        finally:
            self.last_check_s = time.perf_counter() - t0


class WeightTransferLoader:
    """Source ``vllm_weight_transfer``: vLLM's start / update / finish sequence.

    Args:
        init_info: given once to ``POST /init_weight_transfer_engine`` (e.g. NCCL ``master_address``,
            ``master_port``, ``rank_offset``, ``world_size``); None when the engine was initialised
            elsewhere.
    """

    def __init__(self, init_info: dict | None = None) -> None:
        self.init_info = init_info
        self._initialised = init_info is None

    async def load(self, engine: WeightEngine, update: WeightUpdate) -> int | None:
        caps = await engine.capabilities()
        if not caps.has("/update_weights"):
            raise BackendError(
                f"weight version {update.version} not loaded: vLLM {caps.version or '(version unknown)'} at "
                f"{engine.base_url} serves no /update_weights (its weight-transfer API; VLLM_SERVER_DEV_MODE=1): "
                "publish it with source 'files'"
            )
        if not self._initialised:
            await engine.post_checked("/init_weight_transfer_engine", json={"init_info": self.init_info})
            self._initialised = True
        # vLLM 0.32 brackets the update with start / finish (finish takes the version label); 0.19.1 has the
        # update alone (vllm_capabilities): the version is then the sidecar's record.
        bracketed = caps.transfer_bracketed
        if bracketed:
            await engine.post_checked("/start_weight_update")
        await engine.post_checked("/update_weights", json={"update_info": update.update_info})
        if bracketed:
            await engine.post_checked("/finish_weight_update", json={"weight_version": str(update.version)})
        return None


def default_loaders(transfer_init_info: dict | None = None) -> dict[str, WeightLoader]:
    """Source name -> loader."""
    return {SOURCE_FILES: FilesWeightLoader(), SOURCE_VLLM_WEIGHT_TRANSFER: WeightTransferLoader(transfer_init_info)}
