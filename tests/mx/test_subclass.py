"""MXFP8Tensor: one MX value (payload + scales + layout) as a torch.Tensor for autograd."""
import pytest
import torch

from mxcomm.mx import MXTensor, ScaleLayout, dequantize, quantize
from mxcomm.mx.subclass import MXFP8Tensor, to_dense, unwrap_mx, wrap_mx


def _mx(rows=64, cols=96, seed=0, layout="row", offs=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-8, 8, (rows, 1), generator=g).float()))
    return quantize(x.to(torch.bfloat16), layout=layout, group_offs=offs)


def test_wrap_reports_logical_metadata_and_holds_the_value():
    mx = _mx()
    t = MXFP8Tensor(mx)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.shape == mx.shape
    assert t.device == mx.device and not t.requires_grad and t.is_contiguous()
    back = t.mx
    assert back.qdata is mx.qdata and back.scales is mx.scales
    assert (back.axis, back.layout, back.mode, back.orig_dtype) == (mx.axis, mx.layout, mx.mode, mx.orig_dtype)
    assert MXFP8Tensor.from_mx(mx, dtype=torch.float32, requires_grad=True).dtype == torch.float32
    assert "MXFP8Tensor(shape=(64, 96)" in repr(t)


def test_bad_construction_raises():
    with pytest.raises(TypeError, match="MXTensor"):
        MXFP8Tensor(torch.zeros(4, 32))
    with pytest.raises(TypeError, match="floating"):
        MXFP8Tensor(_mx(), dtype=torch.int32)


@pytest.mark.parametrize("layout", ["row", "blocked", "grouped_m"])
def test_dense_conversions_equal_the_reference_dequantize(layout):
    offs = torch.tensor([32, 32, 64], dtype=torch.int32) if layout == "grouped_m" else None
    mx = _mx(layout=layout, offs=offs, seed=1)
    t = MXFP8Tensor(mx)
    want = dequantize(mx, torch.float32)
    for got in (t.float(), t.to(torch.float32), t.dequantize(torch.float32), to_dense(t, torch.float32),
                to_dense(mx, torch.float32)):
        assert type(got) is torch.Tensor and got.dtype == torch.float32 and torch.equal(got, want)
    d = t.dequantize()
    assert type(d) is torch.Tensor and d.dtype == torch.bfloat16 and torch.equal(d, dequantize(mx, torch.bfloat16))


def test_same_value_ops_keep_the_mx_value():
    mx = _mx(seed=2)
    t = MXFP8Tensor(mx, requires_grad=True)
    for v in (t.detach(), torch.ops.aten.alias(t), t.view(64, 96), t.view(-1, 96), t.view_as(t)):
        assert isinstance(v, MXFP8Tensor) and v.qdata.data_ptr() == mx.qdata.data_ptr()
    c = t.clone()
    assert isinstance(c, MXFP8Tensor) and c.qdata.data_ptr() != mx.qdata.data_ptr()
    assert torch.equal(c.qdata.view(torch.uint8), mx.qdata.view(torch.uint8)) and torch.equal(c.scales, mx.scales)
    m = t.to("meta")
    assert isinstance(m, MXFP8Tensor) and m.device.type == "meta" and m.qdata.device.type == "meta"
    c2 = t.to(torch.bfloat16, copy=True)
    assert isinstance(c2, MXFP8Tensor) and c2.qdata.data_ptr() != mx.qdata.data_ptr()


@pytest.mark.parametrize("op", [
    lambda t: t + 1, lambda t: t * t, lambda t: t @ torch.ones(96, 2, dtype=torch.bfloat16), lambda t: t.sum(),
    lambda t: t[0], lambda t: t.t(), lambda t: torch.zeros_like(t), lambda t: t.view(96, 64),
])
def test_other_ops_raise_a_clear_error(op):
    t = MXFP8Tensor(_mx(seed=3))
    with pytest.raises(NotImplementedError, match="MXFP8Tensor"):
        op(t)


