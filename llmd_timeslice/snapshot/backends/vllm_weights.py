"""Weight loaders for the vLLM backend: how a published weight version gets into a sleeping engine.

Both run between ``wake_up?tags=weights`` and ``wake_up?tags=kv_cache`` (the engine takes no
requests then) and return the bytes they moved (None where unknown):

* :class:`FilesWeightLoader` (source ``files``): verify the directory against its manifest
  (:func:`~llmd_timeslice.weights.manifest.verify_weights`, SHA-256 of every file) *before* vLLM sees
  it, then ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``.
  Needs vLLM's in-place reload with ``weights_path`` (``vllm/model_executor/model_loader/reload``;
  checked on vLLM 0.32 CPU, DESIGN.md §7) and ``VLLM_SERVER_DEV_MODE=1``. Verifying first matters:
  on vLLM 0.32 a reload that fails (bad path, unreadable file) kills the engine core.
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
from typing import TYPE_CHECKING, Protocol

from llmd_timeslice.snapshot.backends.base import BackendError
from llmd_timeslice.weights.manifest import WeightManifestError, verify_weights
from llmd_timeslice.weights.update import SOURCE_FILES, SOURCE_VLLM_WEIGHT_TRANSFER, WeightUpdate

if TYPE_CHECKING:
    from llmd_timeslice.snapshot.backends.vllm import VllmBackend


class WeightLoader(Protocol):
    """Loads ``update`` into ``engine`` (asleep, weights woken). Raises BackendError."""

    async def load(self, engine: VllmBackend, update: WeightUpdate) -> int | None: ...


class FilesWeightLoader:
    """Source ``files``: manifest check, then vLLM ``reload_weights(weights_path=...)``."""

    async def load(self, engine: VllmBackend, update: WeightUpdate) -> int | None:
        try:
            nbytes = await asyncio.to_thread(verify_weights, update.location, update.version)
        except WeightManifestError as exc:
            raise BackendError(f"weight version {update.version} not loaded: {exc}") from None
        await engine.reload_weights(update.location)
        return nbytes


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

    async def load(self, engine: VllmBackend, update: WeightUpdate) -> int | None:
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
