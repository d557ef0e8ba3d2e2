"""The BF16 weight cache of ``MoE(precision="bf16")`` (``bf16_weight_cache=True``, the default) in one process:
bit-identical outputs and gradients to the cast-per-call layer (``bf16_weight_cache=False``), the same training
trajectory, memory, and the staleness rules (optimizer step without refresh, ``cache_refresh="auto"``,
``attach_optimizer`` with a fused optimizer, ``load_state_dict`` / ``load_global_weights``, weights changed between
forward and backward, ``.to()``)."""
import pytest
import torch

from nn_cases import GRAD_KEYS, NNCase, build_layer, global_weights, inputs, step, world1_pg

from mxcomm.gemm import MXWeightCache, StaleWeightCacheError
from mxcomm.gemm.weights import BF16WeightCache
from mxcomm.nn import ExpertOptions, MoEConfig, grouped_swiglu


@pytest.fixture(scope="module", autouse=True)
def world1():
    yield from world1_pg()


CASES = [
    NNCase("bf16c_shared_aux", "bf16", tokens=(96,), shared_ffn_dim=64, aux_loss_coef=0.01, seed=51),
    NNCase("bf16c_sigmoid_norm_scale", "bf16", tokens=(70,), score_func="sigmoid", norm_topk_prob=True,
           route_scale=2.5, seed=52),
    NNCase("bf16c_top3_wide", "bf16", tokens=(128,), dim=128, ffn_dim=128, num_experts=4, topk=3,
           shared_ffn_dim=32, seed=53),
    NNCase("bf16c_zero_tokens", "bf16", tokens=(0,), shared_ffn_dim=32, seed=54),
]


def _pair(case, **kw):
    w = global_weights(case)
    return w, build_layer(case, w, **kw), build_layer(case, w, bf16_weight_cache=False, **kw)


def _assert_same(a: dict, b: dict) -> None:
    for key in ("y", "idx") + GRAD_KEYS:
        if a.get(key) is None and b.get(key) is None:
            continue
        assert torch.equal(a[key], b[key]), key
    assert a["aux"] == b["aux"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cached_layer_is_bit_identical_to_the_cast_per_call_layer(case):
    w, cached, plain = _pair(case)
    inp = inputs(case)
    a = step(cached, inp["xs"][0], inp["gs"][0])
    b = step(plain, inp["xs"][0], inp["gs"][0])
    _assert_same(a, b)
    if case.tokens[0]:
        assert bool(a["g_w13"].abs().sum() > 0) and bool(a["g_router_weight"].abs().sum() > 0)
    # the cached layer ran on caches (also built with zero tokens), the other on none
    want = {"w13", "w2"} | ({"shared_w13", "shared_w2"} if case.shared_ffn_dim else set())
    assert set(cached.caches()) == want and plain.caches() == {} and plain.cache_bytes() == 0
    assert all(isinstance(c, BF16WeightCache) for c in cached.caches().values())
    n = sum(p.numel() for name, p in cached.named_parameters() if name.split(".")[-1] in want)
    assert cached.cache_bytes() == 2 * n


def test_3d_bf16_input():
    case = NNCase("bf16c_3d", "bf16", shared_ffn_dim=32, seed=55)
    w, cached, plain = _pair(case)
    x = torch.randn(2, 5, case.dim, dtype=torch.bfloat16)
    outs = []
    for m in (cached, plain):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.float().square().sum().backward()
        outs.append((y.detach(), xi.grad, m.w13.grad.clone(), m.router.weight.grad.clone()))
    for u, v in zip(*outs):
        assert torch.equal(u, v)


def _train(moe, x, opt, steps):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = moe(x).float().square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("opt_kind", ["adamw_foreach", "adamw_fused", "sgd"])
def test_training_trajectory_equals_the_cast_per_call_layer(opt_kind):
    case = NNCase("bf16c_train", "bf16", tokens=(64,), shared_ffn_dim=32, aux_loss_coef=0.0, seed=56)
    w, cached, plain = _pair(case)
    x = inputs(case)["xs"][0]

    def make(m):
        if opt_kind == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.1)
        return torch.optim.AdamW(m.parameters(), lr=1e-2, fused=opt_kind == "adamw_fused")

    oc, op = make(cached), make(plain)
    cached.attach_optimizer(oc)
    before = cached.w13.detach().clone()
    lc, lp = _train(cached, x, oc, 3), _train(plain, x, op, 3)
    assert not torch.equal(before, cached.w13.detach()), "the steps did not change the weights"
    assert all(torch.equal(a, b) for a, b in zip(lc, lp))
    for (n, p), (_, q) in zip(cached.named_parameters(), plain.named_parameters()):
        assert torch.equal(p, q), n
    assert all(c.generation == 4 for c in cached.caches().values())  # built, then one refresh per step


def test_optimizer_step_without_refresh_raises_then_refresh_caches():
    case = NNCase("bf16c_stale", "bf16", tokens=(40,), shared_ffn_dim=32, seed=57)
    w, cached, plain = _pair(case)
    x = inputs(case)["xs"][0]
    oc, op = torch.optim.SGD(cached.parameters(), lr=0.1), torch.optim.SGD(plain.parameters(), lr=0.1)
    _train(cached, x, oc, 1)
    _train(plain, x, op, 1)  # the cast-per-call layer needs no refresh
    with pytest.raises(StaleWeightCacheError, match="BF16 weight cache of w13.*attach_optimizer"):
        cached(x)
    cached.refresh_caches()
    with torch.no_grad():
        assert torch.equal(cached(x), plain(x))


