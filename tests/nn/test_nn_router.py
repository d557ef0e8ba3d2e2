"""Router: top-k selection and weights against an independent float64 computation, the load-balancing loss on
hand-computed examples, config validation."""
import pytest
import torch

from mxcomm.nn import MoEConfig, Router, RouterConfig, load_balancing_loss


def _router(H, E, k, seed, **kw):
    torch.manual_seed(seed)
    r = Router(H, E, k, RouterConfig(**kw))
    with torch.no_grad():
        r.weight.normal_(0, 0.3)
    return r


@pytest.mark.parametrize("score_func,norm,scale", [("softmax", None, 1.0), ("softmax", True, 1.0),
                                                   ("sigmoid", None, 2.5), ("sigmoid", False, 1.0)])
def test_topk_selection_and_weights(score_func, norm, scale):
    H, E, k, T = 64, 16, 4, 200
    r = _router(H, E, k, seed=3, score_func=score_func, norm_topk_prob=norm, route_scale=scale)
    x = torch.randn(T, H)
    out = r(x)
    assert out.topk_idx.shape == (T, k) and out.topk_idx.dtype == torch.int64
    assert out.topk_weights.shape == (T, k) and out.topk_weights.dtype == torch.float32
    # independent: full sort of float64 scores
    logits = x.double() @ r.weight.detach().double().t()
    s = torch.softmax(logits, -1) if score_func == "softmax" else torch.sigmoid(logits)
    order = torch.argsort(s, dim=-1, descending=True)
    assert torch.equal(torch.sort(out.topk_idx, 1).values, torch.sort(order[:, :k], 1).values)
    # chosen experts are distinct and are the k largest: every chosen score >= every unchosen score
    chosen = torch.gather(s, 1, out.topk_idx)
    mask = torch.ones_like(s, dtype=torch.bool).scatter_(1, out.topk_idx, False)
    assert bool((chosen.min(1).values >= s.masked_fill(~mask, -1).max(1).values).all())
    w = chosen
    if RouterConfig(score_func=score_func, norm_topk_prob=norm).normalize:
        w = w / w.sum(1, keepdim=True)
        assert torch.allclose(out.topk_weights.double().sum(1), torch.full((T,), scale, dtype=torch.float64))
    w = w * scale
    assert torch.allclose(out.topk_weights.double(), w, rtol=1e-5, atol=1e-7)
    assert torch.equal(out.tokens_per_expert, torch.bincount(out.topk_idx.reshape(-1), minlength=E))
    assert out.aux_loss is None


def test_router_gradient_matches_float64():
    H, E, k, T = 32, 8, 2, 64
    r = _router(H, E, k, seed=5, norm_topk_prob=True)
    x = torch.randn(T, H, requires_grad=True)
    g = torch.randn(T, k)
    out = r(x)
    (out.topk_weights * g).sum().backward()
    xd = x.detach().double().requires_grad_()
    wd = r.weight.detach().double().requires_grad_()
    s = torch.softmax(xd @ wd.t(), -1)
    ww = torch.gather(s, 1, out.topk_idx)
    ((ww / ww.sum(1, keepdim=True)) * g.double()).sum().backward()
    assert torch.allclose(x.grad.double(), xd.grad, rtol=1e-4, atol=1e-6)
    assert torch.allclose(r.weight.grad.double(), wd.grad, rtol=1e-4, atol=1e-6)


