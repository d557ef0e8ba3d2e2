"""Shared helpers of the GEMM tests: import order (TRITON_INTERPRET only without a GPU), random MoE-like
operands, the fp32 oracle on dequantized operands and the tolerance used against it."""
import torch

from _triton_mode import load_kernels  # noqa: E402

load_kernels("mxcomm.kernels", "mxcomm.gemm")

from mxcomm import mx  # noqa: E402
from mxcomm.gemm import triton_gemm  # noqa: E402

INTERP = triton_gemm.interpret_mode()
DEV = "cpu" if not torch.cuda.is_available() else "cuda"

# offset patterns over M rows: (name, function M -> end offsets); includes empty groups, a single group,
# rows past the last group, unaligned sizes
OFFS_PATTERNS = {
    "uneven": lambda M: [M // 7, M // 7, M // 2 + 3, M - 5],
    "all_in_one": lambda M: [0, M, M, M],
    "first_last_empty": lambda M: [0, M // 3, 2 * M // 3, 2 * M // 3],
    "tail_unused": lambda M: [M // 4, M // 2, M // 2 + 1, 3 * M // 4],
}


def make_offs(pattern: str, M: int, device=DEV) -> torch.Tensor:
    return torch.tensor(OFFS_PATTERNS[pattern](M), dtype=torch.int32, device=device)


def rand(shape, seed, device=DEV, dtype=torch.float32, scale=1.0, spread=True):
    """Random values; with ``spread`` each 32-block along the last axis gets its own power-of-two scale
    (different E8M0 scales per block)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*shape, generator=g, device=device) * scale
    if spread and shape[-1] % 32 == 0:
        e = torch.randint(-4, 5, (*shape[:-1], shape[-1] // 32, 1), generator=g, device=device).float()
        x = (x.view(*shape[:-1], shape[-1] // 32, 32) * torch.exp2(e)).view(*shape)
    return x.to(dtype)


def fp32_grouped(a32: torch.Tensor, w32: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Independent fp32 oracle: ``out[rows g] = a32[rows g] @ w32[g].T``, rows past offs[-1] zero (float64 math)."""
    out = torch.zeros(a32.shape[0], w32.shape[1], dtype=torch.float64, device=a32.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a32[start:end].double() @ w32[g].double().t()
        start = end
    return out.float()


def fp32_wgrad(go32: torch.Tensor, x32: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    G = offs.numel()
    out = torch.zeros(G, go32.shape[1], x32.shape[1], dtype=torch.float64, device=go32.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[g] = go32[start:end].double().t() @ x32[start:end].double()
        start = end
    return out.float()


def assert_close_gemm(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, K: int, out_rel=2.0 ** -8):
    """``got`` (a GEMM with fp32 accumulation, result rounded to bf16) against the fp64 oracle ``want``.

    ``bound`` = the oracle on the absolute values (``sum_k |a||w|``). Rigorous worst case: fp32 accumulation
    error <= K * 2^-24 * bound, then one rounding to bf16 (relative 2^-9): we allow
    ``out_rel * |want| + 2 * K * 2^-24 * bound``.
    """
    got = got.float().cpu()
    want = want.float().cpu()
    bound = bound.float().cpu()
    assert got.shape == want.shape, (got.shape, want.shape)
    tol = out_rel * want.abs() + 2 * K * 2.0 ** -24 * bound + 1e-30
    err = (got - want).abs()
    bad = ~(err <= tol)
    assert not bool(bad.any()), (f"{int(bad.sum())} of {bad.numel()} outputs off; worst err/tol "
                                 f"{float((err / tol).max()):.3g}")


def dq(m, dtype=torch.float32):
    return mx.dequantize(m, dtype)


def master_updates():
    """(name, function(param) that changes the master in a way the version counter / pointer check sees)."""
    def inplace(p):
        with torch.no_grad():
            p.add_(1.0)

    def sgd(p):
        p.grad = torch.ones_like(p)
        torch.optim.SGD([p], lr=0.1).step()

    def adamw_foreach(p):
        p.grad = torch.ones_like(p)
        torch.optim.AdamW([p], lr=0.1, foreach=True).step()

    def load_state(p):
        m = torch.nn.Module()
        m.w = p
        m.load_state_dict({"w": torch.zeros_like(p)})

    def rebind(p):
        p.data = p.data.clone() + 1  # new storage: the pointer check sees it

    return [("inplace", inplace), ("sgd", sgd), ("adamw_foreach", adamw_foreach), ("load_state_dict", load_state),
            ("rebind_data", rebind)]
