"""Worker of the CUDA-graph tests (tests/ep/test_cuda_graph_gpu.py): a whole MoE block forward +
backward through the nvshmem backend (no-host-sync mode) captured once into a CUDA graph, then
replayed with fresh inputs and routings written into the static input tensors; every replay must
equal the same step run eagerly, bit for bit."""
from __future__ import annotations

import torch

from _dist import bind_rank_gpu, progress
from mxcomm.ep import EPConfig, EPGroup


class _Block:
    """Static inputs + a capturable step: dispatch -> per-expert linear maps on the dense rows (computed
    for every row and selected by expert group, so no shape depends on the routing) -> combine ->
    loss = <y, G>; returns ``(y, grad x, grad route weights, grad expert weights)``. In the no-sync mode the rows
    past ``offs[-1]`` are not written (whatever the allocator gave, NaN bytes included): the block selects with
    ``torch.where`` (a multiply by a 0/1 mask would turn NaN garbage into NaN gradients)."""

    def __init__(self, group: EPGroup, dev: str, seed: int):
        cfg = group.config
        self.group, self.dev = group, dev
        self.T, self.H, self.k, self.E = cfg.max_tokens_per_rank, cfg.hidden, cfg.topk, cfg.num_experts
        self.El = group.num_local_experts
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.A = (torch.randn(self.El, self.H, self.H, generator=g) * 0.05).to(dev).requires_grad_()
        self.x = torch.zeros(self.T, self.H, dtype=torch.bfloat16, device=dev)
        self.idx = torch.full((self.T, self.k), -1, dtype=torch.int32, device=dev)
        self.w = torch.zeros(self.T, self.k, dtype=torch.float32, device=dev)
        self.gy = torch.zeros(self.T, self.H, dtype=torch.bfloat16, device=dev)

    def fill(self, seed: int) -> None:
        """New values in the static inputs (random rows, routing with ~20 % dropped slots)."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        T, k, E = self.T, self.k, self.E
        self.x.copy_(torch.randn(T, self.H, generator=g).to(torch.bfloat16))
        idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k].to(torch.int32)
        idx[torch.rand(T, k, generator=g) < 0.2] = -1
        if seed % 3 == 0:
            idx[: T // 2, 0] = 0  # a hot expert
            idx[: T // 2, 1:] = torch.where(idx[: T // 2, 1:] == 0, -1, idx[: T // 2, 1:])
        self.idx.copy_(idx)
        self.w.copy_(torch.rand(T, k, generator=g))
        self.gy.copy_(torch.randn(T, self.H, generator=g).to(torch.bfloat16))

    def step(self):
        x = self.x.detach().requires_grad_()
        w = self.w.detach().requires_grad_()
        d = self.group.dispatch(x, self.idx, w)
        h = d.dense(torch.float32)                                           # [R, H]
        rows = torch.arange(h.shape[0], device=self.dev)
        eid = torch.searchsorted(d.offs.to(torch.int64), rows, right=True)   # local expert of each row (El: tail)
        h = torch.where((eid < self.El).unsqueeze(1), h, 0.0)
        out = torch.zeros_like(h)
        for e in range(self.El):
            out = torch.where((eid == e).unsqueeze(1), h @ self.A[e], out)
        y = self.group.combine(out.to(torch.bfloat16), d.handle)
        loss = (y.float() * self.gy.float()).sum()
        gx, gw, gA = torch.autograd.grad(loss, [x, w, self.A])
        return y, gx, gw, gA


def graph_worker(rank: int, world: int, precision: str, replays: int = 4) -> dict:
    dev = bind_rank_gpu(rank)
    cfg = EPConfig(num_experts=4 * world, hidden=256, topk=3, max_tokens_per_rank=40, precision=precision,
                   backend="nvshmem", exact_sizes=False)
    group = EPGroup(cfg)
    blk = _Block(group, dev, seed=11)
    fails = []
    progress("eager warm-up on a side stream")
    blk.fill(1000 + rank)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            blk.step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    progress("capture")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = blk.step()
    torch.cuda.synchronize()
    for i in range(replays):
        progress(f"replay {i}")
        blk.fill(7 * i + 100 * rank)
        graph.replay()
        torch.cuda.synchronize()
        got = [t.detach().clone() for t in static_out]
        group.check_errors()
        want = [t.detach() for t in blk.step()]  # the same inputs, eagerly
        torch.cuda.synchronize()
        for name, a, b in zip(("y", "grad_x", "grad_w", "grad_A"), got, want):
            if a.shape != b.shape or not torch.equal(a, b):
                diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "shape"
                fails.append(f"replay {i} rank {rank} {precision}: {name} differs from eager (max |diff| {diff})")
        if not torch.isfinite(got[0].float()).all() or float(got[0].float().abs().sum()) == 0.0:
            fails.append(f"replay {i} rank {rank}: y is not finite or all zero")
    # Capture of the exact-size mode must be refused with a clear error (it reads a size on the host).
    exact = EPGroup(EPConfig(num_experts=4 * world, hidden=256, topk=3, max_tokens_per_rank=40,
                             precision=precision, backend="nvshmem", exact_sizes=True))
    g2, err = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(g2):
        try:  # raised before any CUDA work, so the (empty) capture itself stays valid
            exact.dispatch(blk.x, blk.idx, blk.w)
        except RuntimeError as e:
            err = e
    if err is None:
        fails.append(f"rank {rank}: capturing an exact_sizes=True dispatch did not raise")
    elif "exact_sizes=False" not in str(err):
        fails.append(f"rank {rank}: unclear error for exact-size capture: {err}")
    torch.cuda.synchronize()
    from mxcomm import transport as tp

    tp.finalize()
    return {"failures": fails, "replays": replays}
