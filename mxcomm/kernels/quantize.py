"""Triton MXFP8 quantize / dequantize kernels (one pass, scales written straight into their layout).

Public functions:

* :func:`quantize_rows` - 1x32 blocks along the last axis (axis=1): forward/dgrad GEMM operand and
  the transport format. Scale layouts ``row``, ``blocked`` (128x4 swizzle, zero padding written by the
  kernel) and ``grouped_m`` (each row group swizzled on its own at a 128-aligned row; placement
  computed on device from int32 end offsets, no host sync).
* :func:`quantize_cols` - 32x1 blocks along axis 0 (the wgrad operand). Scale layouts ``row``
  (``[M/32, K]``), ``blocked`` (of the transposed scale matrix ``[K, M/32]``) and ``grouped_k``
  (groups of rows of ``x`` = the wgrad reduction axis).
* :func:`dequantize` - MXTensor (2D, any of the layouts above) -> dense tensor.

All results are bit-identical to :func:`mxcomm.mx.quantize` / :func:`mxcomm.mx.dequantize`.

Rounding path (``int_round``): ``True`` rounds fp32 -> E4M3 with integer arithmetic (needed under
``TRITON_INTERPRET=1``, whose float8 cast is not RNE); ``False`` uses the GPU's ``cvt.rn.satfinite``
(fast path). ``None`` picks ``True`` in interpreter mode or for CPU tensors, ``False`` on CUDA.

CPU tensors run only when Triton's interpreter is active: ``TRITON_INTERPRET=1`` must be set before
``mxcomm.kernels`` is first imported (Triton decides at decoration time).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..mx import MXTensor, ScaleLayout, check_quantizable, grouped_k_cols, grouped_m_rows, round_up
from ..mx.scales import BLOCK, SCALE_MODES, check_mode
from .launch import cdiv, fast_kernel, next_pow2
from .mx_device import SCALE_MODE_IDS, bf16_rne_int, blocked_scale_offset, grouped_k_scale_offset, grouped_padded_index
from .mx_device import mx_decode_tile, mx_quantize_tile, out_max

LAYOUT_ROW = 0
LAYOUT_BLOCKED = 1
LAYOUT_GROUPED = 2  # grouped_m for row-wise (axis 1), grouped_k for column-wise (axis 0)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _scale_offsets(r, c, stride_r, stride_c, n_col_tiles, LAYOUT: tl.constexpr):
    """Offset of scale-matrix entry (r, c): strided for ROW, 128x4-blocked otherwise."""
    if LAYOUT == 0:
        off = r * stride_r + c * stride_c
    else:
        off = blocked_scale_offset(r, c, n_col_tiles)
    return off


@triton.jit
def _row_tile(M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(pid_m, pid_k)``'s tile of 1x32 blocks of an ``[M, K]`` row-major matrix: ``(rows, blks, rmask,
    bmask, offs, m3)`` - rows ``pid_m*BLOCK_M + [0, BLOCK_M)`` (int64), 32-value blocks ``pid_k*BLOCK_K/32 + [0,
    BLOCK_K/32)``, their masks, and the ``[BLOCK_M, BLOCK_K/32, 32]`` element offsets with their mask."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    NBK: tl.constexpr = BLOCK_K // 32
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    blks = pid_k * NBK + tl.arange(0, NBK)
    j = tl.arange(0, 32)
    nb = K // 32
    rmask = rows < M
    bmask = blks < nb
    offs = rows[:, None, None] * K + (blks[None, :, None] * 32 + j[None, None, :])
    return rows, blks, rmask, bmask, offs, rmask[:, None, None] & bmask[None, :, None]


@triton.jit
def _col_tile(M, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(pid_r, pid_k)``'s tile of 32x1 blocks of an ``[M, K]`` row-major matrix: ``(rb, cols, rbmask,
    cmask, offs, m3)`` - row-blocks ``pid_r*BLOCK_R + [0, BLOCK_R)`` (int64, 32 rows each), columns
    ``pid_k*BLOCK_K + [0, BLOCK_K)``, their masks, and the ``[BLOCK_R, 32, BLOCK_K]`` element offsets (loads
    coalesced along K) with their mask."""
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    rb = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    i = tl.arange(0, 32)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    nrb = M // 32
    rbmask = rb < nrb
    cmask = cols < K
    offs = (rb[:, None, None] * 32 + i[None, :, None]) * K + cols[None, None, :]
    return rb, cols, rbmask, cmask, offs, rbmask[:, None, None] & cmask[None, None, :]


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, offs_ptr,
    M, K, n_groups, s_rows, s_cols,
    MODE: tl.constexpr, INT_ROUND: tl.constexpr, LAYOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, G_POW2: tl.constexpr,
):
    """x [M, K] row-major -> q [M, K] E4M3 bytes + scales of 1x32 blocks.

    Program (pid_m, pid_k) handles rows ``pid_m*BLOCK_M + [0, BLOCK_M)`` and columns
    ``pid_k*BLOCK_K + [0, BLOCK_K)`` as a ``[BLOCK_M, BLOCK_K/32, 32]`` register tile.
    BLOCKED: the grid covers the padded scale matrix ``[s_rows, s_cols]``; out-of-range data loads
    as 0, so padding entries get scale byte 0 (written here, no memset needed).
    GROUPED (grouped_m): scale rows mapped per group to 128-aligned rows (s is pre-zeroed).
    """
    rows, blks, rmask, bmask, offs, m3 = _row_tile(M, K, BLOCK_M, BLOCK_K)
    nb = K // 32
    x = tl.load(x_ptr + offs, mask=m3, other=0.0)
    q, b = mx_quantize_tile(x, MODE, INT_ROUND)
    tl.store(q_ptr + offs, q, mask=m3)
    if LAYOUT == 0:
        srow = rows
        smask = rmask[:, None] & bmask[None, :]
    elif LAYOUT == 1:
        srow = rows
        smask = (rows < s_rows)[:, None] & (blks < s_cols)[None, :]
    else:
        srow = grouped_padded_index(rows, offs_ptr, n_groups, 1, 128, G_POW2)
        smask = ((srow >= 0) & rmask)[:, None] & bmask[None, :]
    soff = _scale_offsets(srow[:, None], blks[None, :], nb, 1, s_cols // 4, LAYOUT)
    tl.store(s_ptr + soff, b, mask=smask)


@triton.jit
def _quantize_cols_kernel(
    x_ptr, q_ptr, s_ptr, offs_ptr,
    M, K, n_groups, s_rows, s_cols,
    MODE: tl.constexpr, INT_ROUND: tl.constexpr, LAYOUT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, G_POW2: tl.constexpr,
):
    """x [M, K] row-major -> q [M, K] E4M3 bytes + scales of 32x1 blocks (column-wise).

    Program (pid_r, pid_k) handles row-blocks ``pid_r*BLOCK_R + [0, BLOCK_R)`` (32 rows each) and
    columns ``pid_k*BLOCK_K + [0, BLOCK_K)`` as a ``[BLOCK_R, 32, BLOCK_K]`` tile (loads coalesced
    along K). Scale matrix entry (r = column k, c = row-block): ROW stores at ``c*K + r``
    (``[M/32, K]``); BLOCKED stores the transposed matrix ``[K, M/32]`` blocked; GROUPED (grouped_k) stores it
    in the grouped-along-K layout (each group of row-blocks its own blocked matrix; s is pre-zeroed).
    """
    rb, cols, rbmask, cmask, offs, m3 = _col_tile(M, K, BLOCK_R, BLOCK_K)
    x = tl.load(x_ptr + offs, mask=m3, other=0.0)
    q, b = mx_quantize_tile(x, MODE, INT_ROUND, 1)
    tl.store(q_ptr + offs, q, mask=m3)
    if LAYOUT == 2:
        soff, ok = grouped_k_scale_offset(cols[None, :], rb, offs_ptr, n_groups, K, G_POW2)
        smask = (ok & rbmask)[:, None] & cmask[None, :]
    else:
        if LAYOUT == 0:
            smask = rbmask[:, None] & cmask[None, :]
        else:
            smask = (rb < s_cols)[:, None] & (cols < s_rows)[None, :]
        soff = _scale_offsets(cols[None, :], rb[:, None], 1, K, s_cols // 4, LAYOUT)
    tl.store(s_ptr + soff, b, mask=smask)


@triton.jit
def _dequantize_rows_kernel(
    q_ptr, s_ptr, offs_ptr, out_ptr,
    M, K, n_groups, s_cols,
    INT_ROUND: tl.constexpr, LAYOUT: tl.constexpr, BF16_INT: tl.constexpr, OUT_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, G_POW2: tl.constexpr,
):
    """q [M, K] E4M3 bytes + scales (1x32 blocks, layout LAYOUT) -> out [M, K] (out's dtype; values saturated to
    +-OUT_MAX, the out dtype's largest finite value)."""
    rows, blks, rmask, bmask, offs, m3 = _row_tile(M, K, BLOCK_M, BLOCK_K)
    nb = K // 32
    q = tl.load(q_ptr + offs, mask=m3, other=0)
    if LAYOUT == 2:
        srow = grouped_padded_index(rows, offs_ptr, n_groups, 1, 128, G_POW2)
        smask = ((srow >= 0) & rmask)[:, None] & bmask[None, :]
    else:
        srow = rows
        smask = rmask[:, None] & bmask[None, :]
    soff = _scale_offsets(srow[:, None], blks[None, :], nb, 1, s_cols // 4, LAYOUT)
    b = tl.load(s_ptr + soff, mask=smask, other=0)
    v = mx_decode_tile(q, b, INT_ROUND, OUT_MAX, 2)
    if BF16_INT:
        v = bf16_rne_int(v)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=m3)


@triton.jit
def _dequantize_cols_kernel(
    q_ptr, s_ptr, offs_ptr, out_ptr,
    M, K, n_groups, s_cols,
    INT_ROUND: tl.constexpr, LAYOUT: tl.constexpr, BF16_INT: tl.constexpr, OUT_MAX: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, G_POW2: tl.constexpr,
):
    """q [M, K] E4M3 bytes + scales (32x1 blocks, layout LAYOUT; GROUPED = grouped_k) -> out [M, K] (out's dtype;
    values saturated to +-OUT_MAX, the out dtype's largest finite value)."""
    rb, cols, rbmask, cmask, offs, m3 = _col_tile(M, K, BLOCK_R, BLOCK_K)
    q = tl.load(q_ptr + offs, mask=m3, other=0)
    if LAYOUT == 2:
        soff, ok = grouped_k_scale_offset(cols[None, :], rb, offs_ptr, n_groups, K, G_POW2)
        smask = (ok & rbmask)[:, None] & cmask[None, :]
    else:
        smask = rbmask[:, None] & cmask[None, :]
        soff = _scale_offsets(cols[None, :], rb[:, None], 1, K, s_cols // 4, LAYOUT)
    b = tl.load(s_ptr + soff, mask=smask, other=0)
    v = mx_decode_tile(q, b, INT_ROUND, OUT_MAX, 1)
    if BF16_INT:
        v = bf16_rne_int(v)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=m3)


# ----------------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantizeConfig:
    """Tile sizes of one launch.

    Attributes:
        block_rows: rows of ``x`` per program (column-wise kernels: a multiple of 32).
        block_k: columns per program; a power of two >= 32.
        num_warps: warps per program (ignored by the interpreter).
    """

    block_rows: int
    block_k: int
    num_warps: int = 4

    def __post_init__(self):
        check_tile(self.block_rows, self.block_k, self.num_warps, "block_k")


def check_tile(block_rows: int, block_cols: int, num_warps: int, cols_name: str) -> None:
    """ValueError unless ``block_cols`` is a power of two >= 32, ``block_rows`` a power of two >= 1 and
    ``num_warps`` a power of two <= 32 (shared by the kernels' tile configs)."""
    if block_cols < 32 or block_cols & (block_cols - 1):
        raise ValueError(f"{cols_name} must be a power of two >= 32, got {block_cols}")
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two >= 1, got {block_rows}")
    if num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two <= 32, got {num_warps}")


@functools.lru_cache(maxsize=None)
def _sm_count_of(idx: int) -> int:
    return torch.cuda.get_device_properties(idx).multi_processor_count


def _sm_count(device: torch.device) -> int:
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def _fill_device(cfg_rows: int, rows: int, cols: int, block_k: int, device: torch.device, min_rows: int) -> int:
    """Halve rows per program while the grid would leave SMs idle (small M)."""
    if device.type != "cuda":
        return cfg_rows
    target = 4 * _sm_count(device)
    while cfg_rows > min_rows and cdiv(rows, cfg_rows) * cdiv(cols, block_k) < target:
        cfg_rows //= 2
    return cfg_rows


def default_rows_config(M: int, K: int, device: torch.device, interpret: bool) -> QuantizeConfig:
    """Heuristic tiles for the row-wise (1x32) kernels.

    GPU: ``block_k = min(1024, next_pow2(K))`` (K=7168 -> 7 tiles of 32 blocks, no masking),
    ~4K elements per program, 4 warps (the best of the bench/bench_quantize.py --sweep grid on the
    H200: bench/results/quantize_h200.json); fewer rows per program when M is small so the grid still
    fills the SMs. Interpreter: big tiles (few programs).
    """
    if interpret:
        bk = min(next_pow2(max(K, 32)), 2048)
        bm = min(next_pow2(M), max(1, 32768 // bk))
        return QuantizeConfig(block_rows=bm, block_k=bk, num_warps=4)
    bk = min(1024, next_pow2(max(K, 32)))
    bm = max(1, 4096 // bk)
    bm = min(bm, next_pow2(M))
    bm = _fill_device(bm, M, K, bk, device, 1)
    return QuantizeConfig(block_rows=bm, block_k=bk, num_warps=4)


def default_cols_config(M: int, K: int, device: torch.device, interpret: bool) -> QuantizeConfig:
    """Heuristic tiles for the column-wise (32x1) kernels: 64 rows x 256 columns per program on GPU,
    4 warps (the best of ``bench/bench_quantize.py --sweep``; docs/benchmarks.md has the measurements), fewer
    columns when K is small."""
    if interpret:
        bk = min(next_pow2(max(K, 32)), 1024)
        br = min(next_pow2(max(M, 32)), max(32, 32768 // bk))
        return QuantizeConfig(block_rows=br, block_k=bk, num_warps=4)
    bk = min(256, next_pow2(max(K, 32)))
    br = 32 * max(1, 16384 // (32 * bk))
    br = min(br, next_pow2(max(M, 32)))
    br = _fill_device(br, M, K, bk, device, 32)
    return QuantizeConfig(block_rows=br, block_k=bk, num_warps=4)


# ----------------------------------------------------------------------------------------------
# host-side helpers
# ----------------------------------------------------------------------------------------------
def interpret_mode() -> bool:
    """True when this module's kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1
    at import)."""
    return isinstance(_quantize_rows_kernel, InterpretedFunction)


def _resolve_int_round(int_round: Optional[bool], device: torch.device) -> bool:
    if int_round is None:
        return interpret_mode() or device.type != "cuda"
    return bool(int_round)


def _check_device(x: torch.Tensor) -> None:
    if interpret_mode():
        return
    if x.device.type != "cuda":
        raise RuntimeError(
            f"mxcomm.kernels: tensor on {x.device} but Triton kernels need a CUDA tensor; for CPU tensors "
            "set TRITON_INTERPRET=1 before mxcomm.kernels is first imported"
        )


def _check_int_round(int_round: bool, device: torch.device) -> None:
    if not int_round and (interpret_mode() or device.type != "cuda"):
        raise ValueError("int_round=False (hardware float8 cast) needs a CUDA tensor outside the interpreter")


def _check_layout(layout, allowed: tuple, fn: str) -> ScaleLayout:
    try:
        lay = ScaleLayout(layout)
    except ValueError:
        raise ValueError(f"{fn}: unknown scale layout {layout!r}; expected one of {[a.value for a in allowed]}") from None
    if lay not in allowed:
        raise ValueError(f"{fn}: scale layout {lay.value!r} not supported; expected one of {[a.value for a in allowed]}")
    return lay


def _check_offs(group_offs: Optional[torch.Tensor], x: torch.Tensor, lay: ScaleLayout, fn: str) -> torch.Tensor:
    if group_offs is None:
        raise ValueError(f"{fn}: layout {lay.value!r} needs group_offs (int32 group end offsets)")
    if not isinstance(group_offs, torch.Tensor) or group_offs.dim() != 1:
        raise TypeError(f"{fn}: group_offs must be a 1D tensor of group end offsets")
    if group_offs.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: group_offs must be int32 (or int64), got {group_offs.dtype}")
    if group_offs.device != x.device:
        raise ValueError(f"{fn}: group_offs is on {group_offs.device} but x is on {x.device}")
    return group_offs.to(torch.int32).contiguous()


def _check_x(x: torch.Tensor, axis: int, fn: str) -> None:
    if isinstance(x, torch.Tensor) and x.dim() != 2:
        raise ValueError(f"{fn}: expected a 2D tensor [M, K], got shape {tuple(x.shape)}")
    check_quantizable(x, axis)


def _check_mode(mode: str) -> int:
    check_mode(mode)
    return SCALE_MODE_IDS[mode]


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def quantize_rows(
    x: torch.Tensor,
    *,
    mode: str = "rceil",
    layout: ScaleLayout | str = "row",
    group_offs: Optional[torch.Tensor] = None,
    int_round: Optional[bool] = None,
    config: Optional[QuantizeConfig] = None,
) -> MXTensor:
    """Row-wise MXFP8 quantize (1x32 blocks along the last axis), one pass over ``x``.

    Args:
        x: ``[M, K]`` bfloat16 / float16 / float32, ``K % 32 == 0`` (non-contiguous input is copied).
            With ``layout="row"`` any ``[..., K]`` shape is accepted.
        mode: ``"rceil"`` (default) or ``"floor"``.
        layout: scale layout of the result:
            ``"row"``: scales ``[M, K/32]``;
            ``"blocked"``: ``[round_up(M,128), round_up(K/32,4)]``, 128x4 swizzled, zero padding;
            ``"grouped_m"``: ``[grouped_m_rows(M, G), round_up(K/32,4)]``, groups of rows given by
            ``group_offs`` each swizzled on its own at a 128-aligned row (rows past ``group_offs[-1]``
            get payload but no scales).
        group_offs: ``[G]`` int32 group end offsets (non-decreasing, ``<= M``; not checked on the host,
            that would sync) for ``"grouped_m"``; same device as ``x``.
        int_round: E4M3 rounding by integer arithmetic (True) or hardware cast (False); None = auto.
        config: tile sizes (default: :func:`default_rows_config`).
    Returns:
        :class:`MXTensor` with ``qdata`` float8_e4m3fn of ``x.shape``, uint8 ``scales``, ``axis=x.dim()-1``.
    Raises:
        TypeError: unsupported dtype / bad ``group_offs`` type. ValueError: K not a multiple of 32, bad
        mode/layout, grouped layout without offsets. RuntimeError: CPU tensor outside the interpreter.
    """
    fn = "quantize_rows"
    check_quantizable(x, -1)
    mode_id = _check_mode(mode)
    lay = _check_layout(layout, (ScaleLayout.ROW, ScaleLayout.BLOCKED, ScaleLayout.GROUPED_M), fn)
    if lay != ScaleLayout.ROW and x.dim() != 2:
        raise ValueError(f"{fn}: layout {lay.value!r} needs a 2D tensor [M, K], got shape {tuple(x.shape)}")
    offs = _check_offs(group_offs, x, lay, fn) if lay == ScaleLayout.GROUPED_M else None
    _check_device(x)
    ir = _resolve_int_round(int_round, x.device)
    _check_int_round(ir, x.device)

    orig_shape = x.shape
    K = orig_shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    nb = K // BLOCK
    dev = x.device
    qdata = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=dev)
    if lay == ScaleLayout.ROW:
        s_rows, s_cols, ext_r, ext_k = M, nb, M, K
        scales = torch.empty((M, nb), dtype=torch.uint8, device=dev)
    elif lay == ScaleLayout.BLOCKED:
        s_rows, s_cols = round_up(M, 128), round_up(nb, 4)
        ext_r, ext_k = s_rows, s_cols * BLOCK
        scales = torch.empty((s_rows, s_cols), dtype=torch.uint8, device=dev)
    else:
        s_rows, s_cols = grouped_m_rows(M, offs.numel()), round_up(nb, 4)
        ext_r, ext_k = M, K
        scales = torch.zeros((s_rows, s_cols), dtype=torch.uint8, device=dev)

    if ext_r > 0 and ext_k > 0:
        cfg = config or default_rows_config(M, K, dev, interpret_mode())
        n_groups = offs.numel() if offs is not None else 0
        grid = (cdiv(ext_r, cfg.block_rows), cdiv(ext_k, cfg.block_k))
        fast_kernel(_quantize_rows_kernel)[grid](
            x2, qdata.view(torch.uint8), scales, offs if offs is not None else scales,
            M, K, n_groups, s_rows, s_cols,
            MODE=mode_id, INT_ROUND=ir, LAYOUT=int(_layout_id(lay)),
            BLOCK_M=cfg.block_rows, BLOCK_K=cfg.block_k, G_POW2=next_pow2(n_groups),
            num_warps=cfg.num_warps,
        )
    if lay == ScaleLayout.ROW:
        qdata = qdata.view(orig_shape)
        scales = scales.view(*orig_shape[:-1], nb)
    return MXTensor(qdata=qdata, scales=scales, axis=len(orig_shape) - 1, layout=lay, mode=mode,
                    orig_dtype=x.dtype, group_offs=offs)


def quantize_cols(
    x: torch.Tensor,
    *,
    mode: str = "rceil",
    layout: ScaleLayout | str = "row",
    group_offs: Optional[torch.Tensor] = None,
    int_round: Optional[bool] = None,
    config: Optional[QuantizeConfig] = None,
) -> MXTensor:
    """Column-wise MXFP8 quantize (32x1 blocks along axis 0; the wgrad operand), one pass over ``x``.

    Args:
        x: ``[M, K]`` bfloat16 / float16 / float32 with ``M % 32 == 0`` (non-contiguous input is copied).
        mode: ``"rceil"`` or ``"floor"``.
        layout: ``"row"``: scales ``[M/32, K]``; ``"blocked"``: the scale matrix ``[K, M/32]``
            (quantized axis last) blocked to ``[round_up(K,128), round_up(M/32,4)]``;
            ``"grouped_k"``: groups of rows of ``x`` (the wgrad reduction axis) given by ``group_offs``
            (element end offsets, multiples of 32, not checked on the host), torch's 2d-2d layout
            (:mod:`mxcomm.mx.layouts`): group g's ``[round_up(K,128), round_up(M_g/32, 4)]`` scales blocked on
            their own from flat byte ``round_up(K,128) * sum_{h<g} round_up(M_h/32, 4)``; shape
            ``[round_up(K,128), grouped_k_cols(M/32, G)]``, zero padding.
        group_offs: ``[G]`` int32 end offsets for ``"grouped_k"``.
        int_round / config: as in :func:`quantize_rows` (default config :func:`default_cols_config`).
    Returns:
        :class:`MXTensor` with ``qdata`` float8_e4m3fn ``[M, K]``, uint8 ``scales``, ``axis=0``.
    """
    fn = "quantize_cols"
    _check_x(x, 0, fn)
    mode_id = _check_mode(mode)
    lay = _check_layout(layout, (ScaleLayout.ROW, ScaleLayout.BLOCKED, ScaleLayout.GROUPED_K), fn)
    offs = _check_offs(group_offs, x, lay, fn) if lay == ScaleLayout.GROUPED_K else None
    _check_device(x)
    ir = _resolve_int_round(int_round, x.device)
    _check_int_round(ir, x.device)

    x = x.contiguous()
    M, K = x.shape
    nrb = M // BLOCK
    dev = x.device
    qdata = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=dev)
    if lay == ScaleLayout.ROW:
        s_rows, s_cols, ext_rb, ext_k = K, nrb, nrb, K
        scales = torch.empty((nrb, K), dtype=torch.uint8, device=dev)
    elif lay == ScaleLayout.BLOCKED:
        s_rows, s_cols = round_up(K, 128), round_up(nrb, 4)
        ext_rb, ext_k = s_cols, s_rows
        scales = torch.empty((s_rows, s_cols), dtype=torch.uint8, device=dev)
    else:
        s_rows, s_cols = round_up(K, 128), grouped_k_cols(nrb, offs.numel())
        ext_rb, ext_k = nrb, K
        scales = torch.zeros((s_rows, s_cols), dtype=torch.uint8, device=dev)

    if ext_rb > 0 and ext_k > 0:
        cfg = config or default_cols_config(M, K, dev, interpret_mode())
        if cfg.block_rows % BLOCK:
            raise ValueError(f"{fn}: config.block_rows must be a multiple of 32, got {cfg.block_rows}")
        br = cfg.block_rows // BLOCK
        n_groups = offs.numel() if offs is not None else 0
        grid = (cdiv(ext_rb, br), cdiv(ext_k, cfg.block_k))
        fast_kernel(_quantize_cols_kernel)[grid](
            x, qdata.view(torch.uint8), scales, offs if offs is not None else scales,
            M, K, n_groups, s_rows, s_cols,
            MODE=mode_id, INT_ROUND=ir, LAYOUT=int(_layout_id(lay)),
            BLOCK_R=br, BLOCK_K=cfg.block_k, G_POW2=next_pow2(n_groups),
            num_warps=cfg.num_warps,
        )
    return MXTensor(qdata=qdata, scales=scales, axis=0, layout=lay, mode=mode, orig_dtype=x.dtype, group_offs=offs)


def dequantize(
    mx: MXTensor,
    dtype: Optional[torch.dtype] = torch.bfloat16,
    *,
    int_round: Optional[bool] = None,
    config: Optional[QuantizeConfig] = None,
) -> torch.Tensor:
    """MXTensor -> dense ``qdata * 2**(scale - 127)`` (fp32 product, rounded to ``dtype``).

    Supports 2D tensors with axis 1 (layouts row / blocked / grouped_m) or axis 0 (row / blocked /
    grouped_k), and N-D row-layout tensors quantized along the last axis. Bit-identical to
    :func:`mxcomm.mx.dequantize`, whose rule it follows: values beyond ``dtype``'s largest finite value saturate
    to it (a finite input stays finite through quantize -> dequantize); blocks with scale byte 255 and payload
    bytes 0x7F/0xFF come out NaN.

    Args:
        mx: the MX tensor (payload float8_e4m3fn, uint8 scales).
        dtype: bfloat16 / float16 / float32 output; None = ``mx.orig_dtype``.
        int_round: decode and round with integer arithmetic (interpreter) or hardware casts; None = auto.
    Returns:
        tensor of ``mx.shape`` and ``dtype`` on ``mx.device``.
    """
    fn = "dequantize"
    if not isinstance(mx, MXTensor):
        raise TypeError(f"{fn}: expected an MXTensor, got {type(mx).__name__}")
    dtype = dtype or mx.orig_dtype
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{fn}: output dtype must be bfloat16, float16 or float32, got {dtype}")
    q = mx.qdata
    nd = q.dim()
    if mx.layout == ScaleLayout.ROW and nd != 2 and mx.axis == nd - 1:
        out2 = dequantize(
            MXTensor(qdata=q.reshape(-1, q.shape[-1]), scales=mx.scales.reshape(-1, mx.scales.shape[-1]), axis=1,
                     layout=ScaleLayout.ROW, mode=mx.mode, orig_dtype=mx.orig_dtype),
            dtype, int_round=int_round, config=config)
        return out2.view(q.shape)
    if nd != 2:
        raise ValueError(f"{fn}: expected a 2D MXTensor (or N-D row layout along the last axis), got {tuple(q.shape)}")
    allowed = {1: (ScaleLayout.ROW, ScaleLayout.BLOCKED, ScaleLayout.GROUPED_M),
               0: (ScaleLayout.ROW, ScaleLayout.BLOCKED, ScaleLayout.GROUPED_K)}[mx.axis]
    lay = _check_layout(mx.layout, allowed, fn)
    _check_device(q)
    ir = _resolve_int_round(int_round, q.device)
    _check_int_round(ir, q.device)
    offs = None
    if lay in (ScaleLayout.GROUPED_M, ScaleLayout.GROUPED_K):
        offs = _check_offs(mx.group_offs, q, lay, fn)
    q = q.contiguous()
    s = mx.scales.view(torch.uint8).contiguous()
    M, K = q.shape
    out = torch.empty((M, K), dtype=dtype, device=q.device)
    if M == 0 or K == 0:
        return out
    n_groups = offs.numel() if offs is not None else 0
    s_cols = s.shape[-1]
    common = dict(INT_ROUND=ir, LAYOUT=int(_layout_id(lay)), BF16_INT=bool(ir and dtype == torch.bfloat16),
                  OUT_MAX=out_max(dtype), G_POW2=next_pow2(n_groups))
    offs_arg = offs if offs is not None else s
    if mx.axis == 1:
        cfg = config or default_rows_config(M, K, q.device, interpret_mode())
        grid = (cdiv(M, cfg.block_rows), cdiv(K, cfg.block_k))
        fast_kernel(_dequantize_rows_kernel)[grid](q.view(torch.uint8), s, offs_arg, out, M, K, n_groups, s_cols,
                                      BLOCK_M=cfg.block_rows, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, **common)
    else:
        cfg = config or default_cols_config(M, K, q.device, interpret_mode())
        br = max(1, cfg.block_rows // BLOCK)
        grid = (cdiv(M // BLOCK, br), cdiv(K, cfg.block_k))
        fast_kernel(_dequantize_cols_kernel)[grid](q.view(torch.uint8), s, offs_arg, out, M, K, n_groups, s_cols,
                                      BLOCK_R=br, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, **common)
    return out


def _layout_id(lay: ScaleLayout) -> int:
    if lay == ScaleLayout.ROW:
        return LAYOUT_ROW
    if lay == ScaleLayout.BLOCKED:
        return LAYOUT_BLOCKED
    return LAYOUT_GROUPED


__all__ = [
    "QuantizeConfig", "quantize_rows", "quantize_cols", "dequantize", "default_rows_config",
    "default_cols_config", "interpret_mode", "LAYOUT_ROW", "LAYOUT_BLOCKED", "LAYOUT_GROUPED", "SCALE_MODES",
]
