"""The drop-in MoE layer's own speed: ``mxcomm.nn.MoE`` against a plain-torch MoE of the same math, forward +
backward, eager; one process (EP = 1) or ``--ranks N`` processes (EP = N).

    python bench/bench_moe_layer.py [--device cuda] [--dim 4096 --ffn 2048 --experts 64 --topk 8 --tokens 8192]
    python bench/bench_moe_layer.py --ranks 4 [...]       # 4 ranks on one GPU: needs CUDA MPS (see below)

Implementations (same router, same SwiGLU experts, same weighted sum; at EP = 1 the same weights):

* ``torch_bf16`` (plain torch, BF16 weights): router top-k, argsort by expert, gather, two ``torch._grouped_mm``,
  SwiGLU, weighted ``index_add_`` back to the tokens; the expert weights are BF16 parameters;
* ``torch_fp32`` (plain torch, fp32 masters): the same with fp32 master weights cast to BF16 in every step (what
  mixed-precision training does without a weight cache);
* ``mxcomm_bf16``: ``mxcomm.nn.MoE(precision="bf16", bf16_weight_cache=False)``: fp32 masters cast to BF16 in
  every forward and again in every backward;
* ``mxcomm_bf16_cached``: ``precision="bf16"`` with its BF16 weight cache (the layer's default): the GEMMs read a
  BF16 copy made once per optimizer step (``refresh_us`` below), bit-identical results;
* ``mxcomm_mxfp8``: ``precision="mxfp8"``, GEMMs on cached MXFP8 weights (on Hopper the GEMMs are emulated:
  dequantized to BF16).

Each step: forward, ``loss = y.float().square().mean()``, backward (no optimizer step); median over ``--iters``
after ``--warmup`` (CUDA events on a GPU, ``perf_counter`` on the CPU). The cached variants' weight caches are
built once; a training step adds one cache refresh after ``optimizer.step()``, timed separately as
``refresh_median_us`` (``moe.refresh_caches()``); ``step_plus_refresh_us`` (and the ratios
``x_mxcomm_bf16_with_refresh``) add it to the step, the comparison that holds for training.

``--ranks N`` (N > 1): the script starts N rank processes of itself (torch.distributed over gloo, bounded by
``--timeout``), each running ``mxcomm.nn.MoE`` with EP = N (``--experts`` global, E/N per rank, ``--tokens`` per
rank). On the CPU the EP backend is the reference (``torch``); on a GPU it is ``nvshmem`` with every rank on the
first visible GPU, which needs a CUDA MPS daemon (``mxcomm_mps_start N`` from bench/gpu/env.sh, or ``--mps start``):
without one the script refuses. A step's time is the slowest rank's (max over ranks per iteration), then the
median. A plain-torch MoE per rank, holding E/N experts, would not compute the layer's math, so with several
ranks only mxcomm's implementations are compared with each other (ratios against ``mxcomm_bf16``). The plain-torch
MoE at EP = 1 on the world's N x ``--tokens`` tokens with all E experts (the same total work on the same device, in
one process of its own with all SMs, no communication) is reported as context only, without ratios.

Writes a JSON (machine, versions, config, medians, ratios of the same run) to ``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
TORCH_IMPLS = ("torch_bf16", "torch_fp32")
MXCOMM_IMPLS = ("mxcomm_bf16", "mxcomm_bf16_cached", "mxcomm_mxfp8")
ALL_IMPLS = TORCH_IMPLS + MXCOMM_IMPLS
#: impl -> (precision, bf16_weight_cache)
MXCOMM_CFG = {"mxcomm_bf16": ("bf16", False), "mxcomm_bf16_cached": ("bf16", True), "mxcomm_mxfp8": ("mxfp8", True)}


def plain_moe_step(x, router_w, w13, w2, topk: int, cast: bool):
    """One forward + backward of the plain-torch MoE. ``x [T, H]``; ``router_w [E, H]``; ``w13 [E, H, 2F]`` /
    ``w2 [E, F, H]`` (``torch._grouped_mm`` layout: ``b[g]`` is ``[K, N]``), BF16 parameters or fp32 masters cast
    per step (``cast``)."""
    T, H = x.shape
    E = w13.shape[0]
    logits = x.float() @ router_w.float().t()
    probs = torch.softmax(logits, dim=-1)
    w, idx = torch.topk(probs, topk, dim=-1)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // topk
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    a = x.to(torch.bfloat16)[tok]
    b13 = w13.to(torch.bfloat16) if cast else w13
    b2 = w2.to(torch.bfloat16) if cast else w2
    gu = torch._grouped_mm(a, b13, offs=offs)
    g, u = gu.chunk(2, dim=-1)
    h = (F.silu(g.float()) * u.float()).to(torch.bfloat16)
    out = torch._grouped_mm(h, b2, offs=offs)
    wsel = w.reshape(-1)[order].unsqueeze(1)
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device).index_add_(0, tok, out.float() * wsel)
    loss = y.square().mean()
    loss.backward()
    return loss


def _timer(device: torch.device):
    """``run(fn) -> microseconds`` (CUDA events on a GPU, perf_counter on the CPU)."""
    if device.type == "cuda":
        def run(fn):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) * 1e3
    else:
        def run(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
    return run


def _moe_config(impl: str, D: int, Fd: int, E: int, k: int, T: int, gpu: bool):
    from mxcomm.nn import MoEConfig, RouterConfig

    prec, cache = MXCOMM_CFG[impl]
    return MoEConfig(dim=D, ffn_dim=Fd, num_experts=E, topk=k, precision=prec, bf16_weight_cache=cache,
                     max_tokens_per_rank=T, router=RouterConfig(score_func="softmax"),
                     ep_backend="nvshmem" if gpu else "torch")


def _meta() -> dict:
    from mxcomm.bench.env_info import machine, relevant_env, versions

    return dict(machine=machine(), versions=versions(), env=relevant_env())


def _ratios(medians: dict, base: str) -> dict:
    b = medians.get(base)
    return {n: (b / t if b and t else None) for n, t in medians.items()}


def _with_refresh(results: dict) -> dict:
    """Per impl: step median plus one cache refresh median (what a training step with ``optimizer.step()`` and the
    refresh hook costs beyond the optimizer itself); the step median alone for impls without caches. Also stored
    in each result as ``step_plus_refresh_us``."""
    out = {}
    for n, r in results.items():
        out[n] = r["median_us"] + r.get("refresh_median_us", 0.0)
        r["step_plus_refresh_us"] = out[n]
    return out


def _write(report: dict, out: str) -> None:
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(report, indent=1, default=str))
    print(f"JSON: {p}")


# ------------------------------------------------------------------------------ one process ----
def run_single(a, dims: dict) -> int:
    """EP = 1 in this process: every implementation, ratios against torch_bf16 of the same run."""
    dev = torch.device(a.device)
    gpu = dev.type == "cuda"
    D, Fd, E, k, T, iters = (dims[n] for n in ("dim", "ffn", "experts", "topk", "tokens", "iters"))
    impls = a.impls.split(",")
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(T, D, generator=g).to(dev)
    router_w = (torch.randn(E, D, generator=g) * 0.02).to(dev)
    w13_t = (torch.randn(E, D, 2 * Fd, generator=g) * 0.02).to(dev)
    w2_t = (torch.randn(E, Fd, D, generator=g) * 0.02).to(dev)
    timer = _timer(dev)
    results = {}

    def samples_of(fn, n):
        for _ in range(a.warmup):
            fn()
        return [timer(fn) for _ in range(n)]

    def record(name, samples, **extra):
        results[name] = {"median_us": statistics.median(samples), "samples_us": samples, **extra}
        more = "".join(f"  {k}={v:.1f}" for k, v in extra.items() if isinstance(v, float))
        print(f"{name:22s} {statistics.median(samples):12.1f} us{more}", flush=True)

    for cast, name in ((False, "torch_bf16"), (True, "torch_fp32")):
        if name not in impls:
            continue
        dt = torch.float32 if cast else torch.bfloat16
        p13 = w13_t.to(dt).requires_grad_()
        p2 = w2_t.to(dt).requires_grad_()
        pr = router_w.clone().requires_grad_()
        record(name, samples_of(lambda: plain_moe_step(x, pr, p13, p2, k, cast), iters))
        del p13, p2, pr
    mx_impls = [i for i in MXCOMM_IMPLS if i in impls]
    if mx_impls:
        from mxcomm.nn import MoE, init_single_process, make_ep_group

        init_single_process()
        groups = {}
        for name in mx_impls:
            cfg = _moe_config(name, D, Fd, E, k, T, gpu)
            if cfg.precision not in groups:  # one EPGroup per precision, shared by the layers (as in a model)
                groups[cfg.precision] = make_ep_group(cfg)
            moe = MoE(cfg, ep_group=groups[cfg.precision], device=dev)
            moe.load_global_weights(router=router_w, w13=w13_t.transpose(1, 2), w2=w2_t.transpose(1, 2))

            def step(moe=moe):
                moe(x).float().square().mean().backward()

            s = samples_of(step, iters)
            extra = {"cache_bytes": moe.cache_bytes()}
            if moe.caches():
                rs = samples_of(moe.refresh_caches, iters)
                extra["refresh_median_us"] = statistics.median(rs)
                extra["refresh_samples_us"] = rs
            record(name, s, **extra)
            del moe, step
            if gpu:
                torch.cuda.empty_cache()
    medians = {n: r["median_us"] for n, r in results.items()}
    x_torch = _ratios(medians, "torch_bf16")
    for n, r in results.items():
        r["x_torch_bf16"] = x_torch[n]
    with_refresh = _with_refresh(results)
    report = dict(
        benchmark="moe_layer", device=str(dev), gpu=torch.cuda.get_device_name(dev) if gpu else None,
        **_meta(),
        config=dict(dim=D, ffn=Fd, experts=E, topk=k, tokens=T, iters=iters, warmup=a.warmup, ep=1,
                    ep_backend="nvshmem" if gpu else "torch"),
        timing=("forward + backward of one step, eager, median; x_torch_bf16 = torch_bf16 time / this time; "
                "refresh_median_us = one refresh of the layer's weight caches (once per optimizer step in "
                "training, not part of the step time); step_plus_refresh_us = step median + refresh median; "
                "x_mxcomm_bf16_with_refresh compares those; cache_bytes = persistent cache memory"),
        medians_us=medians,
        ratios=dict(x_torch_bf16=x_torch, x_mxcomm_bf16=_ratios(medians, "mxcomm_bf16"),
                    x_mxcomm_bf16_with_refresh=_ratios(with_refresh, "mxcomm_bf16")),
        results=results,
    )
    _write(report, a.out)
    return 0


# ------------------------------------------------------------------------------ several ranks: a rank ----
def run_rank(a, dims: dict) -> int:
    """Body of one rank process of ``--ranks N`` (env RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)."""
    import torch.distributed as dist

    from mxcomm.bench.launcher import watch_parent
    from mxcomm.nn import MoE, make_ep_group

    watch_parent()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpu = torch.device(a.device).type == "cuda"
    if gpu:
        torch.cuda.set_device(0)  # every rank on the first visible GPU
        dev = torch.device("cuda", 0)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=a.pg_timeout))
    D, Fd, E, k, T, iters = (dims[n] for n in ("dim", "ffn", "experts", "topk", "tokens", "iters"))
    impls = [i for i in MXCOMM_IMPLS if i in a.impls.split(",")]
    timer = _timer(dev)

    def sync():
        if gpu:
            torch.cuda.synchronize()
        dist.barrier()

    def samples_of(fn, n):
        for _ in range(a.warmup):
            fn()
        out = []
        for _ in range(n):
            sync()  # every rank starts the step together
            out.append(timer(fn))
        return out

    used_nvshmem = False
    groups, mine = {}, {}
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        router_w = (torch.randn(E, D, generator=g) * 0.02).to(dev)  # the same on every rank
        x = torch.randn(T, D, generator=torch.Generator(device="cpu").manual_seed(100 + rank)).to(dev)
        for name in impls:
            cfg = _moe_config(name, D, Fd, E, k, T, gpu)
            if cfg.precision not in groups:
                groups[cfg.precision] = make_ep_group(cfg)
                used_nvshmem = used_nvshmem or cfg.ep_backend == "nvshmem"
            moe = MoE(cfg, ep_group=groups[cfg.precision], device=dev)
            gw = torch.Generator(device=dev).manual_seed(1000 + rank)  # this rank's experts, the same per impl
            with torch.no_grad():
                moe.router.weight.copy_(router_w)
                moe.w13.copy_(torch.randn(moe.w13.shape, generator=gw, device=dev) * 0.02)
                moe.w2.copy_(torch.randn(moe.w2.shape, generator=gw, device=dev) * 0.02)

            def step(moe=moe):
                moe(x).float().square().mean().backward()

            res = {"samples_us": samples_of(step, iters), "cache_bytes": moe.cache_bytes(),
                   "local_experts": [moe.local_experts.start, moe.local_experts.stop]}
            if moe.caches():
                res["refresh_samples_us"] = samples_of(moe.refresh_caches, iters)
            mine[name] = res
            del moe, step
            if gpu:
                torch.cuda.empty_cache()
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            out = dict(per_rank=everyone, meta=_meta(), world=world)
            tmp = a.rank_result + ".tmp"
            with open(tmp, "w") as f:
                json.dump(out, f, default=str)
            os.replace(tmp, a.rank_result)
        dist.barrier()
    finally:
        groups.clear()  # the EP groups (and their symmetric buffers) go before NVSHMEM does
        if used_nvshmem:
            import gc

            from mxcomm import transport

            gc.collect()
            if gpu:
                torch.cuda.synchronize()
            if transport.is_initialized():
                transport.finalize()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------ several ranks: the parent ----
def _dim_args(a, dims: dict) -> list:
    return ["--device", a.device, "--dim", str(dims["dim"]), "--ffn", str(dims["ffn"]), "--experts",
            str(dims["experts"]), "--topk", str(dims["topk"]), "--tokens", str(dims["tokens"]), "--iters",
            str(dims["iters"]), "--warmup", str(a.warmup)]


def _heap_bytes(dims: dict, impls: list, ranks: int) -> int:
    """Symmetric-heap bytes one rank allocates: one EPGroup per precision used."""
    from mxcomm.ep.plan import buffer_sizes

    precs = sorted({MXCOMM_CFG[i][0] for i in impls})
    cfgs = [_moe_config(next(i for i in impls if MXCOMM_CFG[i][0] == p), dims["dim"], dims["ffn"], dims["experts"],
                        dims["topk"], dims["tokens"], True) for p in precs]
    return sum(buffer_sizes(c.ep_config(), ranks).total for c in cfgs)


def run_ranks(a, dims: dict) -> int:
    """``--ranks N``: start N rank processes of this script, then the plain-torch EP = 1 context run; merge."""
    from mxcomm.bench.launcher import free_port

    N = a.ranks
    gpu = torch.device(a.device).type == "cuda"
    E = dims["experts"]
    if E % N:
        print(f"bench_moe_layer: --experts {E} is not a multiple of --ranks {N}", file=sys.stderr)
        return 2
    impls = [i for i in MXCOMM_IMPLS if i in a.impls.split(",")]
    if not impls:
        print(f"bench_moe_layer: --ranks {N} measures mxcomm only; --impls needs one of {MXCOMM_IMPLS}",
              file=sys.stderr)
        return 2
    daemon, mps_env, mps = None, {}, None
    if gpu:
        from mxcomm.bench.mps import MpsDaemon, MpsError, mps_status

        st = mps_status()
        if st.active:
            mps = dict(state="running", pipe_dir=st.pipe_dir)
        elif a.mps == "start":
            try:
                daemon = MpsDaemon(N).__enter__()
            except MpsError as e:
                print(f"bench_moe_layer: {e}", file=sys.stderr)
                return 2
            mps_env = dict(daemon.client_env)
            mps = dict(state="started by bench_moe_layer for this run", **mps_env)
        else:
            print(f"bench_moe_layer: --ranks {N} puts {N} ranks on one GPU: they must run under CUDA MPS (without it "
                  "they time-slice the GPU and the times measure nothing), and no MPS daemon answers "
                  f"({st.detail}). Start one (`source bench/gpu/env.sh; mxcomm_mps_start {N}`, then "
                  "`mxcomm_mps_stop` afterwards) or pass --mps start.", file=sys.stderr)
            return 2
    t_end = time.monotonic() + a.timeout
    try:
        with tempfile.TemporaryDirectory(prefix="mxcomm-moe-bench-") as work:
            result_path = os.path.join(work, "ranks.json")
            cmd = [sys.executable, str(Path(__file__).resolve())] + _dim_args(a, dims) + [
                "--impls", ",".join(impls), "--ranks", str(N), "--pg-timeout", str(a.pg_timeout),
                "--_rank-result", result_path]
            plain = dict(os.environ)
            plain["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([plain["PYTHONPATH"]] if plain.get("PYTHONPATH")
                                                                  else []))
            base = dict(plain, MXCOMM_BENCH_PARENT_PID=str(os.getpid()), PYTHONUNBUFFERED="1",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(N))
            if gpu:
                from mxcomm.transport import launcher_env

                base.pop("TRITON_INTERPRET", None)
                base.update(launcher_env(_heap_bytes(dims, impls, N)))
            else:
                base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // N)))
            base.update(mps_env)
            from mxcomm.bench.launcher import kill_ranks

            procs, logs = [], {}
            try:
                for r in range(N):
                    env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
                    logs[r] = os.path.join(work, f"rank{r}.log")
                    with open(logs[r], "w") as out:
                        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                      start_new_session=True))
                first_fail, timed_out = None, False
                while any(p.poll() is None for p in procs):
                    now = time.monotonic()
                    if first_fail is None and any(p.poll() not in (None, 0) for p in procs):
                        first_fail = now  # the others may wait in a collective: a moment, then stop them
                    if now > t_end:
                        timed_out = True
                        break
                    if first_fail is not None and now - first_fail > 20:
                        break
                    time.sleep(0.1)
            finally:
                kill_ranks(procs)
            codes = [p.returncode for p in procs]
            if timed_out or any(codes) or not os.path.exists(result_path):
                why = f"timed out after {a.timeout} s" if timed_out else f"rank exit codes {codes}"
                tails = "".join(f"\n--- rank {r} ---\n{Path(p).read_text(errors='replace')[-3000:]}"
                                for r, p in logs.items())
                print(f"bench_moe_layer: the {N}-rank run failed ({why}){tails}", file=sys.stderr)
                return 1
            ranks = json.loads(Path(result_path).read_text())
            print(Path(logs[0]).read_text(errors="replace"), end="")
            context = None
            if not a.no_context:
                ctx_env = dict(plain, **mps_env, PYTHONUNBUFFERED="1")
                ctx_env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)  # one process: all SMs
                context = _context_run(a, dims, work, ctx_env, t_end)
    finally:
        if daemon is not None:
            daemon.__exit__(None, None, None)
    _write(_ranks_report(a, dims, ranks, context, mps), a.out)
    return 0


def _context_run(a, dims: dict, work: str, env: dict, t_end: float) -> dict:
    """The plain-torch MoE at EP = 1 on the world's tokens (all experts) in a process of its own (``env``: no MPS
    thread limit, so all SMs), bounded by what is left of ``--timeout``."""
    out = os.path.join(work, "context.json")
    world_tokens = dims["tokens"] * a.ranks
    cmd = [sys.executable, str(Path(__file__).resolve())] + _dim_args(a, dict(dims, tokens=world_tokens)) + [
        "--impls", ",".join(TORCH_IMPLS), "--ranks", "1", "--out", out]
    note = (f"context only, no ratios: plain torch in one process (EP = 1) on the world's {world_tokens} tokens "
            f"({a.ranks} x {dims['tokens']}) with all {dims['experts']} experts, its own random weights and routing, "
            "no communication; the same total work on the same device, not the same parallel setup")
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(1.0, t_end - time.monotonic()))
    except subprocess.TimeoutExpired:
        return dict(note=note, error=f"timed out (--timeout {a.timeout} s)")
    if r.returncode != 0 or not os.path.exists(out):
        return dict(note=note, error=f"exit {r.returncode}: {(r.stdout + r.stderr)[-1500:]}")
    rep = json.loads(Path(out).read_text())
    return dict(note=note, config=rep["config"], medians_us=rep["medians_us"])


def _ranks_report(a, dims: dict, ranks: dict, context, mps) -> dict:
    per_rank = ranks["per_rank"]
    N = ranks["world"]
    results = {}
    for name in per_rank[0]:
        res = {}
        for key in ("samples_us", "refresh_samples_us"):
            if key not in per_rank[0][name]:
                continue
            each = [pr[name][key] for pr in per_rank]
            slowest = [max(v) for v in zip(*each)]  # a collective step takes as long as its slowest rank
            stem = key[: -len("samples_us")]
            res[stem + "median_us"] = statistics.median(slowest)
            res[stem + "samples_us"] = slowest
            res[stem + "rank_medians_us"] = [statistics.median(v) for v in each]
        res["cache_bytes_per_rank"] = per_rank[0][name]["cache_bytes"]
        results[name] = res
        more = f"  refresh={res['refresh_median_us']:.1f}" if "refresh_median_us" in res else ""
        print(f"{name:22s} {res['median_us']:12.1f} us (slowest of {N} ranks){more}", flush=True)
    medians = {n: r["median_us"] for n, r in results.items()}
    x_bf16 = _ratios(medians, "mxcomm_bf16")
    for n, r in results.items():
        r["x_mxcomm_bf16"] = x_bf16[n]
    with_refresh = _with_refresh(results)
    gpu = torch.device(a.device).type == "cuda"
    meta = ranks["meta"]
    return dict(
        benchmark="moe_layer", device=a.device, gpu=(meta["machine"].get("gpu_names") or [None])[0] if gpu else None,
        **meta,
        config=dict(dim=dims["dim"], ffn=dims["ffn"], experts=dims["experts"], topk=dims["topk"],
                    tokens_per_rank=dims["tokens"], iters=dims["iters"], warmup=a.warmup, ep=N, ranks=N,
                    experts_per_rank=dims["experts"] // N, ep_backend="nvshmem" if gpu else "torch",
                    ranks_per_gpu=N if gpu else None, side_channel="gloo"),
        mps=mps,
        timing=(f"forward + backward of one step, eager, EP = {N}: per iteration the slowest rank's time (ranks start "
                "each step together after a barrier), then the median; x_mxcomm_bf16 = mxcomm_bf16 time / this time; "
                "refresh_median_us = one refresh of the layer's weight caches (once per optimizer step in training, "
                "not part of the step time); step_plus_refresh_us = step median + refresh median; "
                "x_mxcomm_bf16_with_refresh compares those"),
        baseline_note=("with several ranks each rank holds E/N experts and exchanges tokens: a plain-torch MoE per "
                       "rank would not be the layer's math, so no plain-torch ratio is given; context_ep1 is the "
                       "plain-torch figure at EP = 1 on the world's tokens, for orientation only"),
        medians_us=medians,
        ratios=dict(x_mxcomm_bf16=x_bf16, x_mxcomm_bf16_with_refresh=_ratios(with_refresh, "mxcomm_bf16")),
        results=results,
        context_ep1=context,
    )


# ------------------------------------------------------------------------------ main ----
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dim", type=int, default=None, help="model dim (GPU 4096, CPU 128)")
    ap.add_argument("--ffn", type=int, default=None, help="expert ffn dim (GPU 2048, CPU 64)")
    ap.add_argument("--experts", type=int, default=None, help="experts, global (GPU 64, CPU 8)")
    ap.add_argument("--topk", type=int, default=None, help="experts per token (GPU 8, CPU 2)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step and rank (GPU 8192, CPU 256)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (GPU 20, CPU 5)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--impls", default=",".join(ALL_IMPLS),
                    help=f"comma-separated subset of {ALL_IMPLS} (with --ranks > 1 the torch ones are the EP = 1 "
                         "context run)")
    ap.add_argument("--ranks", type=int, default=1, help="EP size: rank processes started by this script")
    ap.add_argument("--mps", choices=("require", "start"), default="require",
                    help="several ranks on one GPU: require a running MPS daemon, or start one for the run")
    ap.add_argument("--timeout", type=float, default=600.0, help="bound on the whole --ranks run (seconds)")
    ap.add_argument("--pg-timeout", type=float, default=300.0, help="torch.distributed timeout of the ranks (s)")
    ap.add_argument("--no-context", action="store_true", help="--ranks > 1: skip the plain-torch EP = 1 context run")
    ap.add_argument("--_rank-result", dest="rank_result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                                         / "mxcomm" / "bench" / "moe_layer.json"))
    a = ap.parse_args()
    gpu = torch.device(a.device).type == "cuda"
    dims = dict(dim=a.dim or (4096 if gpu else 128), ffn=a.ffn or (2048 if gpu else 64),
                experts=a.experts or (64 if gpu else 8), topk=a.topk or (8 if gpu else 2),
                tokens=a.tokens or (8192 if gpu else 256), iters=a.iters or (20 if gpu else 5))
    bad = [i for i in a.impls.split(",") if i not in ALL_IMPLS]
    if bad or a.ranks < 1:
        ap.error(f"unknown --impls {bad}" if bad else "--ranks must be >= 1")
    if a.rank_result:
        return run_rank(a, dims)
    if a.ranks > 1:
        return run_ranks(a, dims)
    return run_single(a, dims)


if __name__ == "__main__":
    raise SystemExit(main())
