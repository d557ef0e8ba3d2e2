"""Expert weights cached from the fp32 master: MXFP8 in one GEMM orientation (:class:`MXWeight`), the
two-orientation MXFP8 cache (:class:`MXWeightCache`) and the BF16 copy of the BF16 GEMM path
(:class:`BF16WeightCache`). Both caches follow the same staleness rules (:class:`StaleWeightCacheError`).

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

:class:`BF16WeightCache` holds ``master.to(torch.bfloat16)`` (**2 bytes per weight**), bit-identical to the cast
the BF16 path otherwise does in every forward and again in every backward; forward and dgrad read the same copy
(a BF16 GEMM reads either orientation of one dense tensor).
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
# staleness rules shared by the caches
# ----------------------------------------------------------------------------------------------
class StaleWeightCacheError(RuntimeError):
    """The master weight changed since the weight cache (MXFP8 or BF16) was built (call ``refresh()``)."""


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


class _MasterCache:
    """What both weight caches share: the master, its stamp (storage pointer, autograd version counter, shape,
    strides, dtype, device) taken at each :meth:`refresh`, :attr:`generation` (bumped by every refresh),
    :meth:`mark_stale`, :meth:`check` (raise or, with ``auto_refresh``, refresh) and :meth:`attach_optimizer`.
    Subclasses implement :meth:`_rebuild` (the copies, from the current master) and :meth:`nbytes`."""

    _kind = "weight"

    def __init__(self, master: torch.Tensor, auto_refresh: bool):
        self.master = master
        self.auto_refresh = bool(auto_refresh)
        self.generation = 0
        self._stamp: Optional[_Stamp] = None
        self._marked_stale = False

    def _rebuild(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- state --------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Rebuild the cached copies from the current master; bumps :attr:`generation`."""
        self._rebuild()
        self._stamp = _stamp(self.master)
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
            f"{type(self).__name__} of master {tuple(self.master.shape)} is stale: the master weight changed (version "
            f"{self._stamp.version} -> {self.master._version}, or storage moved, or mark_stale()) since the last "
            "refresh(); call cache.refresh() after optimizer.step() / load_state_dict(), or build the cache with "
            "auto_refresh=True, or cache.attach_optimizer(opt)")

    def _check_generation(self, expected_generation: int) -> None:
        """Backward side: raise if the cache was refreshed, or its master changed, since the forward that ran at
        ``expected_generation`` (never refreshes: the backward must use the forward's weights)."""
        if self.generation != expected_generation or self.is_stale():
            raise StaleWeightCacheError(
                f"the master weight or its {self._kind} cache changed between forward and backward (cache generation "
                f"{expected_generation} -> {self.generation}, stale={self.is_stale()}); run backward before "
                "optimizer.step()")

    def attach_optimizer(self, optimizer: torch.optim.Optimizer):
        """Refresh after every ``optimizer.step()`` (also covers fused optimizers, which the version counter
        misses). Returns the hook handle (``handle.remove()`` detaches)."""
        return optimizer.register_step_post_hook(lambda opt, args, kwargs: self.refresh())

    def nbytes(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def shape(self) -> torch.Size:
        return self.master.shape


def _check_master(master, cls: str) -> None:
    if not isinstance(master, torch.Tensor) or master.dim() != 3:
        raise TypeError(f"{cls} needs a 3D master weight tensor [G, N, K]")
    if master.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"master weight must be float32 / bfloat16 / float16, got {master.dtype}")


# ----------------------------------------------------------------------------------------------
# the two-orientation MXFP8 cache
# ----------------------------------------------------------------------------------------------
class MXWeightCache(_MasterCache):
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

    _kind = "MXFP8"

    def __init__(self, master: torch.Tensor, *, mode: str = "rceil", scale_layout: Optional[str] = None,
                 auto_refresh: bool = False, keep_bf16: bool = False, build_dgrad: bool = True):
        _check_master(master, "MXWeightCache")
        if master.shape[1] % BLOCK or master.shape[2] % BLOCK:
            raise ValueError(f"master weight {tuple(master.shape)}: N and K must be multiples of 32")
        super().__init__(master, auto_refresh)
        self.mode = mode
        if scale_layout is None:
            scale_layout = ScaleLayout.BLOCKED if native_mxfp8_supported(master.device) else ScaleLayout.ROW
        self.scale_layout = ScaleLayout(scale_layout)
        self.keep_bf16 = bool(keep_bf16)
        self.build_dgrad = bool(build_dgrad)
        self._forward: Optional[MXWeight] = None
        self._dgrad: Optional[MXWeight] = None
        self.refresh()

    def _rebuild(self) -> None:
        """The forward (and dgrad) MXFP8 copies from the current master."""
        w = self.master
        kw = dict(mode=self.mode, layout=self.scale_layout, keep_bf16=self.keep_bf16)
        self._forward = MXWeight.from_dense(w, transpose=False, **kw)
        self._dgrad = MXWeight.from_dense(w, transpose=True, **kw) if self.build_dgrad else None

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
            self._check_generation(expected_generation)
        else:
            self.check()
        return self._dgrad

    def nbytes(self) -> int:
        """Persistent bytes held (both orientations, scales and optional BF16 copies)."""
        return sum(w.nbytes() for w in (self._forward, self._dgrad) if w is not None)

    def __repr__(self) -> str:
        return (f"MXWeightCache(master={tuple(self.master.shape)} {self.master.dtype}, mode={self.mode}, "
                f"scale_layout={self.scale_layout.value}, generation={self.generation}, nbytes={self.nbytes()})")


