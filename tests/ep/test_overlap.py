"""``stream=`` on EPGroup.dispatch / combine (mxcomm.ep.streams): a call on a communication stream, with its event.

CPU (reference backend, gloo worlds of 1 and 2): a bad ``stream`` (not a torch.cuda.Stream; a stream for CPU tensors:
"streams are CUDA") is refused on every rank before anything is sent, and the group still works after it; calls with
``stream=None`` give exactly what calls without the argument give (outputs, gradients, result types); under
``torch.compile`` a call with ``stream=`` compiles nothing (fullgraph raises); the tensors a result holds are found
for ``record_stream``.

GPU (nvshmem backend, marked ``nvshmem``; on a GPU machine, after ``source bench/gpu/env.sh``):
``python -m pytest -m nvshmem tests/ep/test_overlap.py``. Forward and backward on a side stream are bit-identical to
the same calls on the current stream, with sleeps that expose a missing wait (the call waits for the caller's
stream, the event comes after the last kernel, the backward's gradients reach the current stream); inputs dropped
right after the call and outputs dropped while the caller still reads them are not reused by the caching allocator
too early; bad streams and a compiled-op handle are refused.
"""
from __future__ import annotations

import pytest
import torch

from _dist import expect_error as _expect, run_world


def _fake_stream():
    """A ``torch.cuda.Stream`` instance on a CPU-only torch build (its base class is a plain Python class there), or
    None where one cannot be made without a GPU."""
    try:
        return object.__new__(torch.cuda.Stream)
    except TypeError:
        return None


def _inputs(rank: int, T: int, H: int, E: int, k: int, device="cpu"):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k]
    if T > 1:
        idx[T - 1, k - 1] = -1  # a dropped slot
    w = torch.rand(T, k, generator=g)
    p = 1.0 + torch.rand(H, generator=g)  # the "expert": a per-column scale
    gy = torch.randn(T, H, generator=g)
    return [t.to(device) for t in (x, idx, w, p, gy)]


def _step(group, inp, stream=None, grad_format="dense", sleep_cycles=0):
    """Dispatch -> expert (``h * p``) -> combine -> loss backward; every output and gradient, cloned on the current
    stream (never after a device sync: what the current stream sees is what is compared). ``stream``: the calls run
    on it; ``sleep_cycles``: a sleep on the current stream before the inputs are made, and on ``stream`` before each
    call and before the backward (a missing wait then reads unfinished data)."""
    x, idx, w, p, gy = inp

    def nap(s=None):
        if sleep_cycles:
            with torch.cuda.stream(s or torch.cuda.current_stream()):
                torch.cuda._sleep(sleep_cycles)

    nap()
    xl = x.clone().requires_grad_()  # written on the current stream after its sleep
    wl = w.clone().requires_grad_()
    pl = p.clone().requires_grad_()
    if stream is not None:
        nap(stream)
    on = {} if stream is None else {"stream": stream}  # stream=None is not passed: calls as before the argument
    d = group.dispatch(xl, idx, wl, **on)
    if stream is not None:
        assert d.event is not None
        d.event.wait()
    h = d.dense(torch.float32)
    eo = (h * pl).to(torch.bfloat16)
    if stream is not None:
        nap(stream)
    c = group.combine(eo, d.handle, grad_format=grad_format, **on)
    y = c.wait() if stream is not None else c
    if stream is not None:
        nap(stream)
    (y.float() * gy).sum().backward()
    mx = d.mx
    out = {"y": y.detach().clone(), "gx": xl.grad.clone(), "gw": wl.grad.clone(), "gp": pl.grad.clone(),
           "offs": d.offs.clone(), "counts": d.counts.clone()}
    if mx is not None:
        out["payload"] = mx.qdata.view(torch.uint8).clone()
        out["scales"] = mx.scales.clone()
    else:
        out["payload"] = d.x.detach().clone()
    if y.is_cuda:  # the clones above were issued before any sync; the next step starts from an idle device
        torch.cuda.synchronize()
    return out


def _diff(a: dict, b: dict) -> list:
    return [k for k in a if k not in b or a[k].shape != b[k].shape or not torch.equal(a[k].cpu(), b[k].cpu())]


