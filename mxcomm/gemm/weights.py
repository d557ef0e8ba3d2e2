"""MXFP8 expert weights: one GEMM orientation (:class:`MXWeight`) and the two-orientation cache refreshed
from the fp32 master (:class:`MXWeightCache`).

Orientation convention: an :class:`MXWeight` holds ``qdata [G, N_out, K_red]`` (row-major, contiguous) with
1x32 blocks along ``K_red``, the reduction axis of the GEMM that reads it: ``y_g = a_g @ W_g^T``.

* forward cache: ``W [G, N, K]`` quantized along K -> ``MXWeight [G, N, K]`` (``y = a W^T``);
* dgrad cache: ``W`` quantized along N (32x1 blocks of each expert's ``[N, K]`` matrix), stored transposed
  -> ``MXWeight [G, K, N]`` (``grad_a = grad_y W = grad_y (W^T)^T``).

They hold different numbers (a row-wise and a column-wise quantization of the same weights cannot be
derived from each other), so both are built from the fp32 master.

Persistent memory per cache (expert weight count ``P = G*N*K``): payload ``P`` bytes + scales ``P/32``
bytes (row layout; the blocked layout pads N to 128 and K/32 to 4) per orientation, i.e.
**2 x 33/32 = 2.0625 bytes per weight** for forward + dgrad (against 4 for the fp32 master and 2 for a BF16
copy). ``keep_bf16=True`` adds a dequantized BF16 copy of each orientation (+4 bytes per weight) so the
Hopper ``dequant`` backend skips the per-call weight dequantize.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..mx import MXTensor, ScaleLayout, blocked_index, round_up
from ..mx.scales import BLOCK
from . import _ops
from .backend import native_mxfp8_supported


# ----------------------------------------------------------------------------------------------
# per-expert blocked scales, vectorized over experts
# ----------------------------------------------------------------------------------------------
def _blocked_index(rows: int, cols: int, device) -> torch.Tensor:
    r = torch.arange(rows, device=device, dtype=torch.int64).view(rows, 1).expand(rows, cols)
    c = torch.arange(cols, device=device, dtype=torch.int64).view(1, cols).expand(rows, cols)
    return blocked_index(r, c, round_up(cols, 4) // 4).reshape(-1)


def rows_to_blocked3d(s: torch.Tensor) -> torch.Tensor:
    """Row scales ``[G, R, C]`` -> per-expert blocked ``[G, round_up(R,128) * round_up(C,4)]`` uint8 (zero padding),
    the 3D-operand scale layout of ``torch._scaled_grouped_mm``."""
    G, R, C = s.shape
    out = torch.zeros(G, round_up(R, 128) * round_up(C, 4), dtype=torch.uint8, device=s.device)
    if G and R and C:
        out[:, _blocked_index(R, C, s.device)] = s.reshape(G, R * C).view(torch.uint8)
    return out


def blocked3d_to_rows(b: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`rows_to_blocked3d`: ``[G, Rp*Cp]`` -> ``[G, rows, cols]`` uint8."""
    G = b.shape[0]
    if b.shape[1] != round_up(rows, 128) * round_up(cols, 4):
        raise ValueError(f"blocked weight scales [G, {b.shape[1]}] do not match rows={rows}, cols={cols}")
    return b.view(torch.uint8)[:, _blocked_index(rows, cols, b.device)].view(G, rows, cols)


