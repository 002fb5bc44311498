"""The radix tree's invariant checker (tests and debugging): every derived count of a
RadixTree (lock marks, evictable counts, the leaf set, the block -> node index, the chained
hashes) recomputed from scratch and compared."""

from __future__ import annotations

from pddnet.kv.block_hash import chained_hashes
from pddnet.kv.radix_node import RadixNode
from pddnet.kv.radix_tree import RadixTree


def check_invariants(cache: RadixTree) -> None:
    """Recompute every derived quantity of ``cache`` from scratch; raises AssertionError on a
    mismatch (tests call it after every step of a random trace)."""
    bs = cache.block_size
    seen: dict[int, RadixNode] = {}
    total_evictable = 0
    leaves = set()

    def visit(node: RadixNode, parent_hash: int) -> int:
        nonlocal total_evictable
        locked_below = 0
        for key, child in node.children.items():
            assert child.parent is node, "child's parent link is wrong"
            assert child.blocks, "empty non-root node"
            assert key == cache._key(child.tokens), "child keyed by the wrong tokens"
            assert len(child.tokens) == len(child.blocks) * bs == len(child.hashes) * bs
            h = parent_hash if node is not cache._root else 0
            h = node.hashes[-1] if node.hashes else h
            for i, b in enumerate(child.blocks):
                assert b not in seen, f"block {b} owned by two nodes"
                seen[b] = child
                h = chained_hashes(child.tokens[i * bs : (i + 1) * bs], bs, h)[0]
                assert child.hashes[i] == h, "stored hash is not the chained hash"
                assert cache.allocator.refcount(b) >= 1, f"owned block {b} is free"
            locked = [i for i, b in enumerate(child.blocks) if cache._locked(b)]
            assert child.last_locked == (locked[-1] if locked else -1)
            below = visit(child, h)
            assert child.locked_below == below, "locked_below is stale"
            want = 0 if below else len(child.blocks) - (child.last_locked + 1)
            assert child.evictable == want, "evictable count is stale"
            total_evictable += want
            locked_below += below + (1 if locked else 0)
            if not child.children:
                leaves.add(child)
        return locked_below

    visit(cache._root, 0)
    assert seen == {b: n for b, n in enumerate(cache._node_of) if n is not None}, (
        "block -> node index is stale"
    )
    assert cache._num_cached == len(seen), "cached block count is stale"
    assert total_evictable == cache._num_evictable, "evictable total is stale"
    assert leaves == cache._leaves, "leaf set is stale"
    assert all(cache._owner(b) is not None for b in cache._pins), "pin on an uncached block"