# ----------------------------------------------------------------------------------------------
# the BF16 copy
# ----------------------------------------------------------------------------------------------
class BF16WeightCache(_MasterCache):
    """BF16 copy of an expert weight master ``[G, N, K]`` for the BF16 grouped GEMMs (forward ``a @ W_g^T`` and
    dgrad ``grad_y @ W_g`` both read it), so the fp32 master is cast once per optimizer step instead of in every
    forward and again in every backward.

    The copy is bit-identical to ``master.to(torch.bfloat16)`` (the same round-to-nearest-even cast, done by
    ``copy_`` into a persistent buffer), so every output and gradient equals the uncached BF16 path's. Gradients
    still go to the master (the autograd function takes the master as its weight input and returns the wgrad in
    the master's dtype).

    Staleness: the rules of :class:`MXWeightCache` - every access compares the master's storage pointer and
    version counter with those at the last :meth:`refresh`; a changed master raises
    :class:`StaleWeightCacheError`, or refreshes when ``auto_refresh=True``. Writes the version counter misses
    (``p.data``, fused optimizers) need :meth:`attach_optimizer` or :meth:`mark_stale` / :meth:`refresh`. The
    backward checks that the cache was not refreshed and the master not changed since its forward, and never
    refreshes.

    :meth:`refresh` writes into the existing buffer when shape and device are unchanged (no second copy alive
    during the refresh); a forward whose backward has not run yet then raises at that backward (generation check).

    Memory: **2 bytes per weight** (``G * N * K * 2``), persistent, on the master's device.

    Args:
        master: ``[G, N, K]`` float32 / float16 master weight (a bfloat16 master is copied too, which only costs
            memory: the uncached path does not cast it).
        auto_refresh: refresh instead of raising when the master changed.
    """

    _kind = "BF16"

    def __init__(self, master: torch.Tensor, *, auto_refresh: bool = False):
        _check_master(master, "BF16WeightCache")
        super().__init__(master, auto_refresh)
        self._weight: Optional[torch.Tensor] = None
        self.refresh()

    def _rebuild(self) -> None:
        """``master.to(torch.bfloat16)`` into the persistent buffer (a new one if shape or device changed)."""
        with torch.no_grad():
            w = self.master.detach()
            if self._weight is None or self._weight.shape != w.shape or self._weight.device != w.device:
                self._weight = None  # drop the old buffer before allocating its replacement
                self._weight = torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
            self._weight.copy_(w)  # the cast of master.to(torch.bfloat16), into a contiguous buffer

    def weight(self, expected_generation: Optional[int] = None) -> torch.Tensor:
        """Checked BF16 copy ``[G, N, K]`` (contiguous; do not modify it).

        Args:
            expected_generation: the :attr:`generation` the forward used (backward side); if given, a refresh
                since then or a master changed since then raises, and nothing is refreshed.
        """
        if expected_generation is not None:
            self._check_generation(expected_generation)
        else:
            self.check()
        return self._weight

    def nbytes(self) -> int:
        """Persistent bytes held (2 per weight)."""
        return 0 if self._weight is None else self._weight.numel() * self._weight.element_size()

    def __repr__(self) -> str:
        return (f"BF16WeightCache(master={tuple(self.master.shape)} {self.master.dtype}, "
                f"generation={self.generation}, nbytes={self.nbytes()})")


__all__ = ["MXWeight", "MXWeightCache", "BF16WeightCache", "StaleWeightCacheError", "rows_to_blocked3d",
           "blocked3d_to_rows"]