def test_dequantize_is_differentiable_straight_through():
    t = MXFP8Tensor(_mx(seed=4), requires_grad=True)
    g = torch.Generator().manual_seed(9)
    up = torch.randn(64, 96, generator=g)
    (t.dequantize(torch.float32) * up).sum().backward()
    assert type(t.grad) is torch.Tensor and t.grad.dtype == torch.bfloat16
    assert torch.equal(t.grad, up.to(torch.bfloat16))


class _EmitsMXGrad(torch.autograd.Function):
    """y = x (dense); backward hands x an MXFP8Tensor gradient (as combine does with grad_format="mx")."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return MXFP8Tensor(quantize(g.float()), dtype=torch.bfloat16)


def test_an_mx_gradient_reaches_a_leaf_and_a_cast():
    x = torch.randn(8, 64).to(torch.bfloat16).requires_grad_()
    up = torch.randn(8, 64)
    (_EmitsMXGrad.apply(x).float() * up).sum().backward()  # .float() backward casts the grad: stays MX-free
    assert torch.equal(x.grad.float(), quantize(up.to(torch.bfloat16).float()).dequantize(torch.float32))
    leaf = torch.randn(8, 64).to(torch.bfloat16).requires_grad_()
    y = _EmitsMXGrad.apply(leaf)
    y.backward(up.to(torch.bfloat16))
    assert isinstance(leaf.grad, MXFP8Tensor)  # accumulated as the one MX value
    assert torch.equal(leaf.grad.float(), quantize(up.to(torch.bfloat16).float()).dequantize(torch.float32))


def test_helpers_wrap_unwrap():
    mx = _mx(seed=5)
    t = wrap_mx(mx)
    assert isinstance(t, MXFP8Tensor) and unwrap_mx(t).qdata is mx.qdata
    plain = torch.zeros(2, 32)
    assert wrap_mx(plain) is plain and unwrap_mx(plain) is plain and unwrap_mx(mx) is mx


def test_flatten_unflatten_roundtrip():
    offs = torch.tensor([32, 64], dtype=torch.int32)
    mx = _mx(layout="grouped_m", offs=offs, seed=6)
    t = MXFP8Tensor(mx)
    names, ctx = t.__tensor_flatten__()
    assert set(names) == {"qdata", "scales", "group_offs"}
    u = MXFP8Tensor.__tensor_unflatten__({n: getattr(t, n) for n in names}, ctx, t.shape, t.stride())
    assert isinstance(u, MXFP8Tensor) and u.scale_layout == ScaleLayout.GROUPED_M and u.group_offs is offs
    assert torch.equal(u.float(), t.float())
    assert isinstance(t._stable_hash_for_caching(), str)
    assert MXFP8Tensor(_mx(layout="row")).__tensor_flatten__()[0] == ["qdata", "scales"]


def test_torch_compile_consumes_mx_without_graph_breaks():
    mx = _mx(seed=7)
    w = torch.randn(96, 16, generator=torch.Generator().manual_seed(3))

    def f(t, w):
        return (t.dequantize(torch.float32) @ w).square().sum()

    ts = [MXFP8Tensor(mx, requires_grad=True) for _ in range(2)]
    ws = [w.clone().requires_grad_() for _ in range(2)]
    eager = f(ts[0], ws[0])
    eager.backward()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(ts[1], ws[1])
    compiled.backward()
    assert torch.allclose(compiled, eager, rtol=1e-6)
    assert torch.equal(ts[1].grad, ts[0].grad) and torch.allclose(ws[1].grad, ws[0].grad, rtol=1e-6)


def test_mx_value_type_stays_the_frozen_dataclass():
    t = MXFP8Tensor(_mx(seed=8))
    assert isinstance(t.mx, MXTensor)
    with pytest.raises(Exception):
        t.mx.qdata = None  # frozen
