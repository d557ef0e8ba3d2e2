"""Triton grouped GEMM for Hopper (and the interpreter): ``y[rows of group g] = a[rows] @ W_g^T``, with E4M3
operands decoded and scaled in the load path.

Each operand tile is turned into exactly the BF16 values :func:`mxcomm.mx.dequantize` gives
(``bf16(e4m3(q) * 2**(s - 127))`` - exact unless the product is a BF16 subnormal, then RNE), multiplied with
``tl.dot`` in BF16 with fp32 accumulation, and written as BF16 (RNE). So it computes the same function as the
``dequant`` backend (dequantize, then BF16 grouped GEMM) without the BF16 copies in memory.

Tile schedule (no host sync): a 1D grid of ``(cdiv(M, BLOCK_M) + G) * cdiv(N, BLOCK_N)`` programs, an
upper bound on the M-tiles of all groups; each program finds its group from the int32 end offsets with a
prefix sum over the ``G`` groups and exits if it is past the last tile. M-tiles are visited in
``GROUP_M``-swizzled order for L2 reuse. Rows past ``offs[-1]`` are zeroed by :func:`zero_rows_past_end`.

Also here: :func:`zero_rows_past_end` (used after every grouped GEMM whose kernel leaves those rows
unwritten, e.g. ``torch._grouped_mm``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..kernels.launch import cdiv, next_pow2
from ..kernels.mx_device import BF16_MAX, bf16_rne_int, blocked_scale_offset, mx_decode_tile, mx_saturate, mx_scale_value
from ..mx import MXTensor, ScaleLayout
from ..mx.scales import BLOCK
from . import _ops

LAYOUT_ROW = 0
LAYOUT_GROUPED = 2


# ----------------------------------------------------------------------------------------------
# device functions
# ----------------------------------------------------------------------------------------------
@triton.jit
def group_of_tile(offs_ptr, n_groups, tile_m, BLOCK_M: tl.constexpr, G_POW2: tl.constexpr):
    """Locate global M-tile ``tile_m`` among groups given by int32 end offsets (each group's rows cut into
    ``cdiv(size, BLOCK_M)`` tiles, groups in order).

    Returns ``(g, row0, g_start, g_end, s_start, total)``: the group, the tile's first row, the group's row
    range, the group's first row in a grouped-along-M (128-padded) scale matrix, and the total tile count
    (``tile_m >= total`` means: no tile).
    """
    g = tl.arange(0, G_POW2)
    gm = g < n_groups
    end = tl.load(offs_ptr + g, mask=gm, other=0)
    start = tl.load(offs_ptr + g - 1, mask=gm & (g > 0), other=0)
    size = tl.where(gm, end - start, 0)
    tiles = (size + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, 0)
    total = tl.sum(tiles, 0)
    grp = tl.sum((cum <= tile_m).to(tl.int32), 0)
    sel = g == grp
    first_tile = tl.sum(tl.where(sel, cum - tiles, 0), 0)
    g_start = tl.sum(tl.where(sel, start, 0), 0)
    g_end = tl.sum(tl.where(sel, end, 0), 0)
    s_start = tl.sum(tl.where(g < grp, (size + 127) // 128 * 128, 0), 0)
    row0 = g_start + (tile_m - first_tile) * BLOCK_M
    return grp, row0, g_start, g_end, s_start, total


@triton.jit
def dequant_tile_bf16(q, b, INT_ROUND: tl.constexpr):
    """E4M3 bytes ``q [R, NB, 32]`` (uint8) and E8M0 bytes ``b [R, NB]`` -> bf16 ``e4m3(q) * 2**(b-127)``, saturated
    to +-bf16 max (:func:`mxcomm.mx.dequantize`'s rule, NaN stays NaN).

    INT_ROUND: decode and round by integer arithmetic (exact in the interpreter); else hardware casts
    (e4m3 -> bf16 is exact, the power-of-two product in bf16 is the RNE rounding of the exact product; a product
    above the bf16 max is at least 2**128, so it is Inf there and saturates the same way).
    """
    if INT_ROUND:
        out = bf16_rne_int(mx_decode_tile(q, b, True, BF16_MAX, 2))
    else:
        v = q.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        out = mx_saturate(v * tl.expand_dims(mx_scale_value(b.to(tl.int32)).to(tl.bfloat16), 2), BF16_MAX)
    return out


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _grouped_mm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, offs_ptr, out_ptr,
    M, N, n_groups, as_cols, K: tl.constexpr,
    A_MX: tl.constexpr, A_LAYOUT: tl.constexpr, W_MX: tl.constexpr, INT_ROUND: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    G_POW2: tl.constexpr,
):
    """out[M, N] bf16 = per group g: a[rows_g, :K] @ w[g, :N, :K]^T.

    a: ``[M, K]`` E4M3 bytes with scales ``as`` (A_LAYOUT 0: row ``[M, K/32]``; 2: grouped_m blocked with
    ``as_cols`` columns) if A_MX, else bf16. w: ``[G, N, K]`` E4M3 bytes with row scales ``ws [G, N, K/32]``
    if W_MX, else bf16. DOT_F32 (interpreter only) multiplies the bf16 tiles as fp32. K % 32 == 0; K is a
    constexpr (the loop bound: the interpreter's range() cannot take a runtime bound; one compile per size).
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.cdiv(M, BLOCK_M) + n_groups
    per_band = GROUP_M * num_pid_n
    band = pid // per_band
    first_m = band * GROUP_M
    band_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_band) % band_m
    pid_n = (pid % per_band) // band_m
    grp, row0, g_start, g_end, s_start, total = group_of_tile(offs_ptr, n_groups, pid_m, BLOCK_M, G_POW2)
    if pid_m < total:
        NKB: tl.constexpr = BLOCK_K // 32
        nkb = K // 32
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < g_end
        rows64 = rows.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < N
        cols64 = cols.to(tl.int64)
        kb = tl.arange(0, NKB)
        j = tl.arange(0, 32)
        w_base = grp.to(tl.int64) * N * K
        ws_base = grp.to(tl.int64) * N * nkb
        srow = s_start + (rows - g_start)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kbs = k0 // 32 + kb
            kbm = kbs < nkb
            kcol = kbs[None, :, None] * 32 + j[None, None, :]  # [1, NKB, 32]
            am = rmask[:, None, None] & kbm[None, :, None]
            a_off = rows64[:, None, None] * K + kcol
            if A_MX:
                aq = tl.load(a_ptr + a_off, mask=am, other=0)
                if A_LAYOUT == 0:
                    as_off = rows64[:, None] * nkb + kbs[None, :]
                else:
                    as_off = blocked_scale_offset(srow[:, None], kbs[None, :], as_cols // 4)
                asb = tl.load(as_ptr + as_off, mask=rmask[:, None] & kbm[None, :], other=0)
                a3 = dequant_tile_bf16(aq, asb, INT_ROUND)
            else:
                a3 = tl.load(a_ptr + a_off, mask=am, other=0.0)
            wm = nmask[:, None, None] & kbm[None, :, None]
            w_off = w_base + cols64[:, None, None] * K + kcol
            if W_MX:
                wq = tl.load(w_ptr + w_off, mask=wm, other=0)
                wsb = tl.load(ws_ptr + ws_base + cols64[:, None] * nkb + kbs[None, :],
                              mask=nmask[:, None] & kbm[None, :], other=0)
                w3 = dequant_tile_bf16(wq, wsb, INT_ROUND)
            else:
                w3 = tl.load(w_ptr + w_off, mask=wm, other=0.0)
            a2 = tl.reshape(a3, (BLOCK_M, BLOCK_K))
            w2 = tl.reshape(w3, (BLOCK_N, BLOCK_K))
            if DOT_F32:  # interpreter: its dot multiplies bf16 bit patterns; fp32 holds the bf16 values exactly
                acc = tl.dot(a2.to(tl.float32), tl.trans(w2.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a2, tl.trans(w2), acc)
        if INT_ROUND:
            res = bf16_rne_int(acc)
        else:
            res = acc.to(tl.bfloat16)
        tl.store(out_ptr + rows64[:, None] * N + cols64[None, :], res, mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _wgrad_step(acc, step, go_ptr, x_ptr, xs_ptr, g_start, g_size, s_start, N, K, xs_cols, cols_n, nmask, kbs, kbm,
                kcol, X_MX: tl.constexpr, X_LAYOUT: tl.constexpr, INT_ROUND: tl.constexpr, DOT_F32: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """One BLOCK_M-row step of :func:`_grouped_wgrad_kernel`: acc += go[rows]^T @ x[rows]."""
    nkb = K // 32
    r = step * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < g_size
    rows64 = (g_start + r).to(tl.int64)
    go = tl.load(go_ptr + rows64[:, None] * N + cols_n[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
    xm = rmask[:, None, None] & kbm[None, :, None]
    x_off = rows64[:, None, None] * K + kcol
    if X_MX:
        xq = tl.load(x_ptr + x_off, mask=xm, other=0)
        if X_LAYOUT == 0:
            xs_off = rows64[:, None] * nkb + kbs[None, :]
        else:
            xs_off = blocked_scale_offset((s_start + r)[:, None], kbs[None, :], xs_cols // 4)
        xsb = tl.load(xs_ptr + xs_off, mask=rmask[:, None] & kbm[None, :], other=0)
        x3 = dequant_tile_bf16(xq, xsb, INT_ROUND)
    else:
        x3 = tl.load(x_ptr + x_off, mask=xm, other=0.0)
    x2 = tl.reshape(x3, (BLOCK_M, BLOCK_K))
    if DOT_F32:
        acc = tl.dot(tl.trans(go.to(tl.float32)), x2.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(tl.trans(go), x2, acc)
    return acc


@triton.jit
def _grouped_wgrad_kernel(
    go_ptr, x_ptr, xs_ptr, offs_ptr, out_ptr,
    M, N, K, n_groups, xs_cols,
    X_MX: tl.constexpr, X_LAYOUT: tl.constexpr, INT_ROUND: tl.constexpr, INTERP: tl.constexpr,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    G_POW2: tl.constexpr,
):
    """out[g] (fp32 [N, K]) (+)= go[rows g]^T @ x[rows g] for every group g (2D x 2D, groups along rows).

    go: ``[M, N]`` bf16. x: ``[M, K]`` E4M3 bytes with scales ``xs`` (X_LAYOUT 0: row ``[M, K/32]``; 2: grouped_m
    blocked, ``xs_cols`` columns) if X_MX, else bf16. INTERP: Triton interpreter (fp32 dot, while loop).
    Program (tile, g): one ``[BLOCK_N, BLOCK_K]`` tile of group g's gradient, looping over the group's rows;
    empty groups store zeros (or leave ``out`` unchanged with ACCUMULATE). K % 32 == 0.
    """
    pid = tl.program_id(0)
    g = tl.program_id(1)
    num_k = tl.cdiv(K, BLOCK_K)
    pid_n = pid // num_k
    pid_k = pid % num_k
    gi = tl.arange(0, G_POW2)
    gm = gi < n_groups
    end = tl.load(offs_ptr + gi, mask=gm, other=0)
    start = tl.load(offs_ptr + gi - 1, mask=gm & (gi > 0), other=0)
    size = tl.where(gm, end - start, 0)
    sel = gi == g
    g_start = tl.sum(tl.where(sel, start, 0), 0)
    g_size = tl.sum(tl.where(sel, size, 0), 0)
    s_start = tl.sum(tl.where(gi < g, (size + 127) // 128 * 128, 0), 0)
    NKB: tl.constexpr = BLOCK_K // 32
    nkb = K // 32
    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols_n < N
    kbs = pid_k * NKB + tl.arange(0, NKB)
    kbm = kbs < nkb
    kcol = kbs[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    n_steps = tl.cdiv(g_size, BLOCK_M)
    if INTERP:  # the interpreter's range() cannot take a loaded bound: same step in a while loop, fp32 dot
        step = 0
        while step < n_steps:
            acc = _wgrad_step(acc, step, go_ptr, x_ptr, xs_ptr, g_start, g_size, s_start, N, K, xs_cols, cols_n, nmask,
                              kbs, kbm, kcol, X_MX, X_LAYOUT, INT_ROUND, INTERP, BLOCK_M, BLOCK_K)
            step += 1
    else:
        for step in range(0, n_steps):
            acc = _wgrad_step(acc, step, go_ptr, x_ptr, xs_ptr, g_start, g_size, s_start, N, K, xs_cols, cols_n, nmask,
                              kbs, kbm, kcol, X_MX, X_LAYOUT, INT_ROUND, INTERP, BLOCK_M, BLOCK_K)
    kcols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    o_off = g.to(tl.int64) * N * K + cols_n.to(tl.int64)[:, None] * K + kcols[None, :]
    omask = nmask[:, None] & (kcols < K)[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptr + o_off, mask=omask, other=0.0)
    tl.store(out_ptr + o_off, acc, mask=omask)


@triton.jit
def _zero_tail_kernel(out_ptr, offs_ptr, n_groups, M, N, stride_m,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Zero rows ``[offs[G-1], M)`` of ``out [M, N]`` (all rows if there are no groups)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    last = tl.load(offs_ptr + tl.maximum(n_groups - 1, 0), mask=n_groups > 0, other=0)
    if pid_m * BLOCK_M + BLOCK_M > last:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = ((rows >= last) & (rows < M))[:, None] & (cols < N)[None, :]
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_m + cols[None, :], zero, mask=mask)


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------
def interpret_mode() -> bool:
    """True when this module's kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(_grouped_mm_kernel, InterpretedFunction)


def _check_runnable(t: torch.Tensor, fn: str) -> None:
    if t.device.type != "cuda" and not interpret_mode():
        raise RuntimeError(f"{fn}: tensor on {t.device} but Triton kernels need a CUDA tensor; for CPU tensors set "
                           "TRITON_INTERPRET=1 before mxcomm is first imported")


@dataclass(frozen=True)
class GroupedGemmConfig:
    """Tiles of the Triton grouped GEMM.

    Attributes:
        block_m / block_n: output tile (powers of two >= 16).
        block_k: reduction step (power of two >= 32; E4M3 blocks of 32 stay whole).
        group_m: M-tiles per swizzle band (L2 reuse of weight tiles).
        num_warps / num_stages: Triton launch options (ignored by the interpreter).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.block_k < 32 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k must be a power of two >= 32, got {self.block_k}")
        if self.group_m < 1:
            raise ValueError(f"group_m must be >= 1, got {self.group_m}")


def default_gemm_config(M: int, N: int, K: int, G: int, interpret: bool) -> GroupedGemmConfig:
    """Interpreter: 32x32x32 tiles. GPU: 128x128x64 (8 warps, 3 stages); 64-row tiles when the average group
    has at most 96 rows (fewer padded rows per group)."""
    if interpret:
        return GroupedGemmConfig(block_m=32, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1)
    avg = M / max(G, 1)
    if avg <= 96:
        return GroupedGemmConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
    return GroupedGemmConfig()


def fit_k_step(cfg: GroupedGemmConfig, K: int) -> GroupedGemmConfig:
    """``cfg`` with ``block_k`` at most ``next_pow2(K)`` (and >= 32), for the grouped GEMM's reduction loop.

    A K-step wider than K computes a masked-off part for nothing; and on an H200 (Triton 3.6) K = 32 with
    ``block_k = 64`` gave NaN outputs whenever the weight was MX (any stage count; the activation alone was fine;
    ``block_k = 32`` exact; K = 64, 96, 128 exact with 64). The cause was not found; this keeps launches out of it.
    """
    bk = max(32, min(cfg.block_k, next_pow2(K)))
    return cfg if bk == cfg.block_k else replace(cfg, block_k=bk)


def zero_rows_past_end(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Zero rows ``[offs[-1], M)`` of ``out [M, N]`` in place (no host sync on CUDA); returns ``out``.

    CUDA / interpreter: a Triton kernel that writes only those rows. CPU: a torch mask.
    """
    M, N = out.shape
    if M == 0 or N == 0:
        return out
    if out.device.type != "cuda" and not interpret_mode():
        last = int(offs[-1]) if offs.numel() else 0
        out[last:] = 0
        return out
    if out.stride(1) != 1:
        raise ValueError("zero_rows_past_end needs unit stride along N")
    BM, BN = 32, min(next_pow2(N), 256)
    grid = (cdiv(M, BM), cdiv(N, BN))
    _zero_tail_kernel[grid](out, offs, offs.numel(), M, N, out.stride(0), BLOCK_M=BM, BLOCK_N=BN, num_warps=4)
    return out


def triton_grouped_mm(
    a,
    w,
    offs: torch.Tensor,
    *,
    config: Optional[GroupedGemmConfig] = None,
    int_round: Optional[bool] = None,
) -> torch.Tensor:
    """Grouped GEMM ``out[rows of g] = a[rows of g] @ W_g^T`` with E4M3 decoded in the load path.

    Args:
        a: MXTensor ``[M, K]`` (axis 1, scales in row or grouped_m layout for the same ``offs``) or a bf16
            tensor ``[M, K]``.
        w: :class:`~mxcomm.gemm.weights.MXWeight` ``[G, N, K]`` (any scale layout; blocked is converted) or a
            bf16 tensor ``[G, N, K]``.
        offs: ``[G]`` int32 group end offsets (non-decreasing, ``<= M``; values checked on CPU only).
        config: tiles (default :func:`default_gemm_config`).
        int_round: integer decode/rounding (None = auto: on in the interpreter).
    Returns:
        bf16 ``[M, N]``, rows past ``offs[-1]`` zero.
    """
    from .weights import MXWeight  # local: weights imports backend only, no cycle at import time

    fn = "triton_grouped_mm"
    a_mx = a if isinstance(a, MXTensor) else None
    a_t = a_mx.qdata if a_mx is not None else a
    _check_runnable(a_t, fn)
    interp = interpret_mode()
    ir = (interp or a_t.device.type != "cuda") if int_round is None else bool(int_round)
    if not ir and (interp or a_t.device.type != "cuda"):
        raise ValueError(f"{fn}: int_round=False needs a CUDA tensor outside the interpreter")
    M, K = a_t.shape
    if isinstance(w, MXWeight):
        w = w.with_layout(ScaleLayout.ROW)
        G, N, Kw = w.shape
        w_ptr, ws_ptr, w_mx = w.qdata.view(torch.uint8), w.scales, True
    else:
        G, N, Kw = w.shape
        w_ptr, ws_ptr, w_mx = w.to(torch.bfloat16).contiguous(), None, False
    if Kw != K:
        raise ValueError(f"{fn}: a has K={K} but the weights have K={Kw}")
    if w_ptr.device != a_t.device:
        raise ValueError(f"{fn}: a is on {a_t.device} but the weights are on {w_ptr.device}")
    offs = _ops.check_offs(offs, G, a_t.device, fn)
    _ops.check_offs_values(offs, M, fn)
    if K % BLOCK:
        raise ValueError(f"{fn}: K={K} is not a multiple of 32")
    out = torch.empty((M, N), dtype=torch.bfloat16, device=a_t.device)
    if a_mx is not None:
        if a_mx.layout not in (ScaleLayout.ROW, ScaleLayout.GROUPED_M):
            a_mx = a_mx.with_layout(ScaleLayout.ROW)
        a_ptr, as_ptr = a_mx.qdata.contiguous().view(torch.uint8), a_mx.scales.view(torch.uint8).contiguous()
        a_layout = LAYOUT_ROW if a_mx.layout == ScaleLayout.ROW else LAYOUT_GROUPED
        as_cols = as_ptr.shape[-1]
    else:
        a_ptr, as_ptr, a_layout, as_cols = a_t.to(torch.bfloat16).contiguous(), None, LAYOUT_ROW, 0
    if M and N and G:
        cfg = fit_k_step(config or default_gemm_config(M, N, K, G, interp), K)
        num_m = cdiv(M, cfg.block_m) + G
        grid = (num_m * cdiv(N, cfg.block_n),)
        dummy = out
        _grouped_mm_kernel[grid](
            a_ptr, as_ptr if as_ptr is not None else dummy, w_ptr, ws_ptr if ws_ptr is not None else dummy, offs, out,
            M, N, G, as_cols, K=K,
            A_MX=a_mx is not None, A_LAYOUT=a_layout, W_MX=w_mx, INT_ROUND=ir, DOT_F32=interp,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            G_POW2=next_pow2(G), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return zero_rows_past_end(out, offs)


def triton_grouped_wgrad(
    grad_out: torch.Tensor,
    x,
    offs: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    config: Optional[GroupedGemmConfig] = None,
    int_round: Optional[bool] = None,
) -> torch.Tensor:
    """Expert weight gradient in fp32: ``out[g] (+)= grad_out[rows g]^T @ x[rows g]`` (Triton, one kernel).

    Args:
        grad_out: ``[M, N]`` bf16.
        x: ``[M, K]`` bf16, or MXTensor (axis 1, row or grouped_m scales for ``offs``) decoded in the load path.
        offs: ``[G]`` int32 group end offsets; rows past ``offs[-1]`` are ignored.
        out: fp32 ``[G, N, K]`` to accumulate into (``out += dW``); None = a new tensor.
        config: ``block_n`` x ``block_k`` output tile, ``block_m`` rows per step (default 128x128x64 on GPU).
    Returns:
        fp32 ``[G, N, K]`` (``out`` when given); the fp32 accumulator is stored without a BF16 rounding.
    """
    fn = "triton_grouped_wgrad"
    x_mx = x if isinstance(x, MXTensor) else None
    x_t = x_mx.qdata if x_mx is not None else x
    _check_runnable(grad_out, fn)
    interp = interpret_mode()
    ir = (interp or grad_out.device.type != "cuda") if int_round is None else bool(int_round)
    M, N = grad_out.shape
    Mx, K = x_t.shape
    if Mx != M:
        raise ValueError(f"{fn}: grad_out has {M} rows but x has {Mx}")
    if K % BLOCK:
        raise ValueError(f"{fn}: K={K} is not a multiple of 32")
    G = offs.numel()
    offs = _ops.check_offs(offs, G, grad_out.device, fn)
    _ops.check_offs_values(offs, M, fn)
    if out is not None:
        if out.dtype != torch.float32 or tuple(out.shape) != (G, N, K) or not out.is_contiguous():
            raise ValueError(f"{fn}: out must be a contiguous fp32 [{G}, {N}, {K}] tensor")
        res = out
    else:
        res = torch.empty((G, N, K), dtype=torch.float32, device=grad_out.device)
    go = grad_out.to(torch.bfloat16).contiguous()
    if x_mx is not None:
        if x_mx.layout not in (ScaleLayout.ROW, ScaleLayout.GROUPED_M):
            x_mx = x_mx.with_layout(ScaleLayout.ROW)
        x_ptr, xs_ptr = x_mx.qdata.contiguous().view(torch.uint8), x_mx.scales.view(torch.uint8).contiguous()
        x_layout = LAYOUT_ROW if x_mx.layout == ScaleLayout.ROW else LAYOUT_GROUPED
        xs_cols = xs_ptr.shape[-1]
    else:
        x_ptr, xs_ptr, x_layout, xs_cols = x_t.to(torch.bfloat16).contiguous(), None, LAYOUT_ROW, 0
    if G and N and K:
        if interp:
            cfg = config or GroupedGemmConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=1)
        else:
            cfg = config or GroupedGemmConfig(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3)
        grid = (cdiv(N, cfg.block_n) * cdiv(K, cfg.block_k), G)
        _grouped_wgrad_kernel[grid](
            go, x_ptr, xs_ptr if xs_ptr is not None else go, offs, res,
            M, N, K, G, xs_cols,
            X_MX=x_mx is not None, X_LAYOUT=x_layout, INT_ROUND=ir, INTERP=interp, ACCUMULATE=out is not None,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            G_POW2=next_pow2(G), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return res


__all__ = ["GroupedGemmConfig", "default_gemm_config", "triton_grouped_mm", "triton_grouped_wgrad", "zero_rows_past_end",
           "group_of_tile",
           "dequant_tile_bf16", "interpret_mode"]
