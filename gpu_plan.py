# untracked helper: time plan_kernel (whole and by role) as graph replays; run from a package root
import sys, torch, inspect
from mxcomm.ep import plan_kernels as pk
from mxcomm.ep.plan import local_counts
dev = "cuda"
def timed(fn, reps=20, iters=30):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.capture_begin()
        for _ in range(reps): fn()
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1000 / reps)
    ts.sort(); return ts[len(ts) // 2]
new = "status" in inspect.signature(pk.triton_plan).parameters
for W, T in [(4, 128), (4, 4096), (1, 128), (1, 8192)]:
    E, k, align = 256, 8, 32
    g = torch.Generator().manual_seed(W * 7 + T)
    idxs = [torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k].to(torch.int32) for _ in range(W)]
    counts = torch.stack([local_counts(i, E) for i in idxs]).to(dev)
    ids = idxs[0].to(dev)
    err = torch.zeros(1, dtype=torch.int64, device=dev)
    c = pk.check_and_count(ids, E, err, check=True)
    R = W * T * k + (E // W) * (align - 1)
    origins = W > 1
    status = torch.zeros(4, dtype=torch.int64, device=dev); ref = torch.zeros(W, dtype=torch.int32, device=dev)
    kw = dict(status=status, refusals=ref) if new else {}
    full = timed(lambda: pk.triton_plan(counts, c.ids, 0, align, R, prefix=c.slot_prefix, origins=origins, **kw))
    line = f"W={W} T={T} {'new' if new else 'old'} plan_kernel {full:.2f} us"
    if new:
        n = T * k
        ints = torch.empty(pk.plan_numel(W, E, T, k, R), dtype=torch.int32, device=dev)
        t = pk._Tables.views(ints, W, E)
        rest = ints[pk._Tables.numel(W, E):]
        slots, osrc, opos = rest[:4 * n].view(4, n), rest[4 * n:4 * n + R], rest[4 * n + R:]
        tab = timed(lambda: pk._launch_plan(counts, 0, align, osrc, opos[:0], tables=t, status=status, refusals=ref) if False else
                    pk._launch_plan(counts, 0, align, osrc[:0], opos[:0], tables=t, status=status, refusals=ref))
        sl = timed(lambda: pk._launch_plan(counts, 0, align, osrc[:0], opos[:0], idx=c.ids, prefix=c.slot_prefix,
                                           slots=slots, n_blocks=pk.slot_blocks(T, k), S=pk.tokens_per_block(k) * k))
        og = timed(lambda: pk._launch_plan(counts, 0, align, osrc, opos)) if origins else 0.0
        line += f" | tables {tab:.2f} slots {sl:.2f} origins {og:.2f}"
    print(line, flush=True)
