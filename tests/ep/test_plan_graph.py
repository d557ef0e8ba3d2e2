"""mxcomm.ep.nvshmem.plan_graph.OutputCopier: the copies a dispatch handle keeps of a replayed plan - outputs sharing
one storage come back as views of one clone of it (dtype, shape, stride kept), the others through the int32 buffer
that ``fill`` writes; every copy equals its source and owns its memory. On CPU (the copier is plain torch; the
captured graph around it runs in the GPU tests: test_nvshmem_gpu.py's replayed-dispatch test)."""
import dataclasses

import pytest
import torch

from _triton_mode import load_kernels

load_kernels("mxcomm.ep.nvshmem.plan_kernels")

from mxcomm.ep.nvshmem import plan_kernels as pk  # noqa: E402
from mxcomm.ep.plan import PLAN_TENSORS, local_counts  # noqa: E402
from mxcomm.ep.nvshmem.plan_graph import CopiedPlan, OutputCopier, PlanOutputs  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_copier_views_of_one_storage_and_separate_tensors():
    flat = torch.arange(40, dtype=torch.int32, device=DEV)
    named = {
        "a": flat[0:4], "b": flat[4:10].view(2, 3), "c": flat[10:12], "d": flat[12:24].view(3, 4)[:, 1:3],  # strided
        "e": torch.tensor([7, -1, 3], dtype=torch.int64, device=DEV),  # another storage, int64
        "f": torch.full((2, 2), 5, dtype=torch.int32, device=DEV),
    }
    want = {n: t.clone() for n, t in named.items()}
    cp = OutputCopier(named)
    assert sorted(cp.aux_names) == ["e", "f"]  # the largest group (the flat buffer's views) is the main storage
    cp.fill()
    named["e"].fill_(100)  # changed after fill: the copy keeps the fill-time values of aux outputs
    got = cp.copy()
    for n, t in want.items():
        assert got[n].shape == t.shape, n
        assert torch.equal(got[n].to(torch.int64), t.to(torch.int64)), n
    assert got["a"].dtype == torch.int32 and got["e"].dtype == torch.int32  # aux outputs come back int32
    assert got["d"].stride() == named["d"].stride()
    flat.fill_(-9)  # the copies own their memory
    named["f"].fill_(-9)
    for n in ("a", "b", "c", "d", "f"):
        assert torch.equal(got[n].to(torch.int64), want[n].to(torch.int64)), n
    again = cp.copy()  # a later copy reads the main storage now (what a replay refreshed)
    assert bool((again["b"] == -9).all()) and torch.equal(again["f"], want["f"])


@pytest.mark.parametrize("T,k,E,W,rank", [(13, 3, 8, 1, 0), (9, 2, 8, 2, 1), (0, 2, 4, 1, 0)])
def test_copier_on_real_plan_outputs(T, k, E, W, rank):
    """What PlanGraph copies: the Triton plan's tensors (one buffer) and the checked ids (another)."""
    g = torch.Generator().manual_seed(T + k + E)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k,
                                                                                                     dtype=torch.int64)
    if T:
        idx[torch.rand(T, k, generator=g) < 0.2] = -1
    err = torch.zeros(1, dtype=torch.int64, device=DEV)
    c = pk.check_and_count(idx.to(DEV), E, err, check=True)
    counts = torch.stack([local_counts(idx, E)] + [torch.randint(0, 4, (E,), generator=g, dtype=torch.int32)
                                                   for _ in range(W - 1)])
    counts = counts.roll(rank, 0).to(torch.int32).to(DEV)
    out = pk.triton_plan(counts, c.ids, rank, 32, 64, prefix=c.slot_prefix)
    po = PlanOutputs(plan=out["plan"], extra={"origin_src": out["origin_src"], "origin_pos": out["origin_pos"],
                                              "ids": c.ids})
    named = po.named()
    assert list(named) == [*PLAN_TENSORS, "origin_src", "origin_pos", "ids"]
    cp = OutputCopier(named)
    assert cp.aux_names == ["ids"]
    cp.fill()
    got = cp.copy()
    for n, t in named.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
        assert torch.equal(got[n], t), n
        if t.numel():  # (empty tensors have no memory to share)
            assert got[n].untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), n
    # and back as the plan and the extra maps (what a snapshot and a captured call's plan copy return): the same
    # scalars, the copies' tensors
    back = PlanOutputs.from_named(got, PlanOutputs.scalars_of(po.plan))
    for f in dataclasses.fields(po.plan):
        v, w = getattr(back.plan, f.name), getattr(po.plan, f.name)
        if f.name in PLAN_TENSORS:
            assert v is got[f.name], f.name
        else:
            assert v == w, f.name
    assert set(back.extra) == {"origin_src", "origin_pos", "ids"} and all(back.extra[n] is got[n] for n in back.extra)

    # read lazily from a copy (what a captured call's plan copy returns): a CopiedPlan whose tensors named in `now` are
    # made at once and the others at their first read, equal to the eager views, kept once made; the extra maps up front
    copy = cp.clone()
    lazy = PlanOutputs.of_copy(copy, PlanOutputs.scalars_of(po.plan), now=("offs", "dest_row"))
    assert isinstance(lazy.plan, CopiedPlan) and set(PLAN_TENSORS) & set(vars(lazy.plan)) == {"offs", "dest_row"}
    assert set(lazy.extra) == {"origin_src", "origin_pos", "ids"}
    for f in dataclasses.fields(po.plan):
        v, w = getattr(lazy.plan, f.name), getattr(po.plan, f.name)
        if f.name in PLAN_TENSORS:
            assert v.dtype == w.dtype and v.shape == w.shape and v.stride() == w.stride(), f.name
            assert torch.equal(v, w) and getattr(lazy.plan, f.name) is v, f.name
            if v.numel():
                assert v.untyped_storage().data_ptr() == copy.main.untyped_storage().data_ptr(), f.name
        else:
            assert v == w, f.name
    for n, t in lazy.extra.items():
        assert torch.equal(t, named[n]), n
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = lazy.plan.nope
    with pytest.raises(dataclasses.FrozenInstanceError):
        lazy.plan.offs = None
