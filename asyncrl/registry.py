"""`Registry`: the one type behind every piece chosen by a name in config.

Advantages, policy losses, corrections, agents, rewards, tools and tool parsers each keep one
`Registry` of named entries. `register(name)` is the decorator that adds one (a name is taken
once); `get(name)` returns a registered entry or, where the registry allows it, the callable at
an import path `package.module:attr` (the one place that import escape is written); an unknown
name is an `UnknownName` that names the config key and the registered names. Config checks read
`names()` / `accepts()` of the registry itself, so an entry a user registers is valid at load.

    >>> SQUARES: Registry[Callable[[int], int]] = Registry("square", "demo.square")
    >>> @SQUARES.register("plain")
    ... def plain(x: int) -> int:
    ...     return x * x
    >>> SQUARES["plain"](3), "plain" in SQUARES, SQUARES.names()
    (9, True, ['plain'])
    >>> SQUARES.get("math:sqrt")(16.0)
    4.0
    >>> try:
    ...     SQUARES.get("cube")
    ... except KeyError as e:
    ...     print(e)
    demo.square: unknown square 'cube'; registered: ['plain'] (or give module:attr)

Boundary: plain Python, no torch, no ray, importing nothing of asyncrl, so `agents` may use it
(`transfer_queue` and `checkpoint_engine` have no registry and do not need it). What the entries
are, and how they are called, is each registry owner's business.
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class UnknownName(KeyError, ValueError):
    """A name that is neither registered nor a usable import path. A `KeyError` (a registry is looked up
    like a dict) and a `ValueError` (a bad config value), so callers catching either keep working."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Named entries of one kind (`what`, e.g. "advantage"), chosen by the config key `key`.

    `import_paths`: whether `get` also accepts `package.module:attr` (the attribute must be callable).
    Registries whose entries are not plain callables (corrections carry flags) turn it off.
    """

    def __init__(self, what: str, key: str, *, import_paths: bool = True) -> None:
        self.what = what
        self.key = key
        self.import_paths = import_paths
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        """Register `entry` as `name`; a name already taken is an error (two entries must never shadow each other)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what} names must be non-empty strings, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} registered twice")
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: `@REGISTRY.register("name")` adds the function or class and returns it unchanged."""

        def deco(entry: T) -> T:
            return self.add(name, entry)

        return deco

    def get(self, name: str) -> T:
        """The entry registered as `name`, else (with `import_paths`) the callable at `module:attr`.

        A missing module raises its `ImportError` (the caller translates it with the key it knows)."""
        if name in self._entries:
            return self._entries[name]
        if self.import_paths and ":" in name:
            mod, _, attr = name.partition(":")
            obj = getattr(importlib.import_module(mod), attr, None)
            if not callable(obj):
                raise UnknownName(f"{self.key}: {self.what} {name!r}: module {mod!r} has no callable {attr!r}")
            return obj  # type: ignore[no-any-return]  # the import path is the user's promise of the entry's type
        raise self._unknown(name)

    def accepts(self, name: str) -> bool:
        """Whether `get(name)` can succeed without importing anything: a registered name, or an import path
        where those are allowed (resolved at use, or by `get` in a config check)."""
        return name in self._entries or (self.import_paths and ":" in name)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def __getitem__(self, name: str) -> T:
        if name not in self._entries:
            raise self._unknown(name)
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {self.key!r}, names={self.names()})"

    def _unknown(self, name: str) -> UnknownName:
        hint = " (or give module:attr)" if self.import_paths else ""
        return UnknownName(f"{self.key}: unknown {self.what} {name!r}; registered: {self.names()}{hint}")
