"""E8M0 scale selection and E4M3 payload rules (plain torch, CPU and GPU).

Everything here follows the OCP MX v1.0 element formats with the conventions
written down in the README's "Format" section:

* E4M3 (``torch.float8_e4m3fn``): max finite 448, no Inf, NaN = 0x7F / 0xFF.
* E8M0 scale byte ``b`` encodes ``2 ** (b - 127)``; byte 0 is ``2**-127`` (not
  zero), byte 255 is NaN.
* ``rceil`` (default): ``b = round_up_to_e8m0(fp32(amax) * fp32(1/448))`` - take
  the fp32 exponent field and add one when the mantissa is non-zero (for an fp32
  subnormal: when the mantissa exceeds 0x400000).
* ``floor`` (OCP baseline): ``b = clamp(exponent_field(amax) - 8, 0, 254)``.
* Payload: ``q = e4m3_rne_satfinite(x * reciprocal(b))``.
* A block that holds a NaN or an Inf gets ``b = 0xFF`` and all of its payload
  bytes become 0x7F (NaN); other blocks are unaffected. An all-zero block gets
  ``b = 0`` and a zero payload (signed zeros keep their sign: -0.0 -> 0x80).
* Decode saturates (:func:`saturate_finite`): every MX value built from finite bytes is a
  finite number, but it can exceed the largest finite value of the dtype it is decoded to
  (rceil: a block max within 1/64 of 2**128 gets scale 2**120 and payload 256, i.e. 2**128).
  Such a value becomes +-(that dtype's largest finite value); NaN (scale byte 0xFF, payload
  0x7F/0xFF) stays NaN. Quantization itself is unchanged.
"""
from __future__ import annotations

import torch

BLOCK = 32
E4M3_MAX = 448.0
E8M0_NAN = 255
E4M3_NAN_BYTE = 0x7F
from .modes import SCALE_MODES  # noqa: E402  (defined once, torch-free)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# fp32(1/448) as the hardware and cuBLAS compute it: rounded once to fp32.
_INV_E4M3_MAX_F32 = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32).item()


def check_mode(mode: str) -> None:
    if mode not in SCALE_MODES:
        raise ValueError(f"scale mode must be one of {SCALE_MODES}, got {mode!r}")


def scale_bytes_from_amax(amax: torch.Tensor, mode: str = "rceil") -> torch.Tensor:
    """E8M0 scale bytes from block maxima.

    Args:
        amax: float32 tensor of any shape, ``max |x|`` per block (may hold NaN/Inf).
        mode: ``"rceil"`` or ``"floor"``.
    Returns:
        uint8 tensor of the same shape; 255 where amax is NaN or Inf.
    """
    check_mode(mode)
    amax = amax.to(torch.float32)
    bad = ~torch.isfinite(amax)
    safe = torch.where(bad, torch.zeros_like(amax), amax)
    if mode == "rceil":
        v = safe * torch.tensor(_INV_E4M3_MAX_F32, dtype=torch.float32, device=amax.device)
        bits = v.view(torch.int32)
        exp = (bits >> 23) & 0xFF
        man = bits & 0x7FFFFF
        up = torch.where(exp == 0, man > 0x400000, man != 0)
        b = exp + up.to(torch.int32)
        b = torch.clamp(b, 0, 254)
    else:
        bits = safe.view(torch.int32)
        exp = (bits >> 23) & 0xFF
        b = torch.clamp(exp - 8, 0, 254)
    b = torch.where(bad, torch.full_like(b, E8M0_NAN), b)
    return b.to(torch.uint8)


def scale_reciprocal(b: torch.Tensor) -> torch.Tensor:
    """fp32 ``2 ** (127 - b)`` for E8M0 bytes ``b`` (exact, bit-built).

    b == 254 gives the fp32 subnormal 2**-127 (bits 0x00400000); b == 255 gives NaN.
    """
    bi = b.to(torch.int32)
    bits = (254 - bi) << 23
    bits = torch.where(bi == 254, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(bi == 255, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def scale_value(b: torch.Tensor) -> torch.Tensor:
    """fp32 ``2 ** (b - 127)`` for E8M0 bytes (exact); byte 255 gives NaN, byte 0 gives 2**-127."""
    bi = b.to(torch.int32)
    bits = bi << 23
    bits = torch.where(bi == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(bi == 255, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def finite_max(dtype: torch.dtype) -> float:
    """Largest finite value of a float dtype (bf16 3.3895314e38, fp16 65504, fp32 3.4028235e38)."""
    return torch.finfo(dtype).max


def saturate_finite(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clamp decoded values ``v`` (fp32, where the exact product overflowed to +-Inf) to +-``finite_max(dtype)``;
    NaN stays NaN. ``dtype`` is the dtype the values are delivered in: clamp to IT, not to fp32's max, which
    rounds to bf16/fp16 Inf."""
    m = finite_max(dtype)
    return torch.clamp(v, -m, m)  # torch.clamp propagates NaN


def e4m3_rne_satfinite(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 to E4M3 (round-to-nearest-even, saturating to +-448; NaN stays NaN)."""
    v = torch.clamp(v.to(torch.float32), -E4M3_MAX, E4M3_MAX)
    return v.to(torch.float8_e4m3fn)
