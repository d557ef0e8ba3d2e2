"""mxcomm MXTensor <-> torchao MXTensor: zero-copy (same storage), bit-exact both ways, every layout mapped or
refused; torchao's (emulated, CPU) MXFP8 grouped GEMM consuming a converted mxcomm dispatch output."""
import pytest
import torch

pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason="torchao (mxcomm[torchao]) not installed")

from torchao.prototype.mx_formats.mx_tensor import MXTensor as AOTensor  # noqa: E402

from mxcomm.integrations.torchao import from_torchao, to_torchao, to_torchao_grouped_mm_input  # noqa: E402
from mxcomm.mx import ScaleLayout, quantize  # noqa: E402
from mxcomm.mx.subclass import MXFP8Tensor  # noqa: E402


def _x(m, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 6, (m, k // 32, 1), generator=g).float()
                                                   ).expand(m, k // 32, 32).reshape(m, k)
    x[0, :32] = 0.0  # an all-zero block (scale byte 0)
    return x.bfloat16()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("m,k", [(64, 128), (200, 96), (1, 32)])
def test_row_roundtrip_zero_copy_bit_exact(mode, m, k):
    mx = quantize(_x(m, k), mode=mode)
    t = to_torchao(mx)
    assert isinstance(t, AOTensor) and not t.is_swizzled_scales and t.block_size == 32
    assert t.qdata.data_ptr() == mx.qdata.data_ptr() and t.scale.data_ptr() == mx.scales.data_ptr()
    assert t.scale.dtype == torch.float8_e8m0fnu and tuple(t.scale.shape) == (m, k // 32)
    assert torch.equal(_bits(t.dequantize(torch.float32)), _bits(mx.dequantize(torch.float32)))
    back = from_torchao(t, mode=mode)
    assert back.layout == ScaleLayout.ROW and back.mode == mode and back.orig_dtype == torch.bfloat16
    assert back.qdata.data_ptr() == mx.qdata.data_ptr() and back.scales.data_ptr() == mx.scales.data_ptr()
    assert torch.equal(_bits(back.qdata), _bits(mx.qdata)) and torch.equal(back.scales, mx.scales)


@pytest.mark.parametrize("m,k", [(64, 128), (200, 96), (300, 256)])
def test_blocked_roundtrip_zero_copy_bit_exact(m, k):
    mx = quantize(_x(m, k, 1), layout="blocked")
    t = to_torchao(mx)
    assert t.is_swizzled_scales and t.scale.data_ptr() == mx.scales.data_ptr()
    assert tuple(t.scale.shape) == ((m + 127) // 128 * 32, (k + 127) // 128 * 16)
    # torchao's own un-swizzle reads the same values
    assert torch.equal(_bits(t.dequantize(torch.float32)), _bits(mx.dequantize(torch.float32)))
    back = from_torchao(t)
    assert back.layout == ScaleLayout.BLOCKED and tuple(back.scales.shape) == tuple(mx.scales.shape)
    assert _same_storage(back.scales, mx.scales) and torch.equal(back.scales, mx.scales)
    assert torch.equal(back.row_scales(), mx.row_scales())


def test_torchao_quantized_tensors_convert_exactly():
    """torchao's own quantizer (rceil, ROW and swizzled) -> mxcomm: same values, same bytes as mxcomm's quantizer."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    x = _x(256, 128, 2)
    for swz in (False, True):
        t = AOTensor.to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL, is_swizzled_scales=swz)
        mx = from_torchao(t)
        assert mx.qdata.data_ptr() == t.qdata.data_ptr() and mx.scales.data_ptr() == t.scale.data_ptr()
        assert torch.equal(_bits(mx.dequantize(torch.float32)), _bits(t.dequantize(torch.float32)))
        ours = quantize(x, mode="rceil", layout="blocked" if swz else "row")
        assert torch.equal(_bits(mx.qdata), _bits(ours.qdata)) and torch.equal(mx.scales, ours.scales)
        assert torch.equal(_bits(to_torchao(mx).scale), _bits(t.scale))


def test_grouped_m_on_128_row_tiles_is_the_whole_matrix_swizzle():
    offs = torch.tensor([128, 128, 384, 512], dtype=torch.int32)  # includes an empty group
    mx = quantize(_x(512, 128, 3), layout="grouped_m", group_offs=offs)
    t = to_torchao(mx)
    assert t.is_swizzled_scales and t.scale.data_ptr() == mx.scales.data_ptr()
    blocked = quantize(_x(512, 128, 3), layout="blocked")
    assert torch.equal(_bits(t.scale).reshape(-1), blocked.scales.reshape(-1))
    assert torch.equal(_bits(t.dequantize(torch.float32)), _bits(mx.dequantize(torch.float32)))
    t2 = to_torchao(MXFP8Tensor(mx), check_groups=False)  # an MXFP8Tensor converts too
    assert t2.qdata.data_ptr() == mx.qdata.data_ptr()


def test_unrepresentable_layouts_raise():
    x = _x(96, 64, 4)
    offs = torch.tensor([32, 96], dtype=torch.int32)
    with pytest.raises(ValueError, match="no torchao equivalent"):
        to_torchao(quantize(x, layout="grouped_m", group_offs=offs))
    with pytest.raises(ValueError, match="no torchao equivalent"):
        to_torchao(quantize(x.t().contiguous(), axis=1, layout="grouped_k", group_offs=offs))
    with pytest.raises(ValueError, match="last dim"):
        to_torchao(quantize(x, axis=0))
    with pytest.raises(TypeError):
        to_torchao(x)


def test_torchao_grouped_gemm_consumes_dispatch_output():
    """An MXFP8 dispatch (gloo world of 1) -> ROW-scale torchao MXTensor (payload shared) -> torchao's MXFP8 grouped
    GEMM (emulated, wgrad_with_hp): equals the same GEMM on the dequantized rows; the conversion passes the gradient
    through to the dispatch."""
    import torch.distributed as dist
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common import KernelPreference

    from mxcomm.ep import EPConfig, EPGroup

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        E, K, H, N, T = 4, 2, 64, 96, 50
        g = torch.Generator().manual_seed(5)
        group = EPGroup(EPConfig(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T, precision="mxfp8"))
        x = torch.randn(T, H, generator=g).bfloat16().requires_grad_(True)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        d = group.dispatch(x, idx, torch.ones(T, K))
        a = to_torchao_grouped_mm_input(d.x)
        assert a.qdata.data_ptr() == d.x.qdata.data_ptr() and not a.is_swizzled_scales
        w_t = (torch.randn(E, N, H, generator=g) * H ** -0.5).bfloat16().transpose(-2, -1)  # (E, K=H, N), per-group col-major
        kw = dict(kernel_preference=KernelPreference.EMULATED, wgrad_with_hp=True)
        out = _to_mxfp8_then_scaled_grouped_mm(a, w_t, d.offs, **kw)
        ref = _to_mxfp8_then_scaled_grouped_mm(d.dense().detach(), w_t, d.offs, **kw)
        assert torch.equal(out, ref)
        # The backward is not run here: torchao 0.18's wgrad for an MXTensor A dequantizes it with its Triton
        # kernel (triton_mxfp8_dequant_dim0), whose CPU stand-in does not take the keyword torchao passes.
        # The conversion's own backward (gradient straight through to the dispatch) is checked directly:
        gx, = torch.autograd.grad(a, x, torch.ones(a.shape, dtype=torch.bfloat16))
        assert torch.equal(gx, torch.full_like(x, float(K)))  # each token's row went to K experts
    finally:
        if created:
            dist.destroy_process_group()
