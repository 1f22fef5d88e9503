"""Plugins chosen by name: one small registry per extension point (waiter policy, endpoint pick, snapshot backend).

Shaped like the inference extension's plugin registry (kubernetes-sigs/gateway-api-inference-extension
``pkg/epp/plugins/registry.go``, commit 17a466fa: a map from a plugin type name to its factory, ``Register``
refusing a name twice; the in-tree plugins are registered explicitly in one place,
``cmd/epp/runner/runner.go`` ``registerInTreePlugins``). Here each extension point's module builds its
:class:`Registry` and registers its in-tree plugins right below it, explicitly: nothing registers itself as a side
effect of being imported, and the names a configuration may spell are exactly :meth:`Registry.names`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownPlugin(ValueError):
    """A name no plugin of this kind is registered under; the one-line message lists the known ones."""

    def __init__(self, kind: str, name: str, known: tuple[str, ...]) -> None:
        super().__init__(f"unknown {kind} {name!r}; known: {', '.join(known) or 'none'}")
        self.kind, self.name, self.known = kind, name, known


class Registry(Generic[T]):
    """Name -> factory of the plugins of one kind (``kind`` names it in errors, e.g. ``"snapshot backend"``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str, factory: Callable[..., T]) -> None:
        """Make ``factory`` available as ``name``. Raises ``ValueError`` if ``name`` is taken (as upstream's
        ``Register`` panics)."""
        if name in self._factories:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._factories[name] = factory

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def factory(self, name: str) -> Callable[..., T]:
        """The factory registered as ``name``. Raises :class:`UnknownPlugin`."""
        try:
            return self._factories[name]
        except KeyError:
            raise UnknownPlugin(self.kind, name, self.names()) from None

    def create(self, name: str, /, **kwargs) -> T:
        """A new plugin ``name`` built with ``kwargs``. Raises :class:`UnknownPlugin`."""
        return self.factory(name)(**kwargs)
