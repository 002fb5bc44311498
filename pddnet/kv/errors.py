"""The KV layer's exceptions, in a module of their own: the allocator and the caches may be
compiled (mypyc, see docs/simulator.md), and a compiled module cannot define subclasses of
built-in exceptions; they import them from here instead."""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks for an allocation."""

    def __init__(self, requested: int, free: int, total: int) -> None:
        super().__init__(f"out of KV blocks: requested {requested}, {free} free of {total}")
        self.requested = requested
        self.free = free
        self.total = total