def test_load_balancing_loss_hand_examples():
    """Switch loss E * sum_e f_e P_e on examples worked by hand (E = 2, k = 1)."""
    probs = torch.tensor([[0.75, 0.25], [0.25, 0.75]])
    # balanced: f = [1/2, 1/2], P = [1/2, 1/2] -> 2 * (1/4 + 1/4) = 1
    assert float(load_balancing_loss(probs, torch.tensor([[0], [1]]))) == pytest.approx(1.0, abs=1e-7)
    # both tokens to expert 0 with the same probabilities: f = [1, 0], P = [3/4, 1/4] -> 2 * 3/4 = 1.5
    same = torch.tensor([[0.75, 0.25], [0.75, 0.25]])
    assert float(load_balancing_loss(same, torch.tensor([[0], [0]]))) == pytest.approx(1.5, abs=1e-7)
    # E = 4, k = 2, T = 2: idx {0,1}, {0,2} -> f = [2/4, 1/4, 1/4, 0]; P = mean rows = [0.4, 0.3, 0.2, 0.1]
    # -> 4 * (0.2 + 0.075 + 0.05 + 0) = 1.3
    p4 = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.3, 0.3, 0.3, 0.1]])
    assert float(load_balancing_loss(p4, torch.tensor([[0, 1], [0, 2]]))) == pytest.approx(1.3, abs=1e-6)
    # sigmoid scores are normalized per token first: [0.6, 0.2] -> [0.75, 0.25]; [0.2, 0.6] -> [0.25, 0.75]
    sig = torch.tensor([[0.6, 0.2], [0.2, 0.6]])
    assert float(load_balancing_loss(sig, torch.tensor([[0], [0]]), "sigmoid")) == pytest.approx(1.0, abs=1e-6)
    # gradient flows through P only: d/dP_e = E * f_e / T per token
    p = probs.clone().requires_grad_()
    load_balancing_loss(p, torch.tensor([[0], [0]])).backward()
    assert torch.allclose(p.grad, torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    # no tokens: 0, still differentiable
    z = torch.zeros(0, 2, requires_grad=True)
    lz = load_balancing_loss(z, torch.zeros(0, 1, dtype=torch.int64))
    assert float(lz.detach()) == 0.0 and lz.requires_grad


def test_router_aux_loss_uses_coefficient():
    r = _router(32, 8, 2, seed=1, aux_loss_coef=0.05)
    x = torch.randn(40, 32)
    out = r(x)
    want = 0.05 * load_balancing_loss(out.scores, out.topk_idx)
    assert float(out.aux_loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    out.aux_loss.backward()
    assert r.weight.grad is not None and bool(r.weight.grad.abs().sum() > 0)


def test_router_empty_input():
    r = _router(32, 8, 2, seed=1, aux_loss_coef=0.01)
    out = r(torch.zeros(0, 32))
    assert out.topk_idx.shape == (0, 2) and out.topk_weights.shape == (0, 2)
    assert float(out.aux_loss.detach()) == 0.0


@pytest.mark.parametrize("kw,msg", [
    (dict(score_func="relu"), "score_func"), (dict(route_scale=0.0), "route_scale"),
    (dict(aux_loss_coef=-1.0), "aux_loss_coef"), (dict(norm_topk_prob=1), "norm_topk_prob"),
])
def test_router_config_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        RouterConfig(**kw)


@pytest.mark.parametrize("kw,msg", [
    (dict(dim=48), "dim"), (dict(ffn_dim=40), "ffn_dim"), (dict(topk=9), "topk"),
    (dict(precision="fp8"), "precision"), (dict(shared_ffn_dim=16), "shared_ffn_dim"),
    (dict(swiglu_impl="fast"), "swiglu_impl"), (dict(cache_refresh="never"), "cache_refresh"),
    (dict(gemm_backend="cublas"), "gemm_backend"), (dict(align=64), "align"),
])
def test_moe_config_errors(kw, msg):
    base = dict(dim=64, ffn_dim=64, num_experts=8, topk=2)
    base.update(kw)
    with pytest.raises(ValueError, match=msg):
        MoEConfig(**base)


def test_router_input_errors():
    r = Router(32, 4, 2)
    with pytest.raises(ValueError, match="shape"):
        r(torch.zeros(3, 16))
    with pytest.raises(TypeError, match="floating"):
        r(torch.zeros(3, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="topk"):
        Router(32, 4, 5)
    assert RouterConfig(score_func="sigmoid").normalize is True and RouterConfig().normalize is False
