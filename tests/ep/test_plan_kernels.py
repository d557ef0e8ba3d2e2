"""The routing plan in Triton kernels (mxcomm.ep.nvshmem.plan_kernels) against the torch plan (build_plan,
row_origins): every tensor identical, on random routings with dropped slots, empty
experts, all tokens on one expert, all slots on one expert, all slots dropped, zero tokens, worlds 1-8,
align 32/128, slots over several blocks of the slot kernels (also with small blocks and scan tiles).
CPU: Triton interpreter; GPU: the same cases on CUDA plus a DeepSeek-sized one."""
import random
from dataclasses import replace

import pytest
import torch

from _triton_mode import load_kernels, run_aot

load_kernels("mxcomm.ep.nvshmem.plan_kernels")

from mxcomm.ep.nvshmem import plan_kernels as pk  # noqa: E402
from mxcomm.ep.nvshmem.backend import row_origins  # noqa: E402
from mxcomm.ep.plan import PLAN_TENSORS, build_plan, local_counts  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _routing(rng, T, k, E, drop_p, mode):
    idx = torch.stack([torch.randperm(E, generator=rng)[:k] for _ in range(T)]) if T else torch.zeros(0, k,
                                                                                                       dtype=torch.int64)
    if mode == "one_expert" and T:
        idx[:, 0] = 0
        idx[:, 1:] = torch.where(idx[:, 1:] == 0, torch.full_like(idx[:, 1:], -1), idx[:, 1:])
    if mode == "subset" and T:
        idx = torch.where(idx < max(k + 1, E // 4), idx, torch.full_like(idx, -1))
    if mode == "all_one":  # every slot to expert E // 2 (k = 1)
        idx = torch.full_like(idx, E // 2)
    if mode == "all_dropped":
        idx = torch.full_like(idx, -1)
    drop = torch.rand(T, k, generator=rng) < drop_p
    return torch.where(drop, torch.full_like(idx, -1), idx).to(torch.int32)


def _case(W, E, k, tokens, align, drop_p, mode, seed):
    rng = torch.Generator().manual_seed(seed)
    idxs = [_routing(rng, T, k, E, drop_p, mode) for T in tokens]
    counts = torch.stack([local_counts(i, E) for i in idxs])
    return counts, idxs


def _compare(counts, idx, rank, align, R, checked=False):
    """``checked``: the ids (as int64) go through check_and_count first and the plan reads its block table, as in
    the nvshmem backend; else triton_plan builds the table itself."""
    want = build_plan(counts, idx, rank, align)
    if checked:
        err = torch.zeros(1, dtype=torch.int64, device=DEV)
        c = pk.check_and_count(idx.to(torch.int64).to(DEV), counts.shape[1], err, check=True)
        assert int(err) == 0 and torch.equal(c.ids.cpu(), idx) and torch.equal(c.counts.cpu(), local_counts(idx, counts.shape[1]))
        got = pk.triton_plan(counts.to(DEV), c.ids, rank, align, R, prefix=c.slot_prefix)
    else:
        got = pk.triton_plan(counts.to(DEV), idx.to(DEV), rank, align, R)
    bad = []
    for f in PLAN_TENSORS:
        a, b = getattr(got["plan"], f).cpu(), getattr(want, f)
        if a.dtype != torch.int32 or not a.is_contiguous() or a.shape != b.shape or not torch.equal(a, b):
            bad.append(f"{f}: got {a.shape} {a.flatten()[:12].tolist()} want {b.shape} {b.flatten()[:12].tolist()}")
    o = row_origins(want, R)
    if not (torch.equal(got["origin_src"].cpu(), o.src) and torch.equal(got["origin_pos"].cpu(), o.pos)):
        bad.append("row origins")
    return bad


CASES = [  # W, E, k, tokens per rank, align, drop_p, routing
    (1, 4, 2, (13,), 32, 0.0, "random"),
    (2, 8, 3, (20, 0), 32, 0.3, "random"),
    (2, 8, 2, (17, 9), 128, 0.0, "one_expert"),
    (4, 16, 4, (9, 31, 0, 5), 32, 0.2, "subset"),
    (4, 8, 8, (7, 7, 7, 7), 128, 0.5, "random"),
    (8, 64, 8, (33, 0, 12, 40, 1, 2, 3, 64), 32, 0.1, "random"),
    (3, 6, 1, (0, 0, 0), 32, 0.0, "random"),
]


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("W,E,k,tokens,align,drop_p,mode", CASES)
def test_triton_plan_equals_torch_plan(W, E, k, tokens, align, drop_p, mode, checked):
    counts, idxs = _case(W, E, k, tokens, align, drop_p, mode, seed=W * 100 + E + k)
    R = sum(tokens) * k + (E // W) * align + 7  # more rows than any rank receives (tail rows: -1)
    bad = []
    for rank in range(W):
        bad += [f"rank {rank}: {b}" for b in _compare(counts, idxs[rank], rank, align, R, checked)]
    assert not bad, "\n".join(bad[:20])


STRESS = [  # several slot blocks, T*k mostly not a multiple of the block
    (8, 256, 8, (300, 17, 0, 64, 5, 129, 1, 40), 32, 0.05, "random"),  # many experts
    (4, 32, 4, (97, 64, 0, 33), 32, 0.2, "subset"),                    # few experts, each over many blocks
    (2, 8, 1, (300, 7), 32, 0.0, "all_one"),                           # every slot to one expert
    (2, 6, 3, (100, 50), 128, 0.0, "all_dropped"),
    (2, 10, 2, (64, 3), 128, 0.3, "one_expert"),                       # T*k = one default block exactly
]


@pytest.mark.parametrize("block,scan_rows,scan_keys,programs", [(None, None, None, None), (16, 32, 64, 3)])
@pytest.mark.parametrize("W,E,k,tokens,align,drop_p,mode", STRESS)
def test_triton_plan_slot_blocks(monkeypatch, W, E, k, tokens, align, drop_p, mode, block, scan_rows, scan_keys,
                                 programs):
    """Slot kernels over many blocks: the default block, and blocks of 16 slots with a scan over 32
    blocks x 64 keys at a time (several scan steps and key chunks with E = 256), the plan kernel's two groups
    at 3 programs each (every program loops over several slot blocks and row blocks of 16 rows)."""
    if block:
        monkeypatch.setattr(pk, "_SLOT_BLOCK", block)
        monkeypatch.setattr(pk, "_SCAN_ROWS", scan_rows)
        monkeypatch.setattr(pk, "_SCAN_KEYS", scan_keys)
        monkeypatch.setattr(pk, "_MAX_PROGRAMS", programs)
        monkeypatch.setattr(pk, "_ORIGIN_ROWS", 16)
    counts, idxs = _case(W, E, k, tokens, align, drop_p, mode, seed=W * 10 + E + k + 7)
    R = sum(tokens) * k + (E // W) * align + 3
    bad = []
    for rank in range(W):
        bad += [f"rank {rank}: {b}" for b in _compare(counts, idxs[rank], rank, align, R, checked=rank % 2 == 1)]
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("programs", [None, 2])
@pytest.mark.parametrize("W,E,k,tokens,align,drop_p,mode", CASES + STRESS[:2])
def test_plan_row_origins_from_the_plan_alone(monkeypatch, W, E, k, tokens, align, drop_p, mode, programs):
    """plan_row_origins (the row origins of a kept plan, from its counts) equals the torch row_origins, also with
    2 programs each looping over row blocks of 16 rows."""
    if programs:
        monkeypatch.setattr(pk, "_MAX_PROGRAMS", programs)
        monkeypatch.setattr(pk, "_ORIGIN_ROWS", 16)
    counts, idxs = _case(W, E, k, tokens, align, drop_p, mode, seed=W * 7 + E + k)
    R = sum(tokens) * k + (E // W) * align + 5
    for rank in range(W):
        plan = build_plan(counts, idxs[rank], rank, align)
        want = row_origins(plan, R)
        got = pk.plan_row_origins(replace(plan, counts=plan.counts.to(torch.int32).to(DEV)), R)
        assert torch.equal(got["origin_src"].cpu(), want.src), f"rank {rank}: origin ranks"
        assert torch.equal(got["origin_pos"].cpu(), want.pos), f"rank {rank}: origin positions"


@pytest.mark.parametrize("W,E,k,tokens,align,drop_p,mode", [CASES[0], CASES[3], CASES[5]])
def test_plan_writes_the_status_words(W, E, k, tokens, align, drop_p, mode):
    """With ``status`` the tables program also writes ``status[2]`` = the plan's row count and, given the refusal
    words, ``status[3]`` = 1 + the lowest refusing rank (0 when none refused); the error words ``status[:2]`` and,
    without refusal words, ``status[3]`` stay as they were; without ``status`` the plan's own outputs stay exact."""
    counts, idxs = _case(W, E, k, tokens, align, drop_p, mode, seed=W + 3 * E)
    R = sum(tokens) * k + (E // W) * align
    for rank in range(W):
        want_rows = int(build_plan(counts, idxs[rank], rank, align).num_rows)
        patterns = [[0] * W, [0] * (W - 1) + [9]] + ([[0, 5, 0, -1][:W], [1] * W] if W > 1 else [])
        for words in [None] + patterns:
            status = torch.tensor([11, 22, 33, 44], dtype=torch.int64, device=DEV)
            refusals = None if words is None else torch.tensor(words, dtype=torch.int32, device=DEV)
            out = pk.triton_plan(counts.to(DEV), idxs[rank].to(DEV), rank, align, R, status=status, refusals=refusals)
            first = 44 if words is None else next((i + 1 for i, v in enumerate(words) if v), 0)
            assert status.tolist() == [11, 22, want_rows, first], (rank, words, status.tolist())
            assert int(out["plan"].num_rows) == want_rows
        # without status the kernel gets a stand-in pointer it must not write through (the row-origin map)
        out = pk.triton_plan(counts.to(DEV), idxs[rank].to(DEV), rank, align, R,
                             refusals=torch.ones(W, dtype=torch.int32, device=DEV))
        want = row_origins(build_plan(counts, idxs[rank], rank, align), R)
        assert torch.equal(out["origin_src"].cpu(), want.src) and torch.equal(out["origin_pos"].cpu(), want.pos)


def test_fits_limits_the_counts_tile():
    assert pk.fits(8, 256) and pk.fits(64, 256) and not pk.fits(64, 4096)


@pytest.mark.gpu
def test_gpu_triton_plan_deepseek_sized():
    rng = random.Random(3)
    counts, idxs = _case(8, 256, 8, tuple(rng.choice([0, 4096, 4000, 1]) for _ in range(8)), 32, 0.05, "random", 5)
    R = sum(i.shape[0] for i in idxs) * 8 + 32 * 32
    bad = []
    for rank in (0, 3, 7):
        bad += [f"rank {rank}: {b}" for b in _compare(counts, idxs[rank], rank, 32, R)]
    assert not bad, "\n".join(bad[:20])


def test_triton_plan_random_configs():
    """40 random configurations (world, experts, top-k, tokens, align, drops, routing), every rank."""
    rng = random.Random(11)
    bad = []
    for i in range(40):
        W = rng.choice([1, 2, 3, 4, 8])
        El = rng.choice([1, 2, 3, 5, 8])
        E = W * El
        k = rng.randint(1, min(E, 8))
        tokens = tuple(rng.choice([0, 1, rng.randint(0, 40)]) for _ in range(W))
        align = rng.choice([32, 128])
        counts, idxs = _case(W, E, k, tokens, align, rng.choice([0.0, 0.3]),
                             rng.choice(["random", "subset", "one_expert"]), seed=1000 + i)
        R = sum(tokens) * min(k, El) + El * align + rng.randint(0, 5)
        for rank in range(W):
            bad += [f"config {i} (W={W} E={E} k={k} T={tokens}) rank {rank}: {b}"
                    for b in _compare(counts, idxs[rank], rank, align, R, checked=i % 2 == 1)]
    assert not bad, "\n".join(bad[:20])


_AOT = '''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mxcomm.ep.nvshmem import plan_kernels as pk

def compile(fn, **consts):
    names = list(fn.arg_names)
    sig = {n: ("constexpr" if n in consts else ("*i32" if n.endswith("_ptr") else "i32")) for n in names}
    sig.update({n: "*i64" for n in names if n in ("err_ptr", "status_ptr", "epoch_ptr")})
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]

compile(pk.slot_check_hist_kernel, K=8, K_POW2=8, TOK=16, CHECK=True, ZERO_BLOCK=512)
compile(pk.slot_check_hist_kernel, K=6, K_POW2=8, TOK=16, CHECK=False, ZERO_BLOCK=512)
compile(pk.slot_scan_kernel, BLOCK_B=256, BLOCK_K=8)
compile(pk.plan_kernel, W_POW2=8, EL_POW2=32, S=128, S_POW2=128, BLOCK=128, STATUS=True)
compile(pk.plan_kernel, W_POW2=4, EL_POW2=64, S=96, S_POW2=128, BLOCK=128, STATUS=False)
compile(pk.plan_kernel, W_POW2=1, EL_POW2=256, S=128, S_POW2=128, BLOCK=128, STATUS=True)
# a launch specializes ints equal to 1 as constants (one rank, one expert, one slot, rank 1)
compile(pk.plan_kernel, W_POW2=1, EL_POW2=1, S=16, S_POW2=16, BLOCK=128, STATUS=True, me=1, W=1, El=1, align=1,
        n_slots=1, n_rows=1, table_programs=1, slot_programs=1, n_refusal=1, c_stride=1)
print("ok")
'''


def test_plan_kernels_compile_for_sm90(tmp_path):
    """The plan kernels compile for sm_90 (a fresh process without the interpreter)."""
    assert "ok" in run_aot(_AOT, tmp_path)


def _check_reference(idx: torch.Tensor, E: int):
    """Plain-Python reference of the no-sync id check: out-of-range ids and every repeat of an id after its
    first occurrence in a token become -1; counts of the kept ids; number of dropped slots."""
    out, counts, nbad = idx.clone(), torch.zeros(E, dtype=torch.int32), 0
    for t in range(idx.shape[0]):
        seen = set()
        for j in range(idx.shape[1]):
            v = int(idx[t, j])
            if v == -1:
                continue
            if not 0 <= v < E or v in seen:
                out[t, j] = -1
                nbad += 1
                continue
            seen.add(v)
            counts[v] += 1
    return out, counts, nbad


def _prefix_reference(ids: torch.Tensor, E: int) -> torch.Tensor:
    """Per block of ``tokens_per_block(k)`` tokens and key (expert id, ``E`` = dropped): slots of that key in the
    lower blocks."""
    T, k = ids.shape
    tok = pk.tokens_per_block(k)
    keys = torch.where(ids < 0, E, ids).to(torch.int64)
    rows = [torch.bincount(keys[b:b + tok].reshape(-1), minlength=E + 1) for b in range(0, T, tok)]
    if not rows:
        return torch.zeros(0, E + 1, dtype=torch.int32)
    h = torch.stack(rows)
    return (torch.cumsum(h, 0) - h).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("T,k,E", [(0, 2, 4), (1, 1, 3), (37, 4, 8), (200, 8, 64), (50, 3, 5), (70, 6, 300)])
def test_check_and_count(T, k, E, check, dtype):
    """Checked ids, counts, error count and the slot kernels' block table against plain-Python references, int32
    and int64 ids (an int64 id past the int32 range is caught before narrowing)."""
    g = torch.Generator().manual_seed(T * 7 + k + E)
    idx = torch.randint(-1, E, (T, k), generator=g, dtype=torch.int64)  # repeats happen at random
    if check and T:
        idx[0, 0] = E + 3
        idx[-1, -1] = -5
        if dtype == torch.int64 and T > 2:
            idx[1, 0] = 2 ** 32 + 1  # narrowed blindly it would be the valid id 1
    if not check:  # without the check the ids must be valid and distinct per token
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else idx
    err = torch.zeros(1, dtype=torch.int64, device=DEV)
    got = pk.check_and_count(idx.to(dtype).to(DEV), E, err, check=check)
    want, want_counts, nbad = _check_reference(idx, E)
    assert torch.equal(got.ids.cpu(), want.to(torch.int32)) and torch.equal(got.counts.cpu(), want_counts)
    assert got.slot_prefix.shape == (pk.slot_blocks(T, k), E + 1)
    assert torch.equal(got.slot_prefix.cpu(), _prefix_reference(want, E))
    assert int(err) == nbad and (nbad > 0) == (check and T > 0)


def test_check_and_count_writes_the_given_buffers():
    """The block table lands in ``prefix_buf`` (a fixed address a captured plan reads) and the counts in
    ``counts_out``; a too-small ``prefix_buf`` is refused before any kernel runs."""
    E, idx = 16, torch.tensor([[3, 1], [1, -1], [15, 3]], dtype=torch.int64)
    buf = torch.full((64,), -7, dtype=torch.int32, device=DEV)
    counts = torch.full((E,), -7, dtype=torch.int32, device=DEV)
    err = torch.zeros(1, dtype=torch.int64, device=DEV)
    got = pk.check_and_count(idx.to(DEV), E, err, check=True, prefix_buf=buf, counts_out=counts)
    assert got.slot_prefix.data_ptr() == buf.data_ptr() and got.counts.data_ptr() == counts.data_ptr()
    assert torch.equal(counts.cpu(), local_counts(idx, E))
    with pytest.raises(ValueError, match="prefix_buf holds 8 values"):
        pk.check_and_count(idx.to(DEV), E, err, check=True, prefix_buf=buf[:8])


@pytest.mark.parametrize("T", [3, 0])
def test_check_and_count_ids_into_given_buffers(T):
    """``ids_out`` receives the checked ids (the head of a plan storage; the rest untouched), ``err`` this call's
    bad slots added to what it held; the plan written after the ids in the same storage equals the torch plan."""
    E, k = 16, 2
    idx = torch.tensor([[3, 1], [1, 1], [15, 16]], dtype=torch.int64)[:T]
    store = pk.plan_storage(1, E, T, k, 0, DEV).fill_(-7)
    err = torch.full((1,), 5, dtype=torch.int64, device=DEV)
    got = pk.check_and_count(idx.to(DEV), E, err, check=True, ids_out=store)
    want_ids, want_counts, nbad = _check_reference(idx, E)
    assert got.ids.untyped_storage().data_ptr() == store.untyped_storage().data_ptr()
    assert torch.equal(got.ids.cpu(), want_ids.to(torch.int32))
    assert int(err) == 5 + nbad
    assert (store[T * k:] == -7).all()
    out = pk.triton_plan(got.counts.view(1, E), got.ids, 0, 32, 0, prefix=got.slot_prefix, origins=False,
                         out=store[T * k:])
    assert out["plan"].offs.untyped_storage().data_ptr() == store.untyped_storage().data_ptr()
    want = build_plan(want_counts.view(1, E), want_ids.to(torch.int32), 0, 32)
    for f in PLAN_TENSORS:
        assert torch.equal(getattr(out["plan"], f).cpu(), getattr(want, f)), f
    with pytest.raises(ValueError, match="out holds"):
        pk.triton_plan(got.counts.view(1, E), got.ids, 0, 32, 0, prefix=got.slot_prefix, origins=False,
                       out=store[:3])
