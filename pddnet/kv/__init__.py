"""pddnet.kv: the paged KV pool (pool.py; optionally in a shared-memory segment, shm.py), the block
allocator (allocator.py), the prefix caches behind one interface (prefix_cache.py: hash_cache.py
for P and RLD, radix.py for MD and the simulator, both naming blocks by block_hash.py's chained
hashes), and KV export/import between pools (transfer.py).

Names are imported lazily so that ``import pddnet.kv.shm`` (or the CLI) does not pull in torch.
"""

from __future__ import annotations

from pddnet.lazy import lazy_exports

_EXPORTS = {
    "KVSpec": "pddnet.kv.pool",
    "KVPool": "pddnet.kv.pool",
    "SharedSegment": "pddnet.kv.shm",
    "SharedMemoryError": "pddnet.kv.shm",
    "unique_segment_name": "pddnet.kv.shm",
    "BlockAllocator": "pddnet.kv.allocator",
    "OutOfBlocks": "pddnet.kv.allocator",
    "PrefixCache": "pddnet.kv.prefix_cache",
    "PrefixMatch": "pddnet.kv.prefix_cache",
    "HashPrefixCache": "pddnet.kv.hash_cache",
    "RadixCache": "pddnet.kv.radix",
    "chained_hashes": "pddnet.kv.block_hash",
    "ExportedKV": "pddnet.kv.transfer",
    "KVExportMeta": "pddnet.kv.transfer",
    "export_kv": "pddnet.kv.transfer",
    "import_kv": "pddnet.kv.transfer",
}

__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
