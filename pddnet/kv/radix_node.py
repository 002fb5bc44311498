"""A node of the radix tree (pddnet/kv/radix_tree.py) and its entry in the eviction heap."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class RadixNode:
    uid: int
    parent: RadixNode | None
    tokens: tuple[int, ...]  # edge label: len(blocks) * block_size tokens
    blocks: list[int]
    hashes: list[int]  # chained hash of each block (names the prefix up to it)
    children: dict[object, RadixNode] = field(default_factory=dict)  # keyed by _key
    last_access: int = 0
    last_locked: int = -1  # index of the deepest locked block here (-1: none)
    locked_below: int = 0  # strict descendants holding a locked block
    evictable: int = 0  # blocks of this node repeated leaf eviction could free
    heap_at: int = -1  # last_access of its live eviction-heap entry (-1: none)
    heap_epoch: int = 0  # ... in that heap generation


class LruEntry:
    """A leaf's place in the eviction heap: (its last_access when pushed, uid). A class with
    its own ``<`` rather than a tuple: compiled, it compares two native ints, where a tuple
    compared the int objects twice (equal? then less?)."""

    __slots__ = ("at", "uid", "node")

    def __init__(self, at: int, uid: int, node: RadixNode) -> None:
        self.at = at
        self.uid = uid
        self.node = node

    def __lt__(self, other: LruEntry) -> bool:
        return self.at < other.at or (self.at == other.at and self.uid < other.uid)