def test_auto_refresh_follows_the_weights():
    case = NNCase("bf16c_auto", "bf16", tokens=(40,), shared_ffn_dim=32, seed=58)
    w, cached, plain = _pair(case, cache_refresh="auto")
    x = inputs(case)["xs"][0]
    oc, op = torch.optim.SGD(cached.parameters(), lr=0.1), torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(2):
        _train(cached, x, oc, 1)
        _train(plain, x, op, 1)
    with torch.no_grad():
        assert torch.equal(cached(x), plain(x))
    assert all(c.generation == 3 for c in cached.caches().values())


def test_fused_optimizer_is_invisible_without_the_hook():
    """Fused AdamW does not bump the version counter: without attach_optimizer the cache cannot see the step
    (documented), with it the layer follows."""
    case = NNCase("bf16c_fused", "bf16", tokens=(40,), seed=59)
    w, cached, plain = _pair(case)
    x = inputs(case)["xs"][0]
    oc = torch.optim.AdamW(cached.parameters(), lr=1e-2, fused=True)
    op = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    _train(cached, x, oc, 1)
    _train(plain, x, op, 1)
    with torch.no_grad():
        assert not torch.equal(cached(x), plain(x))  # stale copy used: the documented limitation
    cached.refresh_caches()
    cached.attach_optimizer(oc)
    _train(cached, x, oc, 1)
    _train(plain, x, op, 1)
    with torch.no_grad():
        assert torch.equal(cached(x), plain(x))


def test_load_state_dict_and_load_global_weights_are_seen():
    case = NNCase("bf16c_load", "bf16", tokens=(40,), shared_ffn_dim=32, seed=60)
    w, cached, _ = _pair(case)
    x = inputs(case)["xs"][0]
    with torch.no_grad():
        cached(x)  # caches built
    other_case = NNCase("bf16c_load", "bf16", tokens=(40,), shared_ffn_dim=32, seed=61)
    other = build_layer(other_case, global_weights(other_case), bf16_weight_cache=False)
    cached.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(cached(x), other(x))
    cached.load_global_weights(**w)
    fresh = build_layer(case, w, bf16_weight_cache=False)
    with torch.no_grad():
        assert torch.equal(cached(x), fresh(x))
    # the version counter alone (no hook): a state dict copied into the parameters in place
    with torch.no_grad():
        for p, q in zip(cached.parameters(), other.parameters()):
            p.copy_(q)
    with pytest.raises(StaleWeightCacheError):
        cached(x)


def test_weights_changed_between_forward_and_backward_raise():
    case = NNCase("bf16c_fwbw", "bf16", tokens=(40,), seed=62)
    _, cached, _ = _pair(case)
    x = inputs(case)["xs"][0]
    y = cached(x)
    with torch.no_grad():
        cached.w2.add_(0.01)
    cached.refresh_caches()
    with pytest.raises(StaleWeightCacheError, match="between forward and backward"):
        y.float().sum().backward()


def test_dtype_conversions():
    case = NNCase("bf16c_to", "bf16", tokens=(40,), seed=63)
    _, cached, plain = _pair(case)
    x = inputs(case)["xs"][0]
    with torch.no_grad():
        cached(x)
    assert cached.cache_bytes() > 0
    cached.to(torch.bfloat16)
    plain.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(cached(xb), plain(xb))
    assert cached.caches() == {}  # bfloat16 masters: nothing to cast, no copy kept


def test_config_switch_and_grouped_swiglu_cache_types():
    with pytest.raises(ValueError, match="bf16_weight_cache"):
        MoEConfig(dim=64, ffn_dim=64, num_experts=4, topk=1, bf16_weight_cache="yes")
    assert MoEConfig(dim=64, ffn_dim=64, num_experts=4, topk=1).bf16_weight_cache is True
    # mxfp8 layers never build BF16 copies, whatever the switch says
    mx = NNCase("bf16c_mx", "mxfp8", tokens=(40,), seed=64)
    m = build_layer(mx, global_weights(mx))
    with torch.no_grad():
        m(inputs(mx)["xs"][0])
    assert all(isinstance(c, MXWeightCache) for c in m.caches().values()) and m.caches()
    w13 = torch.nn.Parameter(torch.randn(2, 64, 32) * 0.1)
    w2 = torch.nn.Parameter(torch.randn(2, 32, 32) * 0.1)
    a = torch.randn(8, 32, dtype=torch.bfloat16)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    b13, b2 = BF16WeightCache(w13), BF16WeightCache(w2)
    with pytest.raises(ValueError, match="MXWeightCache"):
        grouped_swiglu(a, offs, w13, w2, ExpertOptions(precision="mxfp8"), cache13=b13, cache2=b2)
    with pytest.raises(TypeError, match="BF16WeightCache"):
        grouped_swiglu(a, offs, w13, w2, ExpertOptions(precision="bf16"), cache13=MXWeightCache(w13), cache2=b2)
    assert torch.equal(grouped_swiglu(a, offs, w13, w2, ExpertOptions(precision="bf16"), cache13=b13, cache2=b2),
                       grouped_swiglu(a, offs, w13, w2, ExpertOptions(precision="bf16")))
