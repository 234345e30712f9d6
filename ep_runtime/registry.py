"""A name → backend-class registry shared by the dispatch and experts packages."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from typing import Generic, TypeVar

from ep_runtime.types import BackendUnavailableError

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Backends register themselves by name; ``candidates`` lists the ones to try."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, T] = {}

    def register(self, cls: T) -> T:
        name = cls.name  # type: ignore[attr-defined]
        if name in self._classes and self._classes[name] is not cls:
            raise ValueError(f"{self.kind} backend {name!r} registered twice")
        self._classes[name] = cls
        return cls

    def names(self) -> list[str]:
        return list(self._classes)

    def __iter__(self) -> Iterator[T]:
        return iter(self._classes.values())

    def __getitem__(self, name: str) -> T:
        if name not in self._classes:
            raise BackendUnavailableError(
                self.kind, name, {name: f"unknown; registered: {', '.join(self._classes)}"}
            )
        return self._classes[name]

    def candidates(self, requested: str) -> list[T]:
        """``"auto"``: every backend, highest ``auto_priority`` first; else the one named."""
        if requested == "auto":
            return sorted(self._classes.values(), key=lambda c: -c.auto_priority)  # type: ignore[attr-defined]
        return [self[requested]]


def import_package_modules(package_name: str, package_path: list[str]) -> None:
    """Import every module of a package, so each backend file registers itself: adding a
    backend is adding one file."""
    for module in pkgutil.iter_modules(package_path):
        importlib.import_module(f"{package_name}.{module.name}")
