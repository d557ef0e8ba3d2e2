"""MXGroupedLinear / grouped_linear: forward, dgrad (grad_y quantized to MXFP8 with the dgrad weight copy) and
wgrad (fp32) against fp64 oracles built from the same quantized operands; BF16 path; inputs as dense tensors,
MXTensors and objects / tensor subclasses carrying ``.mx``."""
import pytest
import torch

from gemm_cases import DEV, assert_close_gemm, fp32_grouped, fp32_wgrad, make_offs, rand

from mxcomm import mx
from mxcomm.gemm import GroupedLinearConfig, MXGroupedLinear, MXWeightCache, StaleWeightCacheError, grouped_linear

M, K, N, G = 120, 64, 96, 4
BACKENDS = ["reference", "dequant", "triton"]


def _setup(seed=0, pattern="tail_unused", master_dtype=torch.float32):
    offs = make_offs(pattern, M)
    x = rand((M, K), seed, dtype=torch.bfloat16)
    W = torch.nn.Parameter(rand((G, N, K), seed + 1, scale=0.1).to(master_dtype))
    gy = rand((M, N), seed + 2, dtype=torch.bfloat16)
    return offs, x, W, gy


def _mx_oracles(a_mx, cache, gy, offs, quantize_dgrad=True):
    a32 = mx.dequantize(a_mx, torch.float32)
    wf = cache.forward_weight().dequantize(torch.float32)
    wd = cache.dgrad_weight().dequantize(torch.float32)  # [G, K, N]
    if quantize_dgrad:
        g32 = mx.dequantize(mx.quantize(gy, layout="grouped_m", group_offs=offs), torch.float32)
    else:
        g32 = gy.float()
    y = (fp32_grouped(a32, wf, offs), fp32_grouped(a32.abs(), wf.abs(), offs))
    da = (fp32_grouped(g32, wd, offs), fp32_grouped(g32.abs(), wd.abs(), offs))
    dw = (fp32_wgrad(gy.float(), a32, offs), fp32_wgrad(gy.float().abs(), a32.abs(), offs))
    return y, da, dw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quantize_dgrad", [True, False])
def test_mx_path_dense_input(backend, quantize_dgrad):
    offs, x, W, gy = _setup(seed=1)
    cache = MXWeightCache(W)
    xin = x.clone().requires_grad_()
    cfg = GroupedLinearConfig(backend=backend, quantize_dgrad=quantize_dgrad)
    y = grouped_linear(xin, W, offs, cache, cfg)
    y.backward(gy)
    a_mx = mx.quantize(x, layout="grouped_m", group_offs=offs)
    (yw, yb), (daw, dab), (dww, dwb) = _mx_oracles(a_mx, cache, gy, offs, quantize_dgrad)
    assert y.dtype == torch.bfloat16
    assert_close_gemm(y, yw, yb, K)
    assert xin.grad.dtype == torch.bfloat16
    assert_close_gemm(xin.grad, daw, dab, N)
    assert W.grad.dtype == torch.float32 and W.grad.shape == W.shape
    assert_close_gemm(W.grad, dww, dwb, M)
    assert bool((xin.grad[int(offs[-1]):] == 0).all())


def test_triton_wgrad_backend():
    """wgrad by the Triton kernel (fp32 accumulator, MX input decoded in its load path)."""
    offs, x, W, gy = _setup(seed=11, pattern="first_last_empty")
    cache = MXWeightCache(W)
    y = grouped_linear(x, W, offs, cache, GroupedLinearConfig(wgrad_backend="triton"))
    y.backward(gy)
    a_mx = mx.quantize(x, layout="grouped_m", group_offs=offs)
    _, _, (dww, dwb) = _mx_oracles(a_mx, cache, gy, offs)
    assert_close_gemm(W.grad, dww, dwb, M, out_rel=2.0 ** -20)  # no bf16 rounding of the result


def test_mx_path_mxtensor_input_and_wrappers():
    offs, x, W, gy = _setup(seed=2)
    cache = MXWeightCache(W)
    a_mx = mx.quantize(x, layout="grouped_m", group_offs=offs)
    (yw, yb), (daw, dab), (dww, dwb) = _mx_oracles(a_mx, cache, gy, offs)

    # plain MXTensor: not a tensor, so no gradient for it; the weight gets one
    y = grouped_linear(a_mx, W, offs, cache)
    assert_close_gemm(y, yw, yb, K)
    y.backward(gy)
    assert_close_gemm(W.grad, dww, dwb, M)

    # any object with an .mx attribute
    class Holder:
        def __init__(self, m):
            self.mx = m

    W.grad = None
    y2 = grouped_linear(Holder(a_mx), W, offs, cache)
    assert torch.equal(y2, y)

    # a tensor subclass carrying .mx (stand-in for the autograd-aware MX tensor): its gradient is dense bf16
    class MXCarrier(torch.Tensor):
        pass

    t = torch.zeros(M, K, dtype=torch.bfloat16, device=DEV).as_subclass(MXCarrier)
    t.mx = a_mx
    t.requires_grad_()
    y3 = grouped_linear(t, W, offs, cache)
    assert torch.equal(y3, y)
    y3.backward(gy)
    assert t.grad is not None and t.grad.dtype == torch.bfloat16
    assert_close_gemm(t.grad, daw, dab, N)


