"""The combine-direction math of the nvshmem backend written out in plain torch, for the CPU tests of its kernels
(tests/ep/test_nvshmem_dataflow.py, test_nvshmem_combine_ranks.py, test_put_path_ranks.py): one row per (token,
rank).

For an origin's token ``t`` with slots ``j`` on ranks ``dest_rank[t, j]`` (-1 dropped) at rows ``dest_row[t, j]``:
the partial of rank ``d`` is ``P_d = sum_j w[t, j] * out_d[row_j]`` over the slots on ``d``, in fp32, ``j`` ascending,
each product rounded before the add (no FMA); ``y[t] = bf16(sum_i Tq(P_{d_i}))`` over the token's ranks in the order
of their first slot, ``Tq`` the transport rounding (MXFP8 row-wise quantize + decode saturated to bf16's range, or a
BF16 round trip). Unweighted (dispatch backward): every weight 1. Written independently of the kernels and of
``mxcomm.ep.reference`` (loops, no vectorised shortcuts)."""
import torch

from mxcomm.mx import quantize


BF16_MAX = torch.finfo(torch.bfloat16).max


def tq(P: torch.Tensor, q: bool, mode: str = "rceil") -> torch.Tensor:
    """The transport rounding of fp32 rows ``P`` ``[n, H]``: MXFP8 (``q``) or BF16, back to fp32."""
    if q:
        return quantize(P, mode=mode).dequantize(torch.float32, saturate_to=torch.bfloat16)
    keep = torch.isfinite(P)  # a finite value saturates at the BF16 range instead of becoming Inf
    return torch.where(keep, P.clamp(-BF16_MAX, BF16_MAX), P).to(torch.bfloat16).to(torch.float32)


def token_ranks(dest_rank: torch.Tensor, t: int) -> list:
    """The ranks of token ``t``'s valid slots in the order of their first appearance."""
    seen = []
    for d in dest_rank[t].tolist():
        if d >= 0 and d not in seen:
            seen.append(d)
    return seen


def partial(dest_rank, dest_row, outs, w, t: int, d: int) -> torch.Tensor:
    """fp32 ``[H]``: rank ``d``'s partial of token ``t`` (``outs[d]`` fp32 ``[R_d, H]``; ``w`` None: weights 1)."""
    acc = torch.zeros(outs[d].shape[1], dtype=torch.float32)
    for j in range(dest_rank.shape[1]):
        if int(dest_rank[t, j]) == d:
            v = outs[d][int(dest_row[t, j])].float()
            acc = acc + (w[t, j].float() * v if w is not None else v)
    return acc


def combine(dest_rank, dest_row, outs, w, q: bool, mode: str = "rceil") -> torch.Tensor:
    """bf16 ``[T, H]``: the origin's combine (``w`` given) or dispatch backward (``w`` None) result."""
    T = dest_rank.shape[0]
    H = outs[0].shape[1] if outs else 0
    y = torch.zeros(T, H, dtype=torch.float32)
    fin = torch.ones(T, H, dtype=torch.bool)
    for t in range(T):
        acc = torch.zeros(H, dtype=torch.float32)
        for d in token_ranks(dest_rank, t):
            v = tq(partial(dest_rank, dest_row, outs, w, t, d)[None], q, mode)[0]
            acc = acc + v
            fin[t] &= torch.isfinite(v)
        y[t] = acc
    # the sum of finite partials saturates at the BF16 range; a partial that is Inf or NaN passes through
    return torch.where(fin, y.clamp(-BF16_MAX, BF16_MAX), y).to(torch.bfloat16)


def route_grad(dest_row, gy, out) -> torch.Tensor:
    """float64 ``[T, k]``: ``<gy[t], out[dest_row[t, j]]>`` (0 for a dropped slot), one rank's rows ``out``."""
    T, k = dest_row.shape
    gw = torch.zeros(T, k, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            r = int(dest_row[t, j])
            if r >= 0:
                gw[t, j] = (gy[t].double() * out[r].double()).sum()
    return gw


def assert_bf16_same(got: torch.Tensor, want: torch.Tensor, msg: str = "", signed_zero: bool = True) -> None:
    """Bit-exact bf16 tensors, except that any NaN equals any NaN (kernels and torch differ in NaN payloads);
    ``signed_zero=False``: -0 equals +0 too."""
    assert got.shape == want.shape, (msg, got.shape, want.shape)
    gn, wn = got.isnan(), want.isnan()
    assert torch.equal(gn, wn), (msg, "NaN positions differ", torch.nonzero(gn != wn)[:8].tolist())
    gb = torch.where(gn, 0, got.view(torch.int16))
    wb = torch.where(wn, 0, want.view(torch.int16))
    if not signed_zero:
        gb, wb = torch.where(got == 0, 0, gb), torch.where(want == 0, 0, wb)
    bad = torch.nonzero(gb != wb)
    assert not len(bad), (msg, "bits differ at", bad[:8].tolist(),
                          *((got[tuple(bad[0])].item(), want[tuple(bad[0])].item()) if len(bad) else ()))


def ptrs(ts) -> torch.Tensor:
    """int64 address table of tensors (one simulated rank each)."""
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)


def routings(Ts, E: int, k: int, g: torch.Generator, drop: float, hot=None) -> list:
    """Per rank, random top-``k`` expert ids ``[T, k]`` of ``E`` (distinct per token, a ``drop`` fraction of slots
    -1), drawn from ``g`` rank after rank; ``hot``: every token's slot 0 goes to that expert (repeats dropped)."""
    idxs = []
    for T in Ts:
        if T == 0:
            idxs.append(torch.zeros(0, k, dtype=torch.int64))
            continue
        idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k]
        idx[torch.rand(T, k, generator=g) < drop] = -1
        idxs.append(idx)
    if hot is not None:
        for i in idxs:
            if len(i):
                rest = i[:, 1:]
                rest[rest == hot] = -1
                i[:, 0] = hot
    return idxs