# --------------------------------------------------------------------------------------------------------------------
# CPU: the reference backend
# --------------------------------------------------------------------------------------------------------------------
def cpu_worker(rank: int, world: int) -> dict:
    from mxcomm.ep import EPConfig, EPGroup
    from mxcomm.ep.streams import Combined, EPEvent, record, tensors_of

    out = {}
    H, k, T = 64, 2, 6
    cfg = EPConfig(num_experts=4 * world, hidden=H, topk=k, max_tokens_per_rank=8)
    group = EPGroup(cfg)
    inp = _inputs(rank, T, H, cfg.num_experts, k)
    x, idx, w = inp[:3]
    fake = _fake_stream()
    out["fake_stream"] = fake is not None

    # refused before any work, on every rank; the group then still works
    _expect(out, "dispatch_not_a_stream", TypeError, "torch.cuda.Stream", lambda: group.dispatch(x, idx, w, stream="s"))
    if fake is not None:
        _expect(out, "dispatch_cpu_stream", ValueError, "streams are CUDA",
                lambda: group.dispatch(x, idx, w, stream=fake))
    d = group.dispatch(x, idx, w)
    eo = d.dense()
    _expect(out, "combine_not_a_stream", TypeError, "torch.cuda.Stream", lambda: group.combine(eo, d.handle, stream=1))
    if fake is not None:
        _expect(out, "combine_cpu_stream", ValueError, "streams are CUDA",
                lambda: group.combine(eo, d.handle, stream=fake))
    y = group.combine(eo, d.handle)
    out["after_refusals_finite"] = bool(torch.isfinite(y.float()).all()) and y.shape == (T, H)

    # stream=None: exactly the calls without the argument (forward, backward, result types)
    class Group:  # the same group, with stream=None passed explicitly
        def dispatch(self, *a, **kw):
            d = group.dispatch(*a, stream=None, **kw)
            out["none_event"] = d.event is None
            return d

        def combine(self, *a, **kw):
            y = group.combine(*a, stream=None, **kw)
            out["none_returns_tensor"] = type(y) is torch.Tensor and not isinstance(y, Combined)
            return y

    base = _step(group, inp)
    explicit = _step(Group(), inp)
    out["stream_none_differs"] = _diff(base, explicit)

    # the tensors of a result, for record_stream: payload, scales, offsets, the plan; CPU tensors are skipped
    ids = {id(t) for t in tensors_of(d)}
    mx = d.mx
    want = [d.offs, d.counts, d.handle.topk_idx] + [getattr(d.handle.plan, f) for f in ("offs", "send_pos")]
    want += [mx.qdata, mx.scales] if mx is not None else [d.x]
    out["tensors_of_finds_all"] = all(id(t) in ids for t in want)
    record(d, None)  # CPU tensors only: nothing to mark (would raise if it tried)
    out["value_types_frozen"] = all(getattr(t, "__dataclass_params__").frozen for t in (EPEvent, Combined))

    if world == 1:  # torch.compile: a call with stream= compiles nothing
        def f(x, idx, w):
            return group.dispatch(x, idx, w, stream=fake if fake is not None else "s").x

        try:
            torch.compile(f, backend="aot_eager", fullgraph=True)(x, idx, w)
            out["compile_fullgraph"] = "no error"
        except Exception as e:  # noqa: BLE001 - torch.compile's own error type
            out["compile_fullgraph"] = "raised" if "compiled" in str(e) or "stream" in str(e) else f"message: {e}"
        # without fullgraph the frame runs eagerly, where the eager refusal is what the caller sees
        exc, needle = (ValueError, "streams are CUDA") if fake is not None else (TypeError, "torch.cuda.Stream")
        _expect(out, "compile_eager_fallback", exc, needle, lambda: torch.compile(f, backend="aot_eager")(x, idx, w))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_stream_argument_on_the_reference_backend(world):
    res = run_world(world, cpu_worker, timeout=240)
    for r, got in enumerate(res):
        assert got["fake_stream"] or not got.get("dispatch_cpu_stream"), got
        for key in ("dispatch_not_a_stream", "combine_not_a_stream") + (
                ("dispatch_cpu_stream", "combine_cpu_stream") if got["fake_stream"] else ()):
            assert got[key] == "ok", (r, key, got[key])
        assert got["after_refusals_finite"], got
        assert got["stream_none_differs"] == [], got
        assert got["none_event"] and got["none_returns_tensor"], got
        assert got["tensors_of_finds_all"] and got["value_types_frozen"], got
        if world == 1:
            assert got["compile_fullgraph"] == "raised", got["compile_fullgraph"]
            assert got["compile_eager_fallback"] == "ok", got["compile_eager_fallback"]


# --------------------------------------------------------------------------------------------------------------------
# GPU: the nvshmem backend (one rank, and two ranks sharing one GPU)
# --------------------------------------------------------------------------------------------------------------------
SLEEP_CYCLES = 20_000_000  # ~10 ms at 2 GHz: far longer than the host needs to issue a call


