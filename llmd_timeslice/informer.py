"""An informer: the objects of one Kubernetes resource kept current by list + watch, in a thread of its own.

The list-watch of client-go's informers (``k8s.io/client-go/tools/cache``: ``ListWatch``, the reflector), on the
official ``kubernetes`` client: list (paged with ``limit``/``continue`` where a page size is given), then watch from
the list's ``resourceVersion`` (bookmarks on), resuming each watch request from the last ``resourceVersion`` seen;
``410 Gone`` (the version is older than the API server's history, on the watch request or as an ``ERROR`` event)
lists again; any other failure is the reader's to judge (:attr:`Informer.on_error`): a standing condition it waits
out, or an error retried after a doubling, jittered wait (tenacity) that :meth:`Informer.stop` cuts short. ``stop``
also shuts the open watch request's socket (``Watch.stop()``), so it returns at once.

It serves the orchestrator's pod discovery (:mod:`llmd_timeslice.discovery.kubernetes`) and the gate's
InferenceObjective reader (:mod:`epp_plugin.gate.objectives_k8s`). Why a thread and not the event loop: the client
is synchronous (urllib3) and a watch is a blocking read on a long-lived response; one owned thread keeps the object
cache single-threaded and leaves the loop's default executor to short calls. The reader's hooks run in that thread;
it hands what the event loop needs over with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential_jitter

__all__ = ["GONE", "Informer", "Resource", "api_message", "api_status", "run_rounds", "stop_thread"]

GONE = 410
"""The API server's answer to a watch from a ``resourceVersion`` older than its history: list again."""


def api_status(exc: BaseException) -> int | None:
    """The HTTP status of a failed API call (None: no answer, e.g. unreachable; the client reports that as 0)."""
    return getattr(exc, "status", None) or None


@dataclass(frozen=True)
class Resource:
    """One resource to list and watch: ``list_method`` is the client's list call of it (e.g.
    ``CoreV1Api.list_namespaced_pod``, ``CustomObjectsApi.list_namespaced_custom_object``), ``args`` its positional
    arguments (namespace; group, version, namespace, plural), ``query`` the fixed query of every request (e.g.
    ``label_selector``)."""

    list_method: Callable[..., Any]
    args: tuple[Any, ...] = ()
    query: Mapping[str, Any] = field(default_factory=dict)


def _name_key(obj: dict) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


