"""The sync and asyncio faces of the TimeSlice client and of the phase-callback role locks have the same public
methods with the same parameters (names, kinds, defaults), so one cannot drift from the other again (issue 27:
the async client had lost ``fencing_token``, ``list_groups``, ``group_status``, ``on_both_groups``). Pure
introspection: no server."""

from __future__ import annotations

import inspect

import pytest

from llmd_timeslice.client import AsyncTimeSliceOrchestratorClient, TimeSliceOrchestratorClient
from llmd_timeslice.client.integrations import AsyncRoleLocks, RoleLocks

ASYNC_NAME = {"__enter__": "__aenter__", "__exit__": "__aexit__"}
"""A sync method and its asyncio counterpart under another name."""

LOCAL = {"fencing_token", "lease_lost", "on_accelerators", "on_both_groups", "held", "yield_requested", "on_yield_requested"}

"""Public members that read local state or return a context manager: plain (not awaitable) on both faces."""

FACE_ONLY = {
    # The async locks are built by ``await AsyncRoleLocks.create(...)`` (the start-up check is a call), not __init__.
    AsyncRoleLocks: {"create", "__init__"},
    RoleLocks: {"__init__"},
}


def _public(cls) -> dict[str, object]:
    dunders = ("__init__", "__enter__", "__exit__", "__aenter__", "__aexit__")
    names = {n for n in dir(cls) if not n.startswith("_")}
    names |= {n for n in dunders if hasattr(cls, n) and getattr(cls, n) is not getattr(object, n, None)}
    return {n: inspect.getattr_static(cls, n) for n in names - FACE_ONLY.get(cls, set())}


def _params(member) -> list[tuple[str, str, object]]:
    fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


def _unwrapped(member):
    fn = getattr(member, "__func__", member)  # classmethod / staticmethod
    return inspect.unwrap(fn) if inspect.isfunction(fn) else fn


@pytest.mark.parametrize(
    ("sync_cls", "async_cls"),
    [(TimeSliceOrchestratorClient, AsyncTimeSliceOrchestratorClient), (RoleLocks, AsyncRoleLocks)],
    ids=["client", "role-locks"],
)
def test_sync_and_async_faces_have_the_same_public_methods_and_parameters(sync_cls, async_cls):
    assert_same_faces(sync_cls, async_cls)


def assert_same_faces(sync_cls, async_cls) -> None:
    sync, aio = _public(sync_cls), _public(async_cls)
    assert {ASYNC_NAME.get(n, n) for n in sync} == set(aio), (
        f"only sync: {sorted({ASYNC_NAME.get(n, n) for n in sync} - set(aio))}; "
        f"only async: {sorted(set(aio) - {ASYNC_NAME.get(n, n) for n in sync})}"
    )
    for name, member in sorted(sync.items()):
        other = aio[ASYNC_NAME.get(name, name)]
        assert type(member) is type(other), f"{name}: {type(member).__name__} vs {type(other).__name__}"
        fn_sync, fn_async = _unwrapped(member), _unwrapped(other)
        if isinstance(member, property):
            assert _params(member) == _params(other), f"{name}: parameters differ"
        elif inspect.isfunction(fn_sync):
            assert _params(member) == _params(other), f"{name}: parameters differ"
            awaitable = name not in LOCAL and name != "__init__"
            assert inspect.iscoroutinefunction(fn_async) is awaitable, (
                f"async {name}: {'calls the orchestrator, must be awaitable' if awaitable else 'local, not awaitable'}"
            )
            assert not inspect.iscoroutinefunction(fn_sync), f"sync {name} must not be a coroutine function"
        else:
            assert member == other, f"{name}: {member!r} vs {other!r}"


def test_the_parity_check_sees_a_drifted_face():
    """The check is not vacuous: a missing method, a parameter renamed or a lost default, and a network call that
    is not awaitable are each caught."""

    class Renamed(AsyncTimeSliceOrchestratorClient):
        async def group_status(self, group: str | None = None):  # type: ignore[override]
            return None

    class NotAwaitable(AsyncTimeSliceOrchestratorClient):
        def list_groups(self):  # type: ignore[override]
            return []

    class Extra(AsyncTimeSliceOrchestratorClient):
        async def drain_now(self) -> None:
            return None

    for drifted, why in [(Renamed, "group_status: parameters differ"), (NotAwaitable, "async list_groups"), (Extra, "drain_now")]:
        with pytest.raises(AssertionError, match=why):
            assert_same_faces(TimeSliceOrchestratorClient, drifted)
