"""The event loop the sync faces run their asyncio core on: one daemon thread per process; and the makings of a
blocking face over a core.

:func:`run` hands a coroutine to that loop and blocks the calling thread until it finishes, returning its
result or raising its exception (the same role as anyio's ``BlockingPortal.call``; a daemon thread of our own
so that a client nobody closed never keeps the interpreter from exiting, and one loop for every sync client in
the process instead of a thread each). A forked child starts its own loop on first use. See
``docs/decisions/one-client-core.md``.

A blocking face keeps its asyncio core in ``_core`` and takes each of its methods from the core's, so the two
cannot drift: :func:`blocking` (a call of the core, waited for), :func:`local` (local state, no call),
:func:`same_parameters` (a face's own method with the core's parameters), :func:`built_like` (a face's constructor
with the core's), :func:`blocking_context` (an async context manager of the core, entered and exited from the
calling thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import os
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_pid = 0


def loop() -> asyncio.AbstractEventLoop:
    """The process's core loop, started on first use (again in a forked child)."""
    global _loop, _pid
    with _lock:
        if _loop is None or _pid != os.getpid():
            new = asyncio.new_event_loop()
            threading.Thread(target=new.run_forever, name="llmd-timeslice-client-loop", daemon=True).start()
            _loop, _pid = new, os.getpid()
        return _loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the core loop and wait for it; raises what it raises. Called from the loop's own thread
    (a callback of the core) it would deadlock, so that raises RuntimeError. An interrupt of the waiting thread
    (KeyboardInterrupt) cancels the coroutine."""
    target = loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is target:
        coro.close()
        raise RuntimeError("a sync client call from the client's own event loop thread (e.g. inside a callback)")
    future = asyncio.run_coroutine_threadsafe(coro, target)
    try:
        return future.result()
    except concurrent.futures.CancelledError:
        raise asyncio.CancelledError() from None
    except BaseException:
        future.cancel()
        raise


# ---------------------------------------------------------------------- a blocking face over a core
def same_parameters(core: Callable[Concatenate[Any, P], Any]) -> Callable[[Callable[..., T]], Callable[Concatenate[Any, P], T]]:
    """A face's method takes the parameters of the core's method ``core`` (its signature, for introspection and the
    type checker); the face's own body passes them on."""

    def face(fn: Callable[..., T]) -> Callable[Concatenate[Any, P], T]:
        sig, own = inspect.signature(core), inspect.signature(fn).return_annotation
        if own is not inspect.Signature.empty:  # the face returns its own kind (e.g. a sync context manager)
            sig = sig.replace(return_annotation=own)
        fn.__signature__ = sig  # type: ignore[attr-defined]
        return fn

    return face


def built_like(create: Callable[P, Any]) -> Callable[[Callable[..., None]], Callable[Concatenate[Any, P], None]]:
    """A face's ``__init__`` takes the parameters of the core's constructor ``create`` (e.g. a bound async
    classmethod ``Core.create``); the face's own body builds the core with them."""

    def face(fn: Callable[..., None]) -> Callable[Concatenate[Any, P], None]:
        sig = inspect.signature(create)
        this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        fn.__signature__ = sig.replace(parameters=[this, *sig.parameters.values()], return_annotation=None)  # type: ignore[attr-defined]
        return fn

    return face


def blocking(core: Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]) -> Callable[Concatenate[Any, P], T]:
    """The blocking face of the core's coroutine method ``core``: the call runs on the client loop while the calling
    thread waits for its result (:func:`run`)."""

    @same_parameters(core)
    def face(self, *args, **kwargs):
        return run(getattr(self._core, core.__name__)(*args, **kwargs))

    face.__name__, face.__qualname__, face.__doc__ = core.__name__, core.__name__, core.__doc__
    return face


def local(core: Callable[Concatenate[Any, P], T]) -> Callable[Concatenate[Any, P], T]:
    """The face of the core's method ``core`` that reads local state (no call: plain on both faces)."""

    @same_parameters(core)
    def face(self, *args, **kwargs):
        return getattr(self._core, core.__name__)(*args, **kwargs)

    face.__name__, face.__qualname__, face.__doc__ = core.__name__, core.__name__, core.__doc__
    return face


@contextlib.contextmanager
def blocking_context(cm: contextlib.AbstractAsyncContextManager[T]) -> Iterator[T]:
    """The blocking face of the core's async context manager ``cm``: entered and exited on the client loop."""
    value = run(cm.__aenter__())
    try:
        yield value
    except BaseException as exc:
        if not run(cm.__aexit__(type(exc), exc, exc.__traceback__)):
            raise
    else:
        run(cm.__aexit__(None, None, None))
