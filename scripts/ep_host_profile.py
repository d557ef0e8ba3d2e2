"""Host-side cProfile of nvshmem dispatch/combine calls (world of 1): where the Python call spends its time."""
import cProfile
import os
import pstats
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mxcomm.ep import EPConfig, EPGroup  # noqa: E402

dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
T, H, E, k = 8192, 7168, 256, 8
grp = EPGroup(EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=T, backend="nvshmem", exact_sizes=False))
x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
idx = torch.argsort(torch.rand(T, E, device="cuda"), dim=1)[:, :k].to(torch.int32)
w = torch.rand(T, k, device="cuda")
for _ in range(3):
    res, h = grp.dispatch(x, idx, w)
out = torch.randn(res.num_rows, H, device="cuda").to(torch.bfloat16)
grp.combine(out, h)
torch.cuda.synchronize()
pr = cProfile.Profile()
pr.enable()
for _ in range(5):
    res, h = grp.dispatch(x, idx, w)
    torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(22)
pr = cProfile.Profile()
pr.enable()
for _ in range(5):
    grp.combine(out, h)
    torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(8)
from mxcomm import transport as tp  # noqa: E402

tp.finalize()
