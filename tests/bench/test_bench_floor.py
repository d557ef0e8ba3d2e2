"""The traffic floor's byte formulas (mxcomm.bench.floor) against small cases worked out by hand."""
from __future__ import annotations

import pytest

from mxcomm.bench.floor import floor_us, rank_floor_bytes, row_bytes, world_floor_bytes

H, T = 64, 3  # MXFP8 row 64 + 64/32 = 66 bytes, BF16 row 128 bytes; 3 token rows = 384 BF16 bytes


def test_row_bytes():
    assert row_bytes("mxfp8", 64) == 66 and row_bytes("bf16", 64) == 128
    assert row_bytes("mxfp8", 7168) == 7392 and row_bytes("bf16", 7168) == 14336
    with pytest.raises(ValueError, match="unknown precision"):
        row_bytes("fp4", 64)


@pytest.mark.parametrize("op, precision, read, written", [
    ("dispatch", "mxfp8", 3 * 128, 5 * 66),       # token rows read once in BF16, 5 received rows written as MXFP8
    ("dispatch", "bf16", 3 * 128, 5 * 128),       # ... written as BF16
    ("combine", "mxfp8", 5 * 128, 3 * 128),       # 5 expert rows read in BF16, 3 output rows written in BF16
    ("combine", "bf16", 5 * 128, 3 * 128),        # the payload does not change what combine must touch
    ("combine_bwd", "mxfp8", 3 * 128, 5 * 66),    # grad_y read once, per-selection gradients written as MXFP8
    ("combine_bwd", "bf16", 3 * 128, 5 * 128),
    ("dispatch_bwd", "mxfp8", 5 * 128, 3 * 128),  # per-selection BF16 gradients read, token gradients written
    ("dispatch_bwd", "bf16", 5 * 128, 3 * 128),
])
def test_rank_floor_bytes(op, precision, read, written):
    b = rank_floor_bytes(op, precision=precision, hidden=H, tokens=T, selections=5)
    assert (b.read, b.written, b.total) == (read, written, read + written)


def test_rank_floor_bytes_rejects_unknown_ops_and_negative_counts():
    with pytest.raises(ValueError, match="unknown op"):
        rank_floor_bytes("all_to_all", precision="bf16", hidden=H, tokens=T, selections=1)
    with pytest.raises(ValueError, match=">= 0"):
        rank_floor_bytes("dispatch", precision="bf16", hidden=H, tokens=-1, selections=1)


def test_ranks_sharing_one_memory_add_up():
    # rank 0: 384 + 5 * 66 = 714 bytes, rank 1: 384 + 7 * 66 = 846 bytes; one GPU holds both
    wf = world_floor_bytes("dispatch", precision="mxfp8", hidden=H, tokens=T, selections=[5, 7],
                           memories=["h:cuda:0", "h:cuda:0"])
    assert (wf.bytes_read, wf.bytes_written, wf.bytes) == (768, 792, 1560)
    assert wf.ranks_per_memory == {"h:cuda:0": 2}


def test_ranks_with_their_own_memory_take_the_busiest():
    wf = world_floor_bytes("dispatch", precision="mxfp8", hidden=H, tokens=T, selections=[5, 7],
                           memories=["h:cuda:0", "h:cuda:1"])
    assert (wf.bytes_read, wf.bytes_written, wf.bytes) == (384, 462, 846)
    assert wf.per_memory == {"h:cuda:0": 714, "h:cuda:1": 846}
    assert world_floor_bytes("dispatch", precision="mxfp8", hidden=H, tokens=T, selections=[5, 7]).bytes == 846


def test_two_gpus_two_ranks_each():
    # combine, BF16 reads 128 per selection + 384 written per rank: GPU 0 = (2 + 4) * 128 + 768 = 1536,
    # GPU 1 = (6 + 1) * 128 + 768 = 1664 -> the floor is GPU 1's
    wf = world_floor_bytes("combine", precision="bf16", hidden=H, tokens=T, selections=[2, 6, 4, 1],
                           memories=["g0", "g1", "g0", "g1"])
    assert wf.per_memory == {"g0": 1536, "g1": 1664}
    assert (wf.bytes_read, wf.bytes_written) == (7 * 128, 2 * 384)


def test_floor_us():
    assert floor_us(1e9, 1000.0) == pytest.approx(1000.0)  # 1 GB at 1000 GB/s: 1 ms
    assert floor_us(4.2e6, 4200.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        floor_us(1, 0.0)
    with pytest.raises(ValueError, match="memories"):
        world_floor_bytes("dispatch", precision="bf16", hidden=H, tokens=T, selections=[1, 2], memories=["a"])