# ----------------------------------------------------------------------------------------------
# one orientation
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MXWeight:
    """Expert weights in one GEMM orientation, MXFP8.

    Attributes:
        qdata: ``[G, N_out, K_red]`` float8_e4m3fn, contiguous; 1x32 blocks along ``K_red``.
        scales: uint8 E8M0. ROW: ``[G, N_out, K_red/32]``; BLOCKED: ``[G, round_up(N_out,128) *
            round_up(K_red/32,4)]``, each expert's scale matrix 128x4-swizzled (the native GEMM's layout).
        layout: ``ScaleLayout.ROW`` or ``ScaleLayout.BLOCKED``.
        mode: scale rule used (``"rceil"`` / ``"floor"``).
        dense: optional BF16 ``[G, N_out, K_red]`` copy equal to ``dequantize(bfloat16)`` (kept by caches
            built with ``keep_bf16=True``), used by the ``dequant`` backend instead of dequantizing per call.
    """

    qdata: torch.Tensor
    scales: torch.Tensor
    layout: ScaleLayout = ScaleLayout.ROW
    mode: str = "rceil"
    dense: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.qdata.dtype != torch.float8_e4m3fn or self.qdata.dim() != 3:
            raise TypeError(f"MXWeight.qdata must be a 3D float8_e4m3fn tensor, got {self.qdata.dtype} "
                            f"{tuple(self.qdata.shape)}")
        if self.layout not in (ScaleLayout.ROW, ScaleLayout.BLOCKED):
            raise ValueError(f"MXWeight scales must be in row or blocked layout, got {self.layout}")
        G, N, K = self.qdata.shape
        if K % BLOCK:
            raise ValueError(f"MXWeight reduction axis {K} is not a multiple of 32")
        want = (G, N, K // BLOCK) if self.layout == ScaleLayout.ROW else (G, round_up(N, 128) * round_up(K // BLOCK, 4))
        if tuple(self.scales.shape) != want:
            raise ValueError(f"MXWeight scales for {tuple(self.qdata.shape)} in {self.layout.value} layout must have "
                             f"shape {want}, got {tuple(self.scales.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.qdata.shape

    @property
    def device(self) -> torch.device:
        return self.qdata.device

    @property
    def groups(self) -> int:
        return self.qdata.shape[0]

    def row_scales(self) -> torch.Tensor:
        """``[G, N_out, K_red/32]`` uint8."""
        if self.layout == ScaleLayout.ROW:
            return self.scales.view(torch.uint8)
        G, N, K = self.qdata.shape
        return blocked3d_to_rows(self.scales, N, K // BLOCK)

    def blocked_scales(self) -> torch.Tensor:
        """``[G, round_up(N_out,128) * round_up(K_red/32,4)]`` uint8 (the native GEMM's 3D-operand layout)."""
        if self.layout == ScaleLayout.BLOCKED:
            return self.scales.view(torch.uint8)
        return rows_to_blocked3d(self.scales)

    def with_layout(self, layout: ScaleLayout | str) -> "MXWeight":
        layout = ScaleLayout(layout)
        if layout == self.layout:
            return self
        s = self.row_scales() if layout == ScaleLayout.ROW else self.blocked_scales()
        return replace(self, scales=s, layout=layout)

    def as_mxtensor(self) -> MXTensor:
        """The row-layout :class:`MXTensor` view (3D, axis 2) of these weights."""
        return MXTensor(qdata=self.qdata, scales=self.row_scales(), axis=2, layout=ScaleLayout.ROW, mode=self.mode,
                        orig_dtype=torch.bfloat16)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Dense ``[G, N_out, K_red]`` (``dense`` is returned when it is there and ``dtype`` is bf16)."""
        if self.dense is not None and dtype == torch.bfloat16:
            return self.dense
        return _ops.dequantize(self.as_mxtensor(), dtype)

    def nbytes(self) -> int:
        n = self.qdata.numel() + self.scales.numel()
        return n + (self.dense.numel() * self.dense.element_size() if self.dense is not None else 0)

    @classmethod
    def from_dense(cls, w: torch.Tensor, *, transpose: bool = False, mode: str = "rceil",
                   layout: ScaleLayout | str = ScaleLayout.ROW, keep_bf16: bool = False) -> "MXWeight":
        """Quantize expert weights ``w [G, N, K]`` (fp32 / bf16 / fp16).

        Args:
            transpose: False -> forward orientation ``[G, N, K]`` (blocks along K); True -> dgrad orientation
                ``[G, K, N]`` (32x1 blocks along N of each expert's ``[N, K]``, stored transposed).
            mode / layout: scale rule; scale layout (row or blocked).
            keep_bf16: also keep the BF16 dequantized copy in ``dense``.
        """
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            raise TypeError(f"expert weights must be a 3D tensor [G, N, K], got "
                            f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
        G, N, K = w.shape
        if K % BLOCK or (transpose and N % BLOCK):
            axis = "N" if transpose else "K"
            raise ValueError(f"expert weights [G, N, K] = {tuple(w.shape)}: the quantized axis ({axis}) must be a "
                             "multiple of 32")
        with torch.no_grad():
            w2 = w.detach().reshape(G * N, K)
            if not transpose:
                m = _ops.quantize_rows(w2, mode=mode)
                q, s = m.qdata.view(G, N, K), m.scales.view(G, N, K // BLOCK)
            else:
                m = _ops.quantize_cols(w2, mode=mode)
                q = m.qdata.view(G, N, K).transpose(1, 2).contiguous()
                s = m.scales.view(G, N // BLOCK, K).transpose(1, 2).contiguous()
            out = cls(qdata=q, scales=s, layout=ScaleLayout.ROW, mode=mode).with_layout(layout)
            if keep_bf16:
                out = replace(out, dense=out.dequantize(torch.bfloat16))
        return out


# ----------------------------------------------------------------------------------------------
# the two-orientation cache
# ----------------------------------------------------------------------------------------------
class StaleWeightCacheError(RuntimeError):
    """The fp32 master weight changed since the MXFP8 cache was built (call ``refresh()``)."""


@dataclass(frozen=True)
class _Stamp:
    data_ptr: int
    version: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device


def _stamp(t: torch.Tensor) -> _Stamp:
    return _Stamp(t.data_ptr(), t._version, tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


class MXWeightCache:
    """MXFP8 forward and dgrad copies of an expert weight master ``[G, N, K]`` (y_g = a_g W_g^T).

    Both copies are rebuilt together by :meth:`refresh` - call it after every optimizer step and after
    loading a checkpoint (or :meth:`attach_optimizer` once). Every access checks the master's storage pointer
    and autograd version counter (``tensor._version``, bumped by in-place updates such as ``p.add_()``, the
    foreach optimizers and ``load_state_dict``'s ``copy_``); a changed master raises
    :class:`StaleWeightCacheError`, or refreshes when ``auto_refresh=True``. Old weights are never used
    silently *as far as the version counter can see*: writes that bypass it - through ``p.data``, fused
    optimizer kernels (``torch.optim.AdamW(fused=True)`` does not bump it) or raw pointers (e.g. a
    collective writing into the buffer) - are not detected; use :meth:`attach_optimizer` (refreshes after
    each ``step()``) or :meth:`mark_stale` / :meth:`refresh` for those.

    Memory: see the module docstring (2 x 33/32 bytes per weight; +4 with ``keep_bf16``).

    Args:
        master: ``[G, N, K]`` fp32 (or bf16) master weight, N and K multiples of 32.
        mode: scale rule (``"rceil"`` default).
        scale_layout: ``"row"`` / ``"blocked"``; None = blocked where the native MXFP8 GEMM runs, else row.
        auto_refresh: refresh instead of raising when the master changed.
        keep_bf16: also keep dequantized BF16 copies (Hopper ``dequant`` backend; +4 bytes per weight).
        build_dgrad: build the dgrad copy (False for inference).
    """

    def __init__(self, master: torch.Tensor, *, mode: str = "rceil", scale_layout: Optional[str] = None,
                 auto_refresh: bool = False, keep_bf16: bool = False, build_dgrad: bool = True):
        if not isinstance(master, torch.Tensor) or master.dim() != 3:
            raise TypeError("MXWeightCache needs a 3D master weight tensor [G, N, K]")
        if master.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"master weight must be float32 / bfloat16 / float16, got {master.dtype}")
        if master.shape[1] % BLOCK or master.shape[2] % BLOCK:
            raise ValueError(f"master weight {tuple(master.shape)}: N and K must be multiples of 32")
        self.master = master
        self.mode = mode
        if scale_layout is None:
            scale_layout = ScaleLayout.BLOCKED if native_mxfp8_supported(master.device) else ScaleLayout.ROW
        self.scale_layout = ScaleLayout(scale_layout)
        self.auto_refresh = bool(auto_refresh)
        self.keep_bf16 = bool(keep_bf16)
        self.build_dgrad = bool(build_dgrad)
        self.generation = 0
        self._forward: Optional[MXWeight] = None
        self._dgrad: Optional[MXWeight] = None
        self._stamp: Optional[_Stamp] = None
        self._marked_stale = False
        self.refresh()

    # -- state --------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Rebuild the forward (and dgrad) MXFP8 copies from the current master; bumps :attr:`generation`."""
        w = self.master
        kw = dict(mode=self.mode, layout=self.scale_layout, keep_bf16=self.keep_bf16)
        self._forward = MXWeight.from_dense(w, transpose=False, **kw)
        self._dgrad = MXWeight.from_dense(w, transpose=True, **kw) if self.build_dgrad else None
        self._stamp = _stamp(w)
        self._marked_stale = False
        self.generation += 1

    def mark_stale(self) -> None:
        """Declare the master changed (for writes the version counter cannot see)."""
        self._marked_stale = True

    def is_stale(self) -> bool:
        return self._marked_stale or self._stamp != _stamp(self.master)

    def check(self) -> None:
        """Raise :class:`StaleWeightCacheError` (or refresh, with ``auto_refresh``) if the master changed."""
        if not self.is_stale():
            return
        if self.auto_refresh:
            self.refresh()
            return
        raise StaleWeightCacheError(
            f"MXWeightCache of master {tuple(self.master.shape)} is stale: the master weight changed (version "
            f"{self._stamp.version} -> {self.master._version}, or storage moved, or mark_stale()) since the last "
            "refresh(); call cache.refresh() after optimizer.step() / load_state_dict(), or build the cache with "
            "auto_refresh=True, or cache.attach_optimizer(opt)")

    def attach_optimizer(self, optimizer: torch.optim.Optimizer):
        """Refresh after every ``optimizer.step()`` (also covers fused optimizers, which the version counter
        misses). Returns the hook handle (``handle.remove()`` detaches)."""
        return optimizer.register_step_post_hook(lambda opt, args, kwargs: self.refresh())

    # -- access -------------------------------------------------------------------------------
    def forward_weight(self) -> MXWeight:
        """Checked forward copy ``[G, N, K]`` (blocks along K)."""
        self.check()
        return self._forward

    def dgrad_weight(self, expected_generation: Optional[int] = None) -> MXWeight:
        """Checked dgrad copy ``[G, K, N]`` (blocks along N).

        Args:
            expected_generation: the :attr:`generation` the forward used; if given, a refresh since then, or a
                master changed since then, raises (the backward must use the forward's weights) - never
                refreshes.
        """
        if not self.build_dgrad:
            raise RuntimeError("this MXWeightCache was built with build_dgrad=False")
        if expected_generation is not None:
            if self.generation != expected_generation or self.is_stale():
                raise StaleWeightCacheError(
                    "the master weight or its MXFP8 cache changed between forward and backward (cache generation "
                    f"{expected_generation} -> {self.generation}, stale={self.is_stale()}); run backward before "
                    "optimizer.step()")
        else:
            self.check()
        return self._dgrad

    def nbytes(self) -> int:
        """Persistent bytes held (both orientations, scales and optional BF16 copies)."""
        return sum(w.nbytes() for w in (self._forward, self._dgrad) if w is not None)

    @property
    def shape(self) -> torch.Size:
        return self.master.shape

    def __repr__(self) -> str:
        return (f"MXWeightCache(master={tuple(self.master.shape)} {self.master.dtype}, mode={self.mode}, "
                f"scale_layout={self.scale_layout.value}, generation={self.generation}, nbytes={self.nbytes()})")


__all__ = ["MXWeight", "MXWeightCache", "StaleWeightCacheError", "rows_to_blocked3d", "blocked3d_to_rows"]
