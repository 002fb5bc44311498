"""Export a token range's KV as one tensor; import it into a pool of another block size/dtype."""

from __future__ import annotations

import pytest
import torch

from pddnet.kv.pool import KVPool, KVSpec
from pddnet.kv.transfer import (
    ExportedKV,
    KVExportMeta,
    export_kv,
    import_kv,
)
from pddnet.model.attention import causal_attention

L, H, D = 3, 2, 8


def _filled_pool(block_size: int, dtype: str, table: list[int], n: int, seed: int = 0) -> KVPool:
    pool = KVPool(KVSpec(L, H, D, block_size, dtype), 16)
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(L, 2, n, H, D, generator=g, dtype=torch.float64)
    pool.write_tokens(table, 0, kv)
    return pool


def test_export_shape_metadata_and_payload_round_trip():
    pool = _filled_pool(16, "float64", [3, 9, 0], 40)
    ex = export_kv(pool, [3, 9, 0], 5, 37)
    assert ex.kv.shape == (L, 2, 32, H, D) and ex.kv.is_contiguous()
    assert ex.meta.token_start == 5 and ex.meta.token_end == 37 and ex.meta.block_size == 16
    k, v = pool.gather(2, [3, 9, 0], 37)
    assert torch.equal(ex.kv[2, 0], k[5:]) and torch.equal(ex.kv[2, 1], v[5:])
    again = ExportedKV.from_payload(KVExportMeta.from_dict(ex.meta.to_dict()), bytes(ex.payload()))
    assert torch.equal(again.kv, ex.kv)
    with pytest.raises(ValueError, match="needs"):
        ExportedKV.from_payload(ex.meta, bytes(ex.payload())[:-1])
    with pytest.raises(ValueError, match="does not match"):
        KVExportMeta("float64", (L, 2, 4, H, D), 0, 5, 16)
    with pytest.raises(ValueError, match="missing"):
        KVExportMeta.from_dict({"dtype": "float64"})


@pytest.mark.parametrize("dst_dtype, tol", [("float32", 1e-5), ("float64", 0.0)])
def test_heterogeneous_import_block16_to_block32_gives_the_same_attention(dst_dtype, tol):
    n = 53
    src_table = [7, 2, 11, 4]  # 4 blocks of 16
    src = _filled_pool(16, "float64", src_table, n)
    dst = KVPool(KVSpec(L, H, D, 32, dst_dtype), 16)
    dst_table = [5, 1]  # 2 blocks of 32
    import_kv(dst, export_kv(src, src_table, 0, n), dst_table)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(6, 2 * H, D, generator=g, dtype=torch.float64)  # GQA: 4 query heads
    for layer in range(L):
        ks, vs = src.gather(layer, src_table, n)
        kd, vd = dst.gather(layer, dst_table, n, dtype=torch.float64)
        ref = causal_attention(q, ks, vs, q_offset=n - 6)
        out = causal_attention(q, kd, vd, q_offset=n - 6)
        if tol == 0.0:
            assert torch.equal(out, ref)
        else:
            assert (out - ref).abs().max() < tol
            assert (out - ref).abs().max() > 0  # the dtype really changed


def test_import_at_an_unaligned_offset_in_layer_ranges():
    src_table = [0, 1, 2]
    src = _filled_pool(16, "float64", src_table, 40)
    dst = KVPool(KVSpec(L, H, D, 8, "float64"), 16)
    dst_table = [9, 3, 12, 6, 1]
    # the destination already holds tokens 0..10 (e.g. a prefix-cache hit): send only the rest,
    # split by layer ranges as a streaming sender would
    import_kv(dst, export_kv(src, src_table, 0, 11), dst_table)
    import_kv(dst, export_kv(src, src_table, 11, 40, 0, 2), dst_table)
    import_kv(dst, export_kv(src, src_table, 11, 40, 2, 3), dst_table)
    for layer in range(L):
        assert torch.equal(
            torch.stack(src.gather(layer, src_table, 40)),
            torch.stack(dst.gather(layer, dst_table, 40)),
        )


def test_import_rejects_mismatched_shapes():
    src = _filled_pool(16, "float64", [0], 10)
    ex = export_kv(src, [0], 0, 10)
    with pytest.raises(ValueError, match="kv heads"):
        import_kv(KVPool(KVSpec(L, H + 1, D, 16, "float64"), 4), ex, [0])
    with pytest.raises(ValueError, match="layers up to 3"):
        import_kv(KVPool(KVSpec(2, H, D, 16, "float64"), 4), ex, [0])
    with pytest.raises(ValueError, match="needs 2 blocks"):
        import_kv(KVPool(KVSpec(L, H, D, 8, "float64"), 4), ex, [0])
    with pytest.raises(ValueError, match="layer range"):
        export_kv(src, [0], 0, 10, 2, 2)
