"""The paged KV pool: layout, slot addressing, and the shared-memory segment another process maps."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pddnet.kv.pool import DATA_OFFSET, KVPool, KVSpec
from pddnet.kv.shm import (
    SharedMemoryError,
    SharedSegment,
    segment_name,
    segments_of,
    unique_segment_name,
    unlink_segment,
)

REPO = Path(__file__).resolve().parents[1]
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float64")


def _ours() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"pdd-test-{os.getpid()}-")}


@pytest.fixture
def shm_name():
    name = unique_segment_name(f"test-{os.getpid()}")
    yield name
    gc.collect()
    leftover = _ours()
    for n in leftover:  # clean up before failing, so a failing test leaves nothing behind
        os.unlink(f"/dev/shm/{n}")
    assert not leftover, f"segments left behind: {leftover}"


def test_slot_mapping_follows_the_block_table():
    with KVPool(SPEC, 8) as pool:
        slots = pool.slot_mapping([5, 2, 7], 2, 10)
        assert slots.tolist() == [22, 23, 8, 9, 10, 11, 28, 29]
        with pytest.raises(ValueError, match="needs 3 blocks"):
            pool.slot_mapping([5, 2], 0, 9)
        with pytest.raises(ValueError, match="outside 0..7"):
            pool.slot_mapping([5, 8], 0, 8)


def test_write_then_gather_returns_rows_in_token_order():
    with KVPool(SPEC, 8) as pool:
        table = [6, 1, 3]
        k = torch.randn(11, 2, 4, dtype=torch.float64)
        v = torch.randn(11, 2, 4, dtype=torch.float64)
        pool.write(1, pool.slot_mapping(table, 0, 11), k, v)
        gk, gv = pool.gather(1, table, 11)
        assert torch.equal(gk, k) and torch.equal(gv, v)
        # layer 0 untouched
        gk0, _ = pool.gather(0, table, 11)
        assert torch.count_nonzero(gk0) == 0
        with pytest.raises(ValueError, match="do not match"):
            pool.write(0, pool.slot_mapping(table, 0, 3), k, v)


def test_spec_from_model_config_and_sizes():
    from pddnet.model.config import ModelConfig

    cfg = ModelConfig.preset("small")
    spec = KVSpec.from_model_config(cfg, block_size=16)
    assert spec.bytes_per_token == cfg.kv_bytes_per_token
    assert spec.shape(3) == (cfg.num_layers, 2, 3, 16, cfg.num_kv_heads, cfg.head_dim)
    assert KVSpec.from_model_config(cfg, 32, "bfloat16").itemsize == 2
    with pytest.raises(ValueError, match="block_size"):
        KVSpec(2, 2, 4, 0, "float32")
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        KVSpec(2, 2, 4, 16, "int8")


_CHILD = textwrap.dedent("""
    import sys, torch
    from pddnet.kv.pool import KVPool
    pool = KVPool.attach(sys.argv[1])
    assert not pool.owner
    # read what the parent wrote into block 1, layer 0 K
    seen = pool.data[0, 0, 1].clone()
    # write a deterministic pattern into blocks 2 and 5 of every layer, K and V
    g = torch.Generator().manual_seed(1234)
    for b in (2, 5):
        pool.data[:, :, b] = torch.randn(pool.data[:, :, b].shape, generator=g,
                                         dtype=torch.float64)
    pool.data[1, 0, 7] = seen * 2
    pool.close()
    print("ok", pool.spec.block_size, pool.num_blocks)
""")


def test_second_process_attaches_by_name_and_writes_blocks(shm_name):
    pool = KVPool(SPEC, 8, shm_name=shm_name)
    try:
        assert pool.is_shared and pool.shm_name == shm_name
        assert os.path.exists(f"/dev/shm/{shm_name}")
        mine = torch.randn(SPEC.block_size, 2, 4, dtype=torch.float64)
        pool.data[0, 0, 1] = mine
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        res = subprocess.run(
            [sys.executable, "-c", _CHILD, shm_name],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        assert res.stdout.split() == ["ok", "4", "8"]
        g = torch.Generator().manual_seed(1234)
        for b in (2, 5):
            expect = torch.randn(pool.data[:, :, b].shape, generator=g, dtype=torch.float64)
            assert torch.equal(pool.data[:, :, b], expect)
        assert torch.equal(pool.data[1, 0, 7], mine * 2)
        # untouched blocks stay zero
        assert torch.count_nonzero(pool.data[:, :, 0]) == 0
        # the attaching process's close() did not unlink the owner's segment
        assert os.path.exists(f"/dev/shm/{shm_name}")
    finally:
        pool.close()
    assert not os.path.exists(f"/dev/shm/{shm_name}")
    assert pool.closed
    with pytest.raises(RuntimeError, match="closed"):
        pool.gather(0, [0], 1)


def test_attach_in_process_sees_the_same_bytes(shm_name):
    with KVPool(SPEC, 8, shm_name=shm_name) as owner:
        with KVPool.attach(shm_name) as peer:
            assert peer.spec == SPEC and peer.num_blocks == 8
            peer.data[0, 1, 3] = 5.0
            assert torch.all(owner.data[0, 1, 3] == 5.0)
        assert os.path.exists(f"/dev/shm/{shm_name}")
    assert not os.path.exists(f"/dev/shm/{shm_name}")


def test_finalizer_unlinks_an_unclosed_pool(shm_name):
    pool = KVPool(SPEC, 4, shm_name=shm_name)
    view = pool.data[0, 0, 0]  # a tensor that outlives the pool object must stay valid
    del pool
    gc.collect()
    assert not os.path.exists(f"/dev/shm/{shm_name}")
    view += 1.0  # still mapped: no crash
    assert torch.all(view == 1.0)


def test_shm_errors_are_clear(shm_name):
    with pytest.raises(SharedMemoryError, match="no shared-memory segment"):
        KVPool.attach(shm_name)
    with KVPool(SPEC, 4, shm_name=shm_name):
        with pytest.raises(SharedMemoryError, match="already exists"):
            KVPool(SPEC, 4, shm_name=shm_name)
    with SharedSegment.create(shm_name, DATA_OFFSET + 64) as seg:
        seg.buffer[:8] = b"garbage!"
        with pytest.raises(SharedMemoryError, match="bad magic"):
            KVPool.attach(shm_name)
    with pytest.raises(SharedMemoryError, match="bad shared-memory name"):
        segment_name("a/b")
    assert segment_name("rld0") == "pdd-rld0"


def test_a_dead_creators_segments_are_found_by_pid_and_unlinked(shm_name):
    """What the launcher does after a daemon died: find its segments by PID, unlink them."""
    me, other = os.getpid(), os.getpid() + 1
    with SharedSegment.create(shm_name, 64) as seg:
        assert seg.name in segments_of([me]) and seg.name not in segments_of([other])
        with SharedSegment.attach(seg.name) as peer:  # a mapping survives the unlink
            unlink_segment(seg.name)
            assert not os.path.exists(f"/dev/shm/{seg.name}")
            assert seg.name not in segments_of([me])
            peer.buffer[:4] = b"live"
            assert seg.buffer[:4] == b"live"
        unlink_segment(seg.name)  # already gone: fine
    with pytest.raises(SharedMemoryError, match="not a pddnet shared-memory segment"):
        unlink_segment("../etc/passwd")