def gpu_worker(rank: int, world: int) -> dict:
    from _dist import bind_rank_gpu

    from mxcomm import transport as tp
    from mxcomm.ep import EPConfig, EPGroup, compiled

    dev = bind_rank_gpu(rank)
    comm = torch.cuda.Stream()
    out = {"failures": []}
    fails = out["failures"]
    H, k, T = 256, 4, 96
    for precision in ("mxfp8", "bf16"):
        cfg = EPConfig(num_experts=8 * world, hidden=H, topk=k, max_tokens_per_rank=128, precision=precision,
                       backend="nvshmem", num_sms=8)
        group = EPGroup(cfg)
        inp = _inputs(rank, T, H, cfg.num_experts, k, dev)
        formats = ("dense", "mx") if precision == "mxfp8" else ("dense",)
        for grad_format in formats:
            tag = f"{precision}/{grad_format}[rank {rank}]"
            ref = _step(group, inp, grad_format=grad_format)
            side = _step(group, inp, stream=comm, grad_format=grad_format, sleep_cycles=SLEEP_CYCLES)
            bad = _diff(ref, side)
            if bad:
                fails.append(f"{tag}: side-stream results differ from the current stream's: {bad}")
            again = _step(group, inp, grad_format=grad_format)  # the group still agrees with itself afterwards
            if _diff(ref, again):
                fails.append(f"{tag}: current-stream results changed after the side-stream step: {_diff(ref, again)}")
            out.setdefault("steps", 0)
            out["steps"] += 1
        x, idx, w = inp[:3]
        with torch.no_grad():
            d = group.dispatch(x, idx, w)
            eo = (d.dense(torch.float32) * inp[3]).to(torch.bfloat16)
            y_ref = group.combine(eo, d.handle)
            torch.cuda.synchronize()
            if world == 1:  # one rank: combine does not sync the host, so its event is pending behind the sleep
                with torch.cuda.stream(comm):
                    torch.cuda._sleep(SLEEP_CYCLES)
                c = group.combine(eo, d.handle, stream=comm)
                if c.event.query():
                    fails.append(f"{precision}: the event completed while its stream still slept")
                c.event.synchronize()
                if not c.event.query() or not torch.equal(c.y, y_ref):
                    fails.append(f"{precision}: after event.synchronize() the combine is not done or differs")
                # an input dropped right after the call: its memory must not be handed out while the stream reads it
                with torch.cuda.stream(comm):
                    torch.cuda._sleep(SLEEP_CYCLES)
                tmp = eo.clone()
                c = group.combine(tmp, d.handle, stream=comm)
                del tmp
                junk = torch.full_like(eo, 1000.0)  # noqa: F841 - on the current stream, at once
                if not torch.equal(c.wait(), y_ref):
                    fails.append(f"{precision}: an input freed after the call was reused before the combine read it")
                # an output dropped while the caller's stream still reads it
                c = group.combine(eo, d.handle, stream=comm)
                y = c.wait()
                torch.cuda._sleep(SLEEP_CYCLES)
                z = y.clone()  # on the current stream, after its sleep
                del y, c
                with torch.cuda.stream(comm):
                    junk = torch.full_like(y_ref, 7.0)  # noqa: F841 - on the communication stream, at once
                if not torch.equal(z, y_ref):
                    fails.append(f"{precision}: an output freed on the host was reused before the caller read it")
                del junk
        # refusals on CUDA tensors
        res = {}
        _expect(res, "not_a_stream", TypeError, "torch.cuda.Stream", lambda: group.dispatch(x, idx, w, stream=object()))
        if torch.cuda.device_count() > 1:
            other = torch.cuda.Stream(device=(torch.cuda.current_device() + 1) % torch.cuda.device_count())
            _expect(res, "other_device", ValueError, "stream is on", lambda: group.dispatch(x, idx, w, stream=other))
        for name, v in res.items():
            if v != "ok":
                fails.append(f"{precision} refusal {name}: {v}")
        if precision == "mxfp8":  # a handle of the custom ops (compiled path, run eagerly) is refused with stream=
            g2 = EPGroup(EPConfig(num_experts=8 * world, hidden=H, topk=k, max_tokens_per_rank=128,
                                  precision=precision, backend="nvshmem", exact_sizes=False))
            d2 = compiled.dispatch(g2, x, idx, w, None)
            _expect(res, "op_handle", ValueError, "custom op", lambda: g2.combine(d2.dense(), d2.handle, stream=comm))
            if res["op_handle"] != "ok":
                fails.append(f"custom-op handle with stream=: {res['op_handle']}")
            g2.combine(d2.dense(), d2.handle)  # every rank ran one collective dispatch + combine on g2
        torch.cuda.synchronize()
    tp.finalize()
    return out


def _nvshmem_env():
    from mxcomm.transport import launcher_env

    return launcher_env(2 << 30)


@pytest.mark.nvshmem
@pytest.mark.parametrize("world", [1, 2])
def test_side_stream_is_bit_identical_and_ordered_nvshmem(world):
    res = run_world(world, gpu_worker, env=_nvshmem_env(), timeout=900)
    fails = [f for r in res for f in r["failures"]]
    assert not fails, "\n".join(fails)
    assert all(r["steps"] == 3 for r in res), res
