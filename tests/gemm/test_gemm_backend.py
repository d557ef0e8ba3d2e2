"""The capability gate of the native MXFP8 grouped GEMM (never launched below sm_100) and the backend choice.

The gate is exercised without the hardware by monkeypatching ``mxcomm.gemm.backend.device_capability``; the
native call itself is replaced by a stand-in that re-derives the documented operand contract (payload
orientation, grouped-M / per-expert blocked scale layouts, e8m0 dtype) and computes the product from it, so
the argument plumbing is checked on CPU. torch's own meta kernel of ``_scaled_grouped_mm`` checks shapes,
dtypes and strides of the real arguments.
"""
import pytest
import torch

from gemm_cases import make_offs, rand  # first: sets TRITON_INTERPRET where there is no GPU

from mxcomm import mx
from mxcomm.gemm import (
    GemmBackend,
    MXWeight,
    MXWeightCache,
    backend as B,
    grouped_mm,
    native_args,
    native_mxfp8_supported,
    reference_grouped_mm,
    select_backend,
)
from mxcomm.gemm.weights import blocked3d_to_rows
from mxcomm.mx import layouts


@pytest.fixture()
def fake_capability(monkeypatch):
    """Pretend every device (CPU included) has the given compute capability; returns a setter."""
    state = {}

    def setter(cap):
        state["cap"] = cap
        monkeypatch.setattr(B, "device_capability", lambda device: state["cap"])

    return setter


@pytest.fixture()
def no_native_launch(monkeypatch):
    """torch._scaled_grouped_mm replaced by a function that fails the test if it is ever called."""
    calls = []

    def boom(*args, **kwargs):
        calls.append(1)
        raise AssertionError("torch._scaled_grouped_mm was launched")

    monkeypatch.setattr(torch, "_scaled_grouped_mm", boom)
    return calls


@pytest.mark.parametrize("cap, native", [((9, 0), False), ((8, 0), False), ((10, 0), True), ((10, 3), True),
                                         ((12, 0), False), ((11, 0), False)])
def test_gate(cap, native, fake_capability):
    fake_capability(cap)
    assert native_mxfp8_supported(torch.device("cuda")) is native
    if native:
        B.check_native_allowed(torch.device("cuda"))
    else:
        with pytest.raises(RuntimeError, match="sm_100"):
            B.check_native_allowed(torch.device("cuda"))


def test_auto_choice(fake_capability):
    fake_capability((9, 0))
    assert select_backend(torch.device("cuda")) == GemmBackend.DEQUANT == B.EMULATED_DEFAULT
    fake_capability((10, 0))
    assert select_backend(torch.device("cuda")) == GemmBackend.NATIVE
    assert select_backend(torch.device("cpu")) == GemmBackend.REFERENCE


def test_real_capability_function_on_cpu():
    assert B.device_capability(torch.device("cpu")) is None
    assert not native_mxfp8_supported(torch.device("cpu"))


def test_forced_native_refused_on_sm90_before_launch(fake_capability, no_native_launch):
    """backend='native' on an sm_90 device raises RuntimeError and never reaches the kernel."""
    fake_capability((9, 0))
    with pytest.raises(RuntimeError, match="kills the CUDA context"):
        select_backend(torch.device("cuda"), "native")
    M, K, N, G = 64, 64, 32, 4
    offs = make_offs("uneven", M, "cpu")
    a = mx.quantize(rand((M, K), 0, "cpu"), layout="grouped_m", group_offs=offs)
    w = MXWeight.from_dense(rand((G, N, K), 1, "cpu"))
    with pytest.raises(RuntimeError):
        grouped_mm(a, w, offs, backend="native")
    assert not no_native_launch


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown grouped GEMM backend"):
        select_backend(torch.device("cpu"), "cutlass")


