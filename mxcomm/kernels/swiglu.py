"""Fused SwiGLU + MXFP8 quantize (forward) and the SwiGLU backward, as Triton kernels.

Layout of the up/gate GEMM output ``gu [M, 2N]`` (row-major): **gate first, up second**:
``gate = gu[:, :N]``, ``up = gu[:, N:]`` (``torch.chunk(gu, 2, dim=-1)`` order, as Megatron's fused GLU).
A fused up/gate weight is therefore ``cat([W_gate, W_up])`` along its output dimension.

Forward (:func:`swiglu_quantize`), per element, exactly as this plain-torch reference::

    h = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)     # fp32 math, ONE rounding to bf16
    out = mxcomm.mx.quantize(h, mode=mode, layout=layout, group_offs=offs)   # 1x32 blocks along N

The kernel reads ``gu`` once and writes only the MXFP8 payload and scales (no BF16 ``h`` in memory).
``silu(g)`` is computed as torch's CUDA kernel does, ``g / (1 + exp(-g))`` with an IEEE (round-to-
nearest) division; on the GPU ``exp`` is libdevice ``expf`` (the function torch's CUDA build calls),
so the GPU result is meant to be bit-identical to the reference run on the GPU (tested by the ``gpu``
tests). Under ``TRITON_INTERPRET=1`` ``exp`` is numpy's, which is not bit-identical to torch's CPU
``exp``: the CPU tests check the quantize step bit for bit against the reference applied to the
kernel's own bf16 ``h`` (returned by the debug argument ``return_h=True``), and ``h`` against the torch
reference to within one bf16 ulp.

Backward (:func:`swiglu_backward`): given ``grad_h [M, N]`` and the saved ``gu``, returns
``grad_gu [M, 2N]`` (same gate|up layout, dtype of ``gu``), computed in fp32 with the rounding of ``h`` to
bf16 and the quantization treated as identity (straight-through)::

    s = 1 / (1 + exp(-g));  grad_up = dh * (g * s);  grad_gate = dh * u * s * (1 + g * (1 - s))

rounded once to the output dtype (matches torch autograd of the reference to fp32 rounding, i.e.
within one bf16 ulp; not bit-exact).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..mx import MXTensor, ScaleLayout, grouped_m_rows, round_up
from ..mx.scales import BLOCK
from .launch import cdiv, fast_kernel, next_pow2
from .mx_device import bf16_rne_int, blocked_scale_offset, grouped_padded_index, mx_quantize_tile, to_fp32
from .quantize import _check_mode, _check_offs, _layout_id, _sm_count_of, check_tile

try:  # libdevice expf (torch's CUDA silu calls expf); absent from some Triton builds
    from triton.language.extra.cuda import libdevice as _libdevice
except ImportError:  # pragma: no cover
    _libdevice = None

_SUPPORTED_IN = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------
# device functions
# ----------------------------------------------------------------------------------------------
@triton.jit
def _exp_neg(x, LIBDEVICE: tl.constexpr):
    """exp(-x) in fp32: libdevice expf on the GPU (as torch's CUDA kernels), tl.exp otherwise."""
    if LIBDEVICE:
        e = _libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    return e


@triton.jit
def silu_mul_f32(g, u, LIBDEVICE: tl.constexpr):
    """fp32 ``silu(g) * u`` with torch's formula ``g / (1 + exp(-g))`` (IEEE division), then ``* u``."""
    s = tl.math.div_rn(g, 1.0 + _exp_neg(g, LIBDEVICE))
    return s * u


@triton.jit
def _round_bf16(v, INT_ROUND: tl.constexpr):
    """fp32 -> bf16 with round-to-nearest-even (integer path for the interpreter, whose cast truncates)."""
    if INT_ROUND:
        r = bf16_rne_int(v)
    else:
        r = v.to(tl.bfloat16)
    return r


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _swiglu_quant_kernel(
    gu_ptr, q_ptr, s_ptr, offs_ptr, h_ptr,
    M, N, n_groups, s_cols,
    MODE: tl.constexpr, INT_ROUND: tl.constexpr, LIBDEVICE: tl.constexpr, LAYOUT: tl.constexpr,
    STORE_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G_POW2: tl.constexpr,
):
    """gu [M, 2N] (gate | up) -> q [M, N] E4M3 bytes + scales of 1x32 blocks of h = bf16(silu(gate) * up).

    Program (pid_m, pid_n): rows ``pid_m*BLOCK_M + [0, BLOCK_M)``, h-columns ``pid_n*BLOCK_N + [0, BLOCK_N)``
    as a ``[BLOCK_M, BLOCK_N/32, 32]`` tile. LAYOUT 0 = row scales ``[M, N/32]``; 2 = grouped_m (scale rows
    placed per group at 128-aligned rows, ``s`` pre-zeroed; rows past the last group get no scales).
    STORE_H (tests only) also writes the bf16 ``h`` to ``h_ptr``.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    NB: tl.constexpr = BLOCK_N // 32
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    blks = pid_n * NB + tl.arange(0, NB)
    j = tl.arange(0, 32)
    nb = N // 32
    rmask = rows < M
    bmask = blks < nb
    cols = blks[None, :, None] * 32 + j[None, None, :]
    m3 = rmask[:, None, None] & bmask[None, :, None]
    g_off = rows[:, None, None] * (2 * N) + cols
    g = to_fp32(tl.load(gu_ptr + g_off, mask=m3, other=0.0), INT_ROUND)
    u = to_fp32(tl.load(gu_ptr + g_off + N, mask=m3, other=0.0), INT_ROUND)
    h = _round_bf16(silu_mul_f32(g, u, LIBDEVICE), INT_ROUND)
    out_off = rows[:, None, None] * N + cols
    if STORE_H:
        tl.store(h_ptr + out_off, h, mask=m3)
    q, b = mx_quantize_tile(h, MODE, INT_ROUND)
    tl.store(q_ptr + out_off, q, mask=m3)
    if LAYOUT == 0:
        soff = rows[:, None] * nb + blks[None, :]
        smask = rmask[:, None] & bmask[None, :]
    else:
        srow = grouped_padded_index(rows, offs_ptr, n_groups, 1, 128, G_POW2)
        soff = blocked_scale_offset(srow[:, None], blks[None, :], s_cols // 4)
        smask = ((srow >= 0) & rmask)[:, None] & bmask[None, :]
    tl.store(s_ptr + soff, b, mask=smask)


@triton.jit
def _swiglu_bwd_kernel(
    gu_ptr, dh_ptr, dgu_ptr,
    M, N,
    INT_ROUND: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """gu [M, 2N] (gate | up), dh [M, N] -> dgu [M, 2N] (grad of gate | grad of up), fp32 math."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m2 = (rows < M)[:, None] & (cols < N)[None, :]
    g_off = rows[:, None] * (2 * N) + cols[None, :]
    g = to_fp32(tl.load(gu_ptr + g_off, mask=m2, other=0.0), INT_ROUND)
    u = to_fp32(tl.load(gu_ptr + g_off + N, mask=m2, other=0.0), INT_ROUND)
    dh = to_fp32(tl.load(dh_ptr + rows[:, None] * N + cols[None, :], mask=m2, other=0.0), INT_ROUND)
    den = 1.0 + _exp_neg(g, LIBDEVICE)
    s = tl.math.div_rn(1.0, den)
    d_up = dh * tl.math.div_rn(g, den)  # dh * silu(g), silu as in the forward
    d_gate = (dh * u) * s * (1.0 + g * (1.0 - s))
    if dgu_ptr.dtype.element_ty == tl.bfloat16:
        d_gate_o = _round_bf16(d_gate, INT_ROUND)
        d_up_o = _round_bf16(d_up, INT_ROUND)
    else:
        d_gate_o = d_gate.to(dgu_ptr.dtype.element_ty)
        d_up_o = d_up.to(dgu_ptr.dtype.element_ty)
    tl.store(dgu_ptr + g_off, d_gate_o, mask=m2)
    tl.store(dgu_ptr + g_off + N, d_up_o, mask=m2)


# ----------------------------------------------------------------------------------------------
# configuration and host helpers
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SwigluConfig:
    """Tile sizes of one launch: ``block_rows`` rows x ``block_n`` h-columns per program.

    Attributes:
        block_rows: power of two >= 1.
        block_n: power of two >= 32.
        num_warps: warps per program (ignored by the interpreter).
    """

    block_rows: int
    block_n: int
    num_warps: int = 4

    def __post_init__(self):
        check_tile(self.block_rows, self.block_n, self.num_warps, "block_n")


def default_swiglu_config(M: int, N: int, device: torch.device, interpret: bool) -> SwigluConfig:
    """GPU: ``block_n = min(512, next_pow2(N))`` and ~4K h-values per program (two 8 KB bf16 loads),
    fewer rows per program while the grid would cover fewer than 4 waves of the SMs. Interpreter: big tiles."""
    if interpret:
        bn = min(next_pow2(max(N, 32)), 1024)
        bm = min(next_pow2(M), max(1, 16384 // bn))
        return SwigluConfig(block_rows=bm, block_n=bn, num_warps=4)
    bn = min(512, next_pow2(max(N, 32)))
    bm = min(max(1, 4096 // bn), next_pow2(M))
    if device.type == "cuda":
        target = 4 * _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())
        while bm > 1 and cdiv(M, bm) * cdiv(N, bn) < target:
            bm //= 2
    return SwigluConfig(block_rows=bm, block_n=bn, num_warps=8 if bm * bn >= 4096 else 4)


def interpret_mode() -> bool:
    """True when this module's kernels were built for Triton's CPU interpreter."""
    return isinstance(_swiglu_quant_kernel, InterpretedFunction)


def _prepare(x: torch.Tensor, int_round: Optional[bool], fn: str) -> tuple[bool, bool]:
    """Device check; returns (int_round, libdevice)."""
    interp = interpret_mode()
    if not interp and x.device.type != "cuda":
        raise RuntimeError(f"{fn}: tensor on {x.device} but Triton kernels need a CUDA tensor; for CPU tensors "
                           "set TRITON_INTERPRET=1 before mxcomm.kernels is first imported")
    ir = (interp or x.device.type != "cuda") if int_round is None else bool(int_round)
    if not ir and (interp or x.device.type != "cuda"):
        raise ValueError(f"{fn}: int_round=False (hardware casts) needs a CUDA tensor outside the interpreter")
    return ir, (not interp and _libdevice is not None)


def _launch_opts(libdevice: bool) -> dict:
    # libdevice expf without flush-to-zero, like torch's CUDA build (Triton's default reflects ftz=1)
    return {"enable_reflect_ftz": False} if libdevice else {}


def _check_gu(gu: torch.Tensor, fn: str) -> int:
    if not isinstance(gu, torch.Tensor):
        raise TypeError(f"{fn}: expected a torch.Tensor [M, 2N], got {type(gu).__name__}")
    if gu.dtype not in _SUPPORTED_IN:
        raise TypeError(f"{fn}: gu must be bfloat16, float16 or float32, got {gu.dtype}")
    if gu.dim() != 2:
        raise ValueError(f"{fn}: expected gu of shape [M, 2N], got {tuple(gu.shape)}")
    if gu.shape[1] % 64:
        raise ValueError(f"{fn}: gu has {gu.shape[1]} columns; need 2N with N a multiple of 32")
    return gu.shape[1] // 2


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def swiglu_quantize(
    gu: torch.Tensor,
    *,
    mode: str = "rceil",
    layout: ScaleLayout | str = "row",
    group_offs: Optional[torch.Tensor] = None,
    int_round: Optional[bool] = None,
    config: Optional[SwigluConfig] = None,
    return_h: bool = False,
):
    """Fused ``h = bf16(silu(gate) * up)`` and MXFP8 quantize of ``h`` (1x32 blocks along N), one pass.

    Args:
        gu: ``[M, 2N]`` bfloat16 (or float16 / float32), gate in columns ``[0, N)``, up in ``[N, 2N)``;
            ``N % 32 == 0``. Non-contiguous input is copied.
        mode: scale rule, ``"rceil"`` (default) or ``"floor"``.
        layout: scale layout of the result: ``"row"`` (``[M, N/32]``) or ``"grouped_m"``
            (``[grouped_m_rows(M, G), round_up(N/32, 4)]``, each row group of ``group_offs`` swizzled on its
            own at a 128-aligned row, zero padding; rows past ``group_offs[-1]`` get payload, no scales).
        group_offs: ``[G]`` int32 row-group end offsets (for ``"grouped_m"``), on ``gu``'s device.
        int_round: integer E4M3/bf16 rounding (True, bit-exact everywhere) or hardware casts (False, GPU);
            None = auto (True under the interpreter / on CPU).
        config: tile sizes (default :func:`default_swiglu_config`).
        return_h: debug/tests only: also return the bf16 ``h`` the kernel quantized (costs an extra write).
    Returns:
        :class:`MXTensor` ``[M, N]`` (axis 1, ``orig_dtype`` bfloat16), or ``(MXTensor, h)`` with ``return_h``.
    Raises:
        TypeError / ValueError on bad dtype, shape, mode, layout or offsets; RuntimeError for a CPU tensor
        outside the interpreter.
    """
    fn = "swiglu_quantize"
    N = _check_gu(gu, fn)
    mode_id = _check_mode(mode)
    try:
        lay = ScaleLayout(layout)
    except ValueError:
        raise ValueError(f"{fn}: unknown scale layout {layout!r}; expected 'row' or 'grouped_m'") from None
    if lay not in (ScaleLayout.ROW, ScaleLayout.GROUPED_M):
        raise ValueError(f"{fn}: scale layout {lay.value!r} not supported; expected 'row' or 'grouped_m'")
    offs = _check_offs(group_offs, gu, lay, fn) if lay == ScaleLayout.GROUPED_M else None
    ir, libdev = _prepare(gu, int_round, fn)
    gu = gu.contiguous()
    M = gu.shape[0]
    nb = N // BLOCK
    dev = gu.device
    qdata = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=dev)
    h = torch.empty((M, N), dtype=torch.bfloat16, device=dev) if return_h else None
    if lay == ScaleLayout.ROW:
        s_cols = nb
        scales = torch.empty((M, nb), dtype=torch.uint8, device=dev)
    else:
        s_cols = round_up(nb, 4)
        scales = torch.zeros((grouped_m_rows(M, offs.numel()), s_cols), dtype=torch.uint8, device=dev)
    if M and N:
        cfg = config or default_swiglu_config(M, N, dev, interpret_mode())
        n_groups = offs.numel() if offs is not None else 0
        grid = (cdiv(M, cfg.block_rows), cdiv(N, cfg.block_n))
        fast_kernel(_swiglu_quant_kernel)[grid](
            gu, qdata.view(torch.uint8), scales, offs if offs is not None else scales,
            h if h is not None else qdata, M, N, n_groups, s_cols,
            MODE=mode_id, INT_ROUND=ir, LIBDEVICE=libdev, LAYOUT=_layout_id(lay), STORE_H=return_h,
            BLOCK_M=cfg.block_rows, BLOCK_N=cfg.block_n, G_POW2=next_pow2(n_groups),
            num_warps=cfg.num_warps, **_launch_opts(libdev),
        )
    out = MXTensor(qdata=qdata, scales=scales, axis=1, layout=lay, mode=mode, orig_dtype=torch.bfloat16,
                   group_offs=offs)
    return (out, h) if return_h else out


def swiglu_backward(
    grad_h: torch.Tensor,
    gu: torch.Tensor,
    *,
    int_round: Optional[bool] = None,
    config: Optional[SwigluConfig] = None,
) -> torch.Tensor:
    """Gradient of ``h = silu(gate) * up`` w.r.t. ``gu = [gate | up]`` (straight-through the bf16 rounding
    and the quantize of the forward).

    Args:
        grad_h: ``[M, N]`` bfloat16 / float16 / float32 (non-contiguous input is copied).
        gu: the forward input ``[M, 2N]`` (gate | up), same device.
        int_round / config: as in :func:`swiglu_quantize`.
    Returns:
        ``grad_gu [M, 2N]`` in ``gu.dtype``: ``[:, :N]`` grad of gate, ``[:, N:]`` grad of up (fp32 math,
        one rounding).
    """
    fn = "swiglu_backward"
    N = _check_gu(gu, fn)
    if not isinstance(grad_h, torch.Tensor):
        raise TypeError(f"{fn}: grad_h must be a torch.Tensor, got {type(grad_h).__name__}")
    if grad_h.dtype not in _SUPPORTED_IN:
        raise TypeError(f"{fn}: grad_h must be bfloat16, float16 or float32, got {grad_h.dtype}")
    if tuple(grad_h.shape) != (gu.shape[0], N):
        raise ValueError(f"{fn}: grad_h has shape {tuple(grad_h.shape)}, expected {(gu.shape[0], N)} for gu "
                         f"{tuple(gu.shape)}")
    if grad_h.device != gu.device:
        raise ValueError(f"{fn}: grad_h is on {grad_h.device} but gu is on {gu.device}")
    ir, libdev = _prepare(gu, int_round, fn)
    gu = gu.contiguous()
    grad_h = grad_h.contiguous()
    M = gu.shape[0]
    dgu = torch.empty_like(gu)
    if M and N:
        cfg = config or default_swiglu_config(M, N, gu.device, interpret_mode())
        grid = (cdiv(M, cfg.block_rows), cdiv(N, cfg.block_n))
        fast_kernel(_swiglu_bwd_kernel)[grid](gu, grad_h, dgu, M, N, INT_ROUND=ir, LIBDEVICE=libdev,
                                 BLOCK_M=cfg.block_rows, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                                 **_launch_opts(libdev))
    return dgu


def swiglu_reference(gu: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference ``h = (silu(gate.float()) * up.float()).to(bfloat16)`` for ``gu = [gate | up]``."""
    N = _check_gu(gu, "swiglu_reference")
    g, u = gu[:, :N].float(), gu[:, N:].float()
    return (torch.nn.functional.silu(g) * u).to(torch.bfloat16)


__all__ = ["SwigluConfig", "default_swiglu_config", "swiglu_quantize", "swiglu_backward", "swiglu_reference",
           "silu_mul_f32", "interpret_mode"]