def test_with_mxfp8_tensor_subclass():
    """The project's MX tensor subclass (mxcomm.mx.subclass.MXFP8Tensor), where it exists."""
    try:
        from mxcomm.mx.subclass import MXFP8Tensor
    except ImportError:
        pytest.skip("mxcomm.mx.subclass not available")
    offs, x, W, gy = _setup(seed=3)
    cache = MXWeightCache(W)
    a_mx = mx.quantize(x, layout="grouped_m", group_offs=offs)
    t = MXFP8Tensor.from_mx(a_mx, requires_grad=True)
    y = grouped_linear(t, W, offs, cache)
    y.backward(gy)
    (yw, yb), (daw, dab), _ = _mx_oracles(a_mx, cache, gy, offs)
    assert_close_gemm(y, yw, yb, K)
    assert t.grad is not None
    assert_close_gemm(t.grad.float(), daw, dab, N)


@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
def test_bf16_path(master_dtype):
    offs, x, W, gy = _setup(seed=4, pattern="uneven", master_dtype=master_dtype)
    xin = x.float().clone().requires_grad_()  # fp32 activations are cast to bf16; their grad comes back fp32
    y = grouped_linear(xin, W, offs)
    y.backward(gy)
    a16 = x.float()
    w16 = W.detach().to(torch.bfloat16).float()
    assert_close_gemm(y, fp32_grouped(a16, w16, offs), fp32_grouped(a16.abs(), w16.abs(), offs), K)
    assert xin.grad.dtype == torch.float32
    assert_close_gemm(xin.grad, fp32_grouped(gy.float(), w16.transpose(1, 2), offs),
                      fp32_grouped(gy.float().abs(), w16.abs().transpose(1, 2), offs), N)
    assert W.grad.dtype == master_dtype
    out_rel = 2.0 ** -8 if master_dtype == torch.float32 else 2.0 ** -7
    assert_close_gemm(W.grad, fp32_wgrad(gy.float(), a16, offs), fp32_wgrad(gy.float().abs(), a16.abs(), offs), M,
                      out_rel=out_rel)


def test_gradient_flows_through_a_graph():
    """Non-leaf input, frozen weight (no wgrad computed), second use of the output."""
    offs, x, W, gy = _setup(seed=5)
    W.requires_grad_(False)
    cache = MXWeightCache(W)
    leaf = x.float().requires_grad_()
    y = grouped_linear((leaf * 2).to(torch.bfloat16), W, offs, cache)
    (y.float() * gy.float()).sum().backward()
    assert leaf.grad is not None and leaf.grad.shape == (M, K) and torch.isfinite(leaf.grad).all()
    assert W.grad is None


def test_weights_changed_between_forward_and_backward():
    offs, x, W, gy = _setup(seed=6)
    cache = MXWeightCache(W, auto_refresh=True)
    xin = x.clone().requires_grad_()
    y = grouped_linear(xin, W, offs, cache)
    with torch.no_grad():
        W.add_(1.0)
    with pytest.raises(StaleWeightCacheError, match="between forward and backward"):
        y.backward(gy)


def test_stale_cache_in_forward():
    offs, x, W, gy = _setup(seed=7)
    cache = MXWeightCache(W)
    with torch.no_grad():
        W.mul_(2.0)
    with pytest.raises(StaleWeightCacheError):
        grouped_linear(x, W, offs, cache)


def test_training_steps_with_attached_optimizer():
    """Three SGD steps through the MX path with the cache refreshed by the optimizer hook; the loss of a
    regression toward a fixed target goes down and never uses stale weights."""
    offs, x, W, gy = _setup(seed=8)
    target = rand((M, N), 9, dtype=torch.bfloat16) * 0.1
    cache = MXWeightCache(W)
    opt = torch.optim.SGD([W], lr=0.05)
    cache.attach_optimizer(opt)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        y = grouped_linear(x, W, offs, cache)
        loss = ((y.float() - target.float()) ** 2)[: int(offs[-1])].mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert cache.generation == 4
    assert losses[2] < losses[0]


def test_errors():
    offs, x, W, gy = _setup(seed=10)
    other = MXWeightCache(torch.nn.Parameter(W.detach().clone()))
    with pytest.raises(ValueError, match="another master"):
        grouped_linear(x, W, offs, other)
    with pytest.raises(TypeError):
        MXGroupedLinear.apply(x, W[0], offs, None, GroupedLinearConfig())
    with pytest.raises(ValueError):
        GroupedLinearConfig(backend="fast")
    with pytest.raises(TypeError):
        grouped_linear(x.view(-1), W, offs, MXWeightCache(W))