def _fake_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None, **kw):
    """Stand-in for torch._scaled_grouped_mm (MXFP8, 2D x 3D) built from the documented contract."""
    assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn
    assert scale_a.dtype == scale_b.dtype == torch.float8_e8m0fnu
    assert mat_a.stride(1) == 1, "mat_a must be row-major"
    assert mat_b.stride(1) == 1 and mat_b.stride(2) == mat_b.shape[1], "mat_b must be column-major [G, K, N]"
    assert out_dtype == torch.bfloat16 and offs.dtype == torch.int32
    M, K = mat_a.shape
    G, Kb, N = mat_b.shape
    assert Kb == K
    kb = K // 32
    # activation scales: grouped along M, each group blocked at a 128-aligned row
    sa = layouts.from_grouped_m(scale_a.view(torch.uint8), offs, M, kb)
    a32 = mx.dequantize(mx.MXTensor(qdata=mat_a, scales=sa, axis=1), torch.float32)
    # weight scales: per expert blocked [round_up(N,128) * round_up(K/32,4)] of the [N, K/32] scale matrix
    sb = blocked3d_to_rows(scale_b.view(torch.uint8), N, kb)  # [G, N, K/32]
    w_nk = mat_b.transpose(1, 2)  # [G, N, K] row-major
    w32 = mx.dequantize(mx.MXTensor(qdata=w_nk, scales=sb, axis=2), torch.float32)
    out = torch.empty(M, N, dtype=torch.bfloat16).fill_(7.0)  # rows past offs[-1]: garbage, like empty_strided
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = (a32[start:end] @ w32[g].t()).to(torch.bfloat16)
        start = end
    return out


@pytest.mark.parametrize("a_layout", ["grouped_m", "row"])
@pytest.mark.parametrize("w_kind", ["cache", "weight_row", "dense"])
def test_native_path_plumbing(a_layout, w_kind, fake_capability, monkeypatch):
    """With the capability faked to sm_100 and the kernel replaced by the contract stand-in, the native backend
    gives the reference result (payload orientation, both scale layouts, zeroed tail rows)."""
    fake_capability((10, 0))
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _fake_scaled_grouped_mm)
    M, K, N, G = 200, 96, 64, 4
    offs = make_offs("tail_unused", M, "cpu")
    a = mx.quantize(rand((M, K), 2, "cpu"), layout=a_layout, group_offs=offs if a_layout == "grouped_m" else None)
    master = rand((G, N, K), 3, "cpu")
    w = {"cache": lambda: MXWeightCache(master), "weight_row": lambda: MXWeight.from_dense(master),
         "dense": lambda: master}[w_kind]()
    if w_kind == "cache":
        assert w.scale_layout.value == "blocked"  # chosen because the (faked) device runs the native GEMM
    got = grouped_mm(a, w, offs, backend="native")
    want = reference_grouped_mm(a, w if w_kind != "dense" else MXWeight.from_dense(master), offs).to(torch.bfloat16)
    assert torch.equal(got.float(), want.float())
    assert bool((got[int(offs[-1]):] == 0).all())


def test_native_args_pass_torch_meta_checks():
    """torch's meta kernel of _scaled_grouped_mm accepts the arguments we build (shapes, dtypes, strides)."""
    M, K, N, G = 300, 128, 96, 3
    offs = torch.tensor([100, 100, 290], dtype=torch.int32)
    a = mx.quantize(rand((M, K), 4, "cpu"), layout="grouped_m", group_offs=offs)
    w = MXWeight.from_dense(rand((G, N, K), 5, "cpu"), layout="blocked")
    kw = native_args(a, w, offs)
    assert kw["scale_b"].shape == (G, 128 * 4) and kw["scale_a"].shape == (mx.grouped_m_rows(M, G), 4)

    def meta(t):
        return t.to("meta") if isinstance(t, torch.Tensor) else t

    mkw = {k: meta(v) for k, v in kw.items()}
    out = torch._scaled_grouped_mm(mkw.pop("mat_a"), mkw.pop("mat_b"), mkw.pop("scale_a"), mkw.pop("scale_b"), **mkw)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16


@pytest.mark.gpu
def test_gpu_gate_on_this_device():
    """On the test GPU: the native path is chosen only on sm_100/sm_103; on sm_90 (H200) it is not, and a forced
    native request raises without launching (the process's CUDA context stays usable)."""
    dev = torch.device("cuda")
    cap = torch.cuda.get_device_capability(dev)
    if cap[0] == 10:
        assert select_backend(dev) == GemmBackend.NATIVE
        return
    assert not native_mxfp8_supported(dev)
    assert select_backend(dev) != GemmBackend.NATIVE
    M, K, N, G = 256, 128, 128, 2
    offs = torch.tensor([100, 256], dtype=torch.int32, device=dev)
    a = mx.quantize(rand((M, K), 6, dev), layout="grouped_m", group_offs=offs)
    w = MXWeightCache(rand((G, N, K), 7, dev))
    assert w.scale_layout.value == "row"
    with pytest.raises(RuntimeError, match="sm_100"):
        grouped_mm(a, w, offs, backend="native")
    y = grouped_mm(a, w, offs)  # the context is alive
    torch.cuda.synchronize()
    assert torch.isfinite(y.float()).all()
