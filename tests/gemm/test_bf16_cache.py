"""BF16WeightCache: a persistent BF16 copy of an expert-weight master, bit-identical to ``master.to(bfloat16)``;
the BF16 grouped_linear on it gives bit-identical outputs and gradients to the cast-per-call path; staleness rules
as MXWeightCache (version counter / storage pointer, auto refresh, optimizer hook, mark_stale, backward
generation check)."""
import pytest
import torch

from gemm_cases import DEV, make_offs, master_updates, rand

from mxcomm.gemm import MXWeightCache, StaleWeightCacheError, grouped_linear, grouped_mm_bf16
from mxcomm.gemm.weights import BF16WeightCache

M, K, N, G = 120, 64, 96, 4


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).cpu()


def _all_bit_patterns(shape, seed) -> torch.Tensor:
    """fp32 tensor of random bit patterns (NaNs, infinities, subnormals, -0, exact bf16 ties included)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)
    flat = bits.view(-1)
    special = torch.tensor([0x00000000, -0x80000000, 0x7F800000, -0x00800000, 0x7FC00000, 0x00000001,
                            0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7FFFFF, 0x00400000],
                           dtype=torch.int64).to(torch.int32)
    flat[: special.numel()] = special
    return bits.view(torch.float32).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_copy_is_bit_identical_to_the_cast(dtype):
    master = _all_bit_patterns((3, 32, 64), 1)
    if dtype == torch.float16:
        master = master.nan_to_num(0.0).clamp(-6e4, 6e4).to(torch.float16)
    c = BF16WeightCache(master)
    w = c.weight()
    assert w.dtype == torch.bfloat16 and w.shape == master.shape and w.is_contiguous() and w.device == master.device
    assert torch.equal(_bits(w), _bits(master.to(torch.bfloat16)))
    # a refresh writes into the same buffer (no second copy), with the new bits
    ptr = w.data_ptr()
    with torch.no_grad():
        master.copy_(_all_bit_patterns((3, 32, 64), 2).nan_to_num(0.0).clamp(-6e4, 6e4).to(dtype))
    c.refresh()
    assert c.weight().data_ptr() == ptr and c.generation == 2
    assert torch.equal(_bits(c.weight()), _bits(master.to(torch.bfloat16)))


def test_non_contiguous_master_and_memory():
    base = rand((G, K, N), 3)
    master = base.transpose(1, 2)  # [G, N, K] view, not contiguous
    c = BF16WeightCache(master)
    assert c.weight().is_contiguous()
    assert torch.equal(_bits(c.weight()), _bits(master.to(torch.bfloat16)))
    assert c.nbytes() == G * N * K * 2
    assert c.shape == master.shape and "generation=1" in repr(c) and f"nbytes={G * N * K * 2}" in repr(c)


def _setup(seed=0, pattern="uneven", master_dtype=torch.float32):
    offs = make_offs(pattern, M)
    x = rand((M, K), seed, dtype=torch.bfloat16)
    W = torch.nn.Parameter(rand((G, N, K), seed + 1, scale=0.1).to(master_dtype))
    gy = rand((M, N), seed + 2, dtype=torch.bfloat16)
    return offs, x, W, gy


def _run(x, W, offs, gy, cache):
    W.grad = None
    xin = x.float().clone().requires_grad_()
    y = grouped_linear(xin, W, offs, cache)
    y.backward(gy)
    return y.detach(), xin.grad, W.grad.clone()


@pytest.mark.parametrize("pattern", ["uneven", "first_last_empty", "tail_unused"])
@pytest.mark.parametrize("master_dtype", [torch.float32, torch.float16])
def test_grouped_linear_on_the_cache_is_bit_identical(pattern, master_dtype):
    offs, x, W, gy = _setup(seed=4, pattern=pattern, master_dtype=master_dtype)
    y0, gx0, gw0 = _run(x, W, offs, gy, None)
    y1, gx1, gw1 = _run(x, W, offs, gy, BF16WeightCache(W))
    assert gw1.dtype == master_dtype and gx1.dtype == torch.float32
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1)
    assert bool(gw1.abs().sum() > 0)
    # the plain GEMM takes the cache as its weights too
    assert torch.equal(grouped_mm_bf16(x, BF16WeightCache(W), offs), grouped_mm_bf16(x, W, offs))


@pytest.mark.parametrize("name, update", master_updates(), ids=[n for n, _ in master_updates()])
def test_stale_cache_raises_then_refresh_follows(name, update):
    p = torch.nn.Parameter(rand((2, 32, 64), 5))
    c = BF16WeightCache(p)
    assert not c.is_stale()
    c.weight()
    update(p)
    assert c.is_stale()
    with pytest.raises(StaleWeightCacheError, match="BF16WeightCache.*refresh"):
        c.weight()
    c.refresh()
    assert not c.is_stale()
    assert torch.equal(_bits(c.weight()), _bits(p.detach().to(torch.bfloat16)))


def test_stale_cache_in_forward_and_auto_refresh():
    offs, x, W, gy = _setup(seed=7)
    c = BF16WeightCache(W)
    with torch.no_grad():
        W.mul_(2.0)
    with pytest.raises(StaleWeightCacheError):
        grouped_linear(x, W, offs, c)
    a = BF16WeightCache(W, auto_refresh=True)
    with torch.no_grad():
        W.mul_(0.5)
    y = grouped_linear(x, W, offs, a)
    assert a.generation == 2 and torch.equal(y, grouped_linear(x, W, offs))


@pytest.mark.parametrize("change", ["master_inplace", "refresh", "refresh_after_inplace"])
def test_weights_changed_between_forward_and_backward_raise(change):
    offs, x, W, gy = _setup(seed=6)
    c = BF16WeightCache(W, auto_refresh=True)
    xin = x.clone().requires_grad_()
    y = grouped_linear(xin, W, offs, c)
    with torch.no_grad():
        if change != "refresh":
            W.add_(1.0)
    if change != "master_inplace":
        c.refresh()
    with pytest.raises(StaleWeightCacheError, match="between forward and backward"):
        y.backward(gy)


def test_writes_the_version_counter_misses_and_the_remedies():
    """Fused AdamW and writes through .data do not bump the version counter; attach_optimizer (refresh after every
    step) and mark_stale cover them."""
    p = torch.nn.Parameter(rand((2, 32, 64), 8))
    c = BF16WeightCache(p)
    with torch.no_grad():
        p.data.add_(1.0)
    assert not c.is_stale()  # invisible to the version counter
    c.mark_stale()
    with pytest.raises(StaleWeightCacheError):
        c.weight()
    c.refresh()
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    handle = c.attach_optimizer(opt)
    p.grad = torch.ones_like(p)
    gen, before = c.generation, p.detach().clone()
    opt.step()
    assert not torch.equal(p.detach(), before) and c.generation == gen + 1 and not c.is_stale()
    assert torch.equal(_bits(c.weight()), _bits(p.detach().to(torch.bfloat16)))
    handle.remove()
    opt.step()
    assert c.generation == gen + 1


def test_training_steps_match_the_uncached_path():
    """Three SGD steps with the cache refreshed by the optimizer hook follow exactly the trajectory of the
    cast-per-call path."""
    offs, x, W, gy = _setup(seed=9)
    W2 = torch.nn.Parameter(W.detach().clone())
    target = rand((M, N), 10, dtype=torch.bfloat16) * 0.1
    opt, opt2 = torch.optim.SGD([W], lr=0.05), torch.optim.SGD([W2], lr=0.05)
    c = BF16WeightCache(W)
    c.attach_optimizer(opt)
    for _ in range(3):
        for w, o, cache in ((W, opt, c), (W2, opt2, None)):
            o.zero_grad()
            loss = ((grouped_linear(x, w, offs, cache).float() - target.float()) ** 2).mean()
            loss.backward()
            o.step()
    assert c.generation == 4 and not torch.equal(W.detach(), _setup(seed=9)[2].detach())
    assert torch.equal(W.detach(), W2.detach())


def test_errors():
    offs, x, W, gy = _setup(seed=10)
    with pytest.raises(ValueError, match="another master"):
        grouped_linear(x, W, offs, BF16WeightCache(torch.nn.Parameter(W.detach().clone())))
    with pytest.raises(TypeError, match="cache must be"):
        grouped_linear(x, W, offs, W.detach())
    with pytest.raises(TypeError):
        BF16WeightCache(torch.zeros(32, 64, device=DEV))
    with pytest.raises(TypeError):
        BF16WeightCache(torch.zeros(2, 32, 64, dtype=torch.int32, device=DEV))
    # MXWeightCache keeps its own error text
    m = MXWeightCache(torch.nn.Parameter(rand((2, 32, 64), 11)))
    m.mark_stale()
    with pytest.raises(StaleWeightCacheError, match="^MXWeightCache of master"):
        m.forward_weight()
