"""Which grouped-GEMM implementation runs where (the capability gate lives here and only here).

* ``native`` - ``torch._scaled_grouped_mm`` with MXFP8 operands (E4M3 payload, E8M0 scales in the 128x4
  blocked layouts). **Blackwell datacenter parts only (compute capability 10.x: sm_100 / sm_103).**
  On sm_90 this call launches a Blackwell kernel and leaves the CUDA context dead (an exception
  handler does not help), so it is never launched unless :func:`native_mxfp8_supported` says so; a
  request for it on another device raises before anything is launched. Consumer Blackwell (sm_12x)
  and other major versions are not admitted either: PyTorch builds the MXFP8 grouped kernel for
  sm_100/sm_103, and a wrong guess costs the process.
* ``dequant`` - Hopper emulation: dequantize the MXFP8 operands to BF16 (Triton kernel) and run
  ``torch._grouped_mm`` in BF16 (CUTLASS). Default on CUDA below sm_100.
* ``triton`` - Hopper emulation in one kernel: a Triton grouped GEMM that decodes E4M3 and applies the
  per-32 scale in its load path (exactly the BF16 operand ``dequant`` would build) and multiplies in BF16
  with fp32 accumulation. Chosen explicitly (the GEMM benchmark reports which one is faster).
* ``reference`` - dequantize to fp32 and multiply per group in fp32 (host loop over groups). CPU default
  and the oracle the other backends are tested against.
"""
from __future__ import annotations

import enum
from typing import Optional

import torch


class GemmBackend(str, enum.Enum):
    """Grouped GEMM implementations (see the module docstring)."""

    NATIVE = "native"
    DEQUANT = "dequant"
    TRITON = "triton"
    REFERENCE = "reference"


#: Compute-capability majors on which the native MXFP8 grouped GEMM may be launched (sm_100, sm_103).
NATIVE_MX_MAJORS = (10,)
#: The sm_90 (and other non-native CUDA) default; the GEMM benchmark records the measured alternative.
EMULATED_DEFAULT = GemmBackend.DEQUANT


def device_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """CUDA compute capability of ``device`` (None for non-CUDA devices). Tests monkeypatch this function
    to exercise the gate without the hardware."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


def native_mxfp8_supported(device: torch.device) -> bool:
    """True only on a CUDA device of compute capability 10.x with ``torch._scaled_grouped_mm`` present."""
    cap = device_capability(device)
    return cap is not None and cap >= (10, 0) and cap[0] in NATIVE_MX_MAJORS and hasattr(torch, "_scaled_grouped_mm")


def check_native_allowed(device: torch.device) -> None:
    """Raise RuntimeError unless the native MXFP8 grouped GEMM may be launched on ``device``.

    Called right before every native launch, so even an explicit ``backend="native"`` cannot reach the
    kernel on sm_90 (where it would kill the CUDA context)."""
    if not native_mxfp8_supported(device):
        raise RuntimeError(
            f"native MXFP8 grouped GEMM (torch._scaled_grouped_mm) refused on {torch.device(device)} with compute "
            f"capability {device_capability(device)}: it needs sm_100/sm_103 (on sm_90 it kills the CUDA "
            "context); use backend='dequant' or 'triton'"
        )


def select_backend(device: torch.device, backend: Optional[str | GemmBackend] = None) -> GemmBackend:
    """The backend to use on ``device``.

    Args:
        device: where the operands live.
        backend: None (auto: native on sm_100/sm_103, :data:`EMULATED_DEFAULT` on other CUDA devices,
            reference on CPU) or a name/:class:`GemmBackend` to force one.
    Raises:
        ValueError: unknown name. RuntimeError: ``native`` where it is not supported, or a GPU backend
            for a CPU tensor outside Triton's interpreter.
    """
    device = torch.device(device)
    if backend is None:
        if device.type != "cuda":
            return GemmBackend.REFERENCE
        return GemmBackend.NATIVE if native_mxfp8_supported(device) else EMULATED_DEFAULT
    try:
        b = GemmBackend(backend)
    except ValueError:
        raise ValueError(f"unknown grouped GEMM backend {backend!r}; expected one of "
                         f"{[m.value for m in GemmBackend]}") from None
    if b == GemmBackend.NATIVE:
        check_native_allowed(device)
    return b


__all__ = ["GemmBackend", "NATIVE_MX_MAJORS", "EMULATED_DEFAULT", "device_capability", "native_mxfp8_supported",
           "check_native_allowed", "select_backend"]
