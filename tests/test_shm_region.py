"""RemoteKVRegion: one-sided, bounds-checked KV writes into a peer's shared-memory pool."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pddnet.kv.pool import KVPool, KVSpec
from pddnet.kv.shm import SHM_DIR, SharedMemoryError, segments_of, unique_segment_name
from pddnet.kv.transfer import export_kv
from pddnet.transport.backends.shm import RemoteKVRegion

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def our_segments() -> set[str]:
    """This process's pdd- segments only: another test process (a pytest-xdist worker) may
    hold its own at any moment."""
    return set(segments_of([os.getpid()]))


@pytest.fixture
def rld_pool():
    """RLD's shared pool: block size 4, float32 (P uses block size 3, float64)."""
    before = our_segments()
    pool = KVPool(
        KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32"),
        num_blocks=16,
        shm_name=unique_segment_name("test"),
    )
    yield pool
    pool.close()
    assert our_segments() == before, "shared-memory segment left in /dev/shm"


def p_export(n_tokens: int = 10, start: int = 0, end: int | None = None):
    """P's KV for `n_tokens` positions (random, float64, block size 3), exported [start, end)."""
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=3, dtype="float64")
    pool = KVPool(spec, num_blocks=8)
    table = [5, 1, 7, 2]
    kv = torch.randn(
        2, 2, n_tokens, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7)
    )
    pool.write_tokens(table, 0, kv)
    return export_kv(pool, table, start, n_tokens if end is None else end), kv


def test_write_lands_in_the_right_blocks_with_conversion(rld_pool):
    exported, kv = p_export(10)
    table = [9, 3, 12]  # the request's blocks at RLD's block size 4 (12 positions)
    others = rld_pool.data.clone()
    with RemoteKVRegion.attach(rld_pool.shm_name) as region:
        assert region.spec == rld_pool.spec and region.num_blocks == 16
        n = region.write(table, table, exported, 0)
    assert n == 2 * 2 * 10 * 2 * 8 * 4  # bytes at the region's dtype (float32)
    got = rld_pool.read_tokens(table, 0, 10)
    assert torch.equal(got, kv.to(torch.float32))
    untouched = [b for b in range(16) if b not in table]
    assert torch.equal(rld_pool.data[:, :, untouched], others[:, :, untouched])
    # Positions 10, 11 of block 12 were not written either.
    assert torch.equal(rld_pool.data[:, :, 12, 2:], others[:, :, 12, 2:])


def test_partial_writes_at_an_offset(rld_pool):
    exported, kv = p_export(10, start=6, end=10)
    table = [0, 1, 2]
    with RemoteKVRegion.attach(rld_pool.shm_name) as region:
        region.write(table, table, exported, 6, min_position=4)
        assert region.bytes_written == 2 * 2 * 4 * 2 * 8 * 4
    assert torch.equal(rld_pool.read_tokens(table, 6, 10), kv[:, :, 6:10].to(torch.float32))
    assert torch.count_nonzero(rld_pool.read_tokens(table, 0, 6)) == 0


def test_out_of_bounds_writes_are_refused_and_change_nothing(rld_pool):
    exported, _ = p_export(10)
    table = [9, 3, 12]
    before = rld_pool.data.clone()
    with RemoteKVRegion.attach(rld_pool.shm_name) as region:
        with pytest.raises(ValueError, match=r"block\(s\) \[5\] that are not this request's"):
            region.write([9, 3, 12], [9, 5, 12], exported, 0)  # block 5 belongs to someone else
        with pytest.raises(ValueError, match=r"positions \[4, 14\) does not fit .* \[0, 12\)"):
            region.write(table, table, exported, 4)  # past the end of the table
        with pytest.raises(ValueError, match="negative position"):
            region.write(table, table, exported, -1)
        with pytest.raises(ValueError, match="cached prefix is not writable"):
            region.write(table, table, exported, 0, min_position=4)
        with pytest.raises(ValueError, match=r"block\(s\) \[99\] outside the region's 16"):
            region.write([9, 3, 99], [9, 3, 99], exported, 0)
        wrong_heads = export_kv(KVPool(KVSpec(2, 1, 8, 4, "float32"), 4), [0, 1, 2], 0, 10)
        with pytest.raises(ValueError, match="kv heads"):
            region.write(table, table, wrong_heads, 0)
    assert torch.equal(rld_pool.data, before)


def test_a_second_process_attaches_by_name_and_writes(rld_pool):
    table = [4, 8, 15]
    code = textwrap.dedent(f"""
        import torch
        torch.set_num_threads(1)
        from pddnet.kv.pool import KVPool, KVSpec
        from pddnet.kv.transfer import export_kv
        from pddnet.transport.backends.shm import RemoteKVRegion
        src = KVPool(KVSpec(2, 2, 8, 3, "float64"), 8)
        kv = torch.arange(2 * 2 * 9 * 2 * 8, dtype=torch.float64).view(2, 2, 9, 2, 8)
        src.write_tokens([0, 1, 2], 0, kv)
        region = RemoteKVRegion.attach({rld_pool.shm_name!r})
        print(region.write({table}, {table}, export_kv(src, [0, 1, 2], 0, 9), 0))
        region.close()
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 2 * 2 * 9 * 2 * 8 * 4
    want = torch.arange(2 * 2 * 9 * 2 * 8, dtype=torch.float64).view(2, 2, 9, 2, 8)
    assert torch.equal(rld_pool.read_tokens(table, 0, 9), want.to(torch.float32))
    assert os.path.exists(os.path.join(SHM_DIR, rld_pool.shm_name))  # the writer did not unlink


def test_close_detaches_without_unlinking_and_bad_names(rld_pool):
    region = RemoteKVRegion.attach(rld_pool.shm_name)
    region.close()
    region.close()
    assert region.closed and os.path.exists(os.path.join(SHM_DIR, rld_pool.shm_name))
    with pytest.raises(RuntimeError, match="is closed"):
        region.write([0], [0], p_export(2)[0], 0)
    with pytest.raises(SharedMemoryError, match="no shared-memory segment"):
        RemoteKVRegion.attach("pdd-no-such-pool")
    with pytest.raises(ValueError, match="no shared-memory region name"):
        RemoteKVRegion.attach("")