class Informer:
    """The objects of ``resource`` (None: none yet; :meth:`reset` names one), by ``key(obj)`` (default: the name).

    Hooks, each called in the informer's thread (and in the caller's during :meth:`sync`):

    * ``on_change(relisted)``: after a list (``relisted`` True) and after each watch event that changed
      :attr:`objects`;
    * ``before_round()``: at the start of each round (e.g. API discovery); None to go on, or seconds to pause
      before the next round (this one ends there);
    * ``on_error(exc, verb)``: a list or watch (``verb``) failed other than with 410 Gone; returns seconds to pause
      before the next round (0: none), or raises for the round to be retried after the back-off;
      default: raise ``exc``;
    * ``on_gone()``: a 410 Gone (the next round lists again);
    * ``after_watch()``: a watch request ended without an error.

    Args:
        name: names the thread and the log lines (e.g. ``kubernetes discovery``).
        watch_timeout_s: server-side timeout of one watch request, seconds (the client's read timeout is 30 s above).
        backoff_s / backoff_max_s: first and longest wait, seconds, before a round that raised is retried.
        page_size: objects per list page (None: one page).
        log: where the back-off warnings and 410 lines go.
    """

    def __init__(
        self,
        name: str,
        resource: Resource | None,
        *,
        on_change: Callable[[bool], None],
        key: Callable[[dict], str] = _name_key,
        before_round: Callable[[], float | None] | None = None,
        on_error: Callable[[Exception, str], float] | None = None,
        on_gone: Callable[[], None] | None = None,
        after_watch: Callable[[], None] | None = None,
        watch_timeout_s: float = 300.0,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        page_size: int | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self.name = name
        self.resource = resource
        self.on_change = on_change
        self.key = key
        self.before_round = before_round
        self.on_error = on_error
        self.on_gone = on_gone
        self.after_watch = after_watch
        self.watch_timeout_s = watch_timeout_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.page_size = page_size
        self.log = log or logging.getLogger(__name__)
        # Owned by the informer's thread (by the caller before it starts).
        self.objects: dict[str, dict] = {}
        """Key -> object, as last listed and watched."""
        self.resource_version: str | None = None
        """Where the next watch resumes; None: the next round lists."""
        self.synced = False
        """Whether :attr:`objects` is a complete list (a list succeeded since the last :meth:`reset`)."""
        self.relists = 0
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._watch: Any = None  # the kubernetes.watch.Watch of the open watch request

    # ------------------------------------------------------------------ the cache
    def reset(self, resource: Resource | None = None) -> None:
        """Forget every object (not synced); the next round lists ``resource`` (default: the same one)."""
        if resource is not None:
            self.resource = resource
        self.objects, self.resource_version, self.synced = {}, None, False

    def relist_next(self) -> None:
        """The next round lists again (the objects are kept until then)."""
        self.resource_version = None

    def list(self) -> None:
        """List the resource (blocking; paged): replaces :attr:`objects` and the ``resourceVersion``. Raises the
        client's ``ApiException`` (or a connection error)."""
        assert self.resource is not None
        r = self.resource
        objects: dict[str, dict] = {}
        cont = None
        while True:
            kwargs: dict[str, Any] = {**r.query, "_preload_content": False, "_request_timeout": (10, 60)}
            if self.page_size:
                kwargs["limit"] = self.page_size
            if cont:
                kwargs["_continue"] = cont
            resp: Any = r.list_method(*r.args, **kwargs)  # the raw urllib3 response (no preload)
            try:
                if not 200 <= resp.status <= 299:
                    from kubernetes.client.exceptions import ApiException

                    raise ApiException(http_resp=resp)
                body = json.loads(resp.data)
            finally:
                resp.release_conn()
            for obj in body.get("items") or []:
                objects[self.key(obj)] = obj
            meta = body.get("metadata") or {}
            cont = meta.get("continue")
            if not cont:
                self.resource_version = meta.get("resourceVersion")
                break
        self.objects = objects
        self.synced = True
        self.relists += 1

    def sync(self) -> bool:
        """A round without its watch, in the caller's thread (a start-up, before :meth:`start`): ``before_round``,
        then a list if needed, a failure handled by ``on_error`` (its pause is not waited; what it raises reaches
        the caller). Returns whether a complete list is held."""
        if self.before_round is not None and self.before_round() is not None:
            return False
        if self.resource_version is None:
            try:
                self.list()
            except Exception as exc:
                self._failed(exc, "list")
                return False
            self.on_change(True)
        return self.synced

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        """Start the rounds (list when needed, then watch) in a daemon thread, until :meth:`stop`."""
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name=f"watch-{self.name}", daemon=True)
        self._thread.start()

    async def stop(self, timeout_s: float = 5.0) -> bool:
        """End the rounds: cut a pause short, shut the open watch request, and wait up to ``timeout_s`` seconds for
        the thread. Returns whether it ended (a daemon thread left running otherwise, with a warning)."""
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        ended = await stop_thread(thread, self._stopping, lambda: self._watch, timeout_s)
        if not ended:
            self.log.warning("%s: the watch thread did not stop within %g s (left as a daemon)", self.name, timeout_s)
        return ended

    def _run(self) -> None:
        run_rounds(self._round, self._stopping, self.backoff_s, self.backoff_max_s, self.log)

    def _pause(self, seconds: float) -> None:
        if seconds > 0:
            self._stopping.wait(seconds)

    def _failed(self, exc: Exception, verb: str) -> float:
        if self.on_error is None:
            raise exc
        return self.on_error(exc, verb)

    def _round(self) -> None:
        """One round: ``before_round``, a list when no ``resourceVersion`` is known, then one watch request."""
        if self._stopping.is_set():
            return
        if self.before_round is not None:
            pause = self.before_round()
            if pause is not None:
                self._pause(pause)
                return
        verb = "list"
        try:
            if self.resource_version is None:
                self.list()
                self.on_change(True)
            verb = "watch"
            self._watch_once()
        except Exception as exc:
            if self._stopping.is_set():
                return
            if api_status(exc) == GONE:
                self.log.info("%s: watch expired (410 Gone: %s); re-listing", self.name, api_message(exc))
                self.resource_version = None
                if self.on_gone is not None:
                    self.on_gone()
                return
            self._pause(self._failed(exc, verb))
            return
        if self.after_watch is not None and not self._stopping.is_set():
            self.after_watch()

    def _watch_once(self) -> None:
        from kubernetes import watch

        assert self.resource is not None
        r = self.resource
        w = watch.Watch()
        self._watch = w
        if self._stopping.is_set():
            return
        try:
            for ev in w.stream(
                r.list_method,
                *r.args,
                **r.query,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=max(1, int(self.watch_timeout_s)),
                _request_timeout=(10, self.watch_timeout_s + 30),
            ):
                if self._stopping.is_set():
                    return
                kind, obj = ev.get("type"), ev.get("raw_object") or ev.get("object") or {}
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if kind == "BOOKMARK":
                    self.resource_version = rv or self.resource_version
                    continue
                if kind in ("ADDED", "MODIFIED"):
                    self.objects[self.key(obj)] = obj
                elif kind == "DELETED":
                    self.objects.pop(self.key(obj), None)
                else:
                    continue
                self.resource_version = rv or self.resource_version
                self.on_change(False)
        finally:
            self._watch = None


