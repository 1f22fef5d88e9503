"""The vLLM backend's HTTP calls to its engine: GET and POST with errors mapped to the backend's exceptions
(:class:`~llmd_timeslice.snapshot.backends.base.EngineUnreachable` when nothing listens,
:class:`~llmd_timeslice.snapshot.backends.base.EngineDead` when the engine core died behind a live API server:
docs/snapshot.md, "vLLM facts the backend relies on"). Every call is named to the operation's deadline
(:func:`~llmd_timeslice.snapshot.backends.deadlines.note_step`)."""

from __future__ import annotations

import httpx

from llmd_timeslice.snapshot.backends.base import BackendError, EngineDead, EngineUnreachable
from llmd_timeslice.snapshot.backends.deadlines import note_step


class EngineHttp:
    """HTTP calls to one vLLM OpenAI server at ``base_url`` over ``_http`` (an ``httpx.AsyncClient`` with that base
    URL: :func:`~llmd_timeslice.snapshot.backends.engine_http.engine_http_client`). A base of
    :class:`~llmd_timeslice.snapshot.backends.vllm.VllmBackend`, which sets both."""

    base_url: str
    _http: httpx.AsyncClient

    async def _get(self, path: str) -> httpx.Response:
        note_step(f"GET {path}")
        try:
            try:
                r = await self._http.get(path)
            except httpx.RemoteProtocolError:
                # A kept-alive connection the engine closed without answering (it was killed, or restarted): a GET
                # is idempotent, so once more on a new connection, which says whether anything listens there now.
                r = await self._http.get(path)
        except httpx.HTTPError as exc:
            kind = EngineUnreachable if isinstance(exc, httpx.ConnectError) else BackendError
            raise kind(
                f"vLLM at {self.base_url} did not answer GET {path}: {exc!r}; is the engine up? "
                "The endpoint stays out of service: restart the engine (or its pod), then restore"
            ) from exc
        await self._raise_if_core_dead("GET", path, r)
        return r

    async def _raise_if_core_dead(self, method: str, path: str, r: httpx.Response) -> None:
        """After an answer >= 500: raise :class:`EngineDead` when ``GET /health`` answers 503 too (docs/snapshot.md,
        "A dead engine core"); else return (the caller handles the answer)."""
        if r.status_code < 500:
            return
        try:
            health = (await self._http.get("/health")).status_code
        except httpx.HTTPError:
            return  # the caller reports the first answer; the next call finds the engine gone
        if health == 503:
            raise EngineDead(
                f"vLLM {self.base_url}: {method} {path} answered {r.status_code} ({r.text[:120]!r}) and GET "
                "/health answers 503: its engine core is dead behind a live API server "
                "(VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps it up; without it the server exits within ~5 s). Its "
                "/metrics still show the last sleep state. The endpoint stays out of service until the engine "
                "(its pod) restarts"
            )

    async def _post(self, path: str, **kw) -> httpx.Response:
        note_step(f"POST {path}")
        try:
            r = await self._http.post(path, **kw)
        except httpx.HTTPError as exc:
            kind = EngineUnreachable if isinstance(exc, httpx.ConnectError) else BackendError
            raise kind(
                f"vLLM at {self.base_url} did not answer POST {path}: {exc!r}; is the engine up? "
                "The endpoint stays out of service: restart the engine (or its pod), then restore"
            ) from exc
        await self._raise_if_core_dead("POST", path, r)
        if r.status_code != 200:
            raise BackendError(
                f"vLLM POST {path} answered {r.status_code}: {r.text[:300]}; "
                "is the server started with VLLM_SERVER_DEV_MODE=1 (and sleep mode enabled on GPU)?"
            )
        return r

    async def post_checked(self, path: str, **kw) -> httpx.Response:
        """``POST path`` that must answer 200 (else :class:`BackendError`)."""
        return await self._post(path, **kw)
