"""Lazy package exports, so that importing a package (or `pdd --help`) does not pull in torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[list[str], Callable[[str], Any]]:
    """`__all__` and a module `__getattr__` for `package`.

    `exports` maps a public name to the module defining it, absolute ("pddnet.kv.pool") or
    relative to the package ("pool").
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        full = module if "." in module else f"{package}.{module}"
        return getattr(importlib.import_module(full), name)

    return sorted(exports), __getattr__