def api_message(exc: BaseException) -> str:
    """The API server's message of a failed call (its ``Status`` body), else the exception's reason or text."""
    body = getattr(exc, "body", None)
    if body:
        try:
            return json.loads(body).get("message") or str(body)[:200]
        except (ValueError, AttributeError):
            return str(body)[:200]
    return str(getattr(exc, "reason", "") or exc)


def run_rounds(
    one_round: Callable[[], None],
    stopping: threading.Event,
    backoff_s: float,
    backoff_max_s: float,
    log: logging.Logger,
) -> None:
    """Call ``one_round`` again and again until ``stopping`` is set.

    A round that raises is retried after a doubling, jittered wait (tenacity: ``backoff_s`` seconds first, at most
    ``backoff_max_s``), logged at WARNING with the error and the wait; setting ``stopping`` cuts the wait short and
    ends the loop. Returns once stopped; raises nothing."""

    def retrying_in(state: RetryCallState) -> None:
        wait_s = state.next_action.sleep if state.next_action is not None else 0.0
        log.warning("%s; retrying in %.1f s", state.outcome.exception() if state.outcome else "", wait_s)

    def pause(seconds: float) -> None:
        stopping.wait(seconds)  # stop() ends the wait

    retrying = Retrying(
        retry=retry_if_exception_type(Exception),
        reraise=True,
        stop=lambda state: stopping.is_set(),
        sleep=pause,
        wait=wait_exponential_jitter(multiplier=backoff_s, max=backoff_max_s, jitter=backoff_s),
        before_sleep=retrying_in,
    )
    while not stopping.is_set():
        try:
            retrying(one_round)
        except Exception:
            return  # stopped during a failing round


async def stop_thread(
    thread: threading.Thread, stopping: threading.Event, current_watch: Callable[[], Any], timeout_s: float = 5.0
) -> bool:
    """Set ``stopping`` and wait up to ``timeout_s`` seconds for ``thread`` (running :func:`run_rounds`) to end.

    ``current_watch()`` returns the round's ``kubernetes.watch.Watch`` or None; its ``stop()`` shuts the socket of an
    open watch response, repeated while waiting, since the thread may be between creating the Watch and opening its
    request. Returns whether the thread ended."""
    stopping.set()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline:
        w = current_watch()
        if w is not None:
            w.stop()
        await asyncio.to_thread(thread.join, 0.05)
    return not thread.is_alive()
