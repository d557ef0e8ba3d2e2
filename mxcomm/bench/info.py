"""``mxcomm info``: the environment (GPUs, peer access, versions, NVSHMEM variables) and the symmetric
buffer memory one EP configuration needs (per region, from :func:`mxcomm.ep.plan.buffer_regions`).

Read-only: initialises no NVSHMEM, no process group, changes no environment. Works without a GPU.
"""
from __future__ import annotations

import argparse
import json

from .options import TRANSPORTS, _int_list, _str_list


def add_info_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``mxcomm info`` options to ``p``."""
    p.add_argument("--tokens", type=int, default=4096, help="max tokens per rank (default 4096)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--experts", type=int, default=256, help="global experts (default 256)")
    p.add_argument("--world", type=_int_list, help="EP sizes, comma list (default: visible GPUs, else 1)")
    p.add_argument("--precision", type=_str_list, default=["mxfp8", "bf16"], help="comma list (default mxfp8,bf16)")
    p.add_argument("--align", type=int, default=32, help="expert group padding, 32 or 128")
    p.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="buffers of the one-node paths (auto: adds the pull dispatch's send buffers; push) or of the "
                        "put-with-signal path (put: adds staging)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--topo", action="store_true", help="also print `nvidia-smi topo -m` (if present)")


def buffer_report(*, tokens: int, hidden: int, topk: int, experts: int, world: int, precision: str,
                  align: int = 32, transport: str = "auto") -> dict:
    """Per-rank symmetric buffer bytes of the nvshmem backend for one config (ValueError if invalid)."""
    from ..ep.config import EPConfig
    from ..ep.plan import (buffer_regions, buffer_sizes, call_output_rows, dispatch_path, max_recv_rows,
                           put_round_tokens, recv_window_rows)
    from ..ep import LaunchConfig
    from ..mx import grouped_m_rows, round_up
    from ..transport import launcher_env, symmetric_size_for

    cfg = EPConfig(num_experts=experts, hidden=hidden, topk=topk, max_tokens_per_rank=tokens, align=align,
                   precision=precision, backend="nvshmem", transport=transport)
    cfg.validate(world)
    launch = LaunchConfig()  # (the config above sets none: the backend's defaults)
    sizes = buffer_sizes(cfg, world)
    path = dispatch_path(cfg, world)
    R = max_recv_rows(cfg, world)
    rounds = {}
    if path in ("push", "put"):  # the receive window, and the rounds the worst-case routing takes through it
        window = recv_window_rows(cfg, world, path == "put")
        rounds.update(recv_window_rows=window, worst_dispatch_rounds=-(-R // window))
    if path == "put":  # the combine direction and combine backward: T_c tokens of every source per round
        tc = put_round_tokens(cfg, world)
        rounds.update(round_tokens=tc, combine_rounds=-(-tokens // tc))
    call_rows = call_output_rows(cfg, world, tokens)
    if call_rows is not None:  # an exact-size dispatch of `tokens` tokens as one captured call: its output's storage
        scale_bytes = (grouped_m_rows(call_rows, cfg.num_local_experts(world)) * round_up(hidden // 32, 4)
                       if precision == "mxfp8" else 0)
        rounds.update(call_output_rows=call_rows,
                      call_output_bytes=call_rows * hidden * (1 if precision == "mxfp8" else 2) + scale_bytes)
    elif path == "pull" and launch.peer_guess_pct:  # one call, its output sized per call
        rounds.update(call_output_margin_pct=launch.peer_guess_pct)
    return dict(
        precision=precision, world=world, tokens=tokens, hidden=hidden, topk=topk, experts=experts, align=align,
        path=path, max_recv_rows=R, **rounds,
        regions=[dict(name=r.name, shape=list(r.shape), dtype=str(r.dtype).replace("torch.", ""), bytes=r.nbytes)
                 for r in buffer_regions(cfg, world)],
        by_purpose=dict(dispatch_payload=sizes.dispatch_payload, dispatch_scales=sizes.dispatch_scales,
                        combine_payload=sizes.combine_payload, counts=sizes.counts, flags=sizes.flags,
                        put_staging=sizes.put_staging, pull_send=sizes.pull_send),
        total=sizes.total,
        nvshmem_symmetric_size=symmetric_size_for(sizes.total),
        launcher_env=launcher_env(sizes.total),
    )


def check_info_args(args) -> None:
    """Raise ValueError naming the bad ``mxcomm info`` option."""
    from .options import PRECISIONS

    for name in ("tokens", "hidden", "topk", "experts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be positive, got {getattr(args, name)}")
    if args.hidden % 32:
        raise ValueError(f"--hidden {args.hidden} must be a multiple of 32 (the MX block size)")
    if args.topk > args.experts:
        raise ValueError(f"--topk {args.topk} must not exceed --experts {args.experts}")
    for p in args.precision:
        if p not in PRECISIONS:
            raise ValueError(f"--precision {p!r} is unknown; choose from {', '.join(PRECISIONS)}")
    for w in args.world or []:
        if w < 1:
            raise ValueError(f"--world sizes must be positive, got {w}")
        if args.experts % w:
            raise ValueError(f"--experts {args.experts} must be divisible by the EP size --world {w}")
    if args.align not in (32, 128):
        raise ValueError(f"--align must be 32 or 128, got {args.align}")


def collect(args) -> dict:
    """Everything ``mxcomm info`` reports, as a dict."""
    import torch

    from .env_info import machine, nvshmem_importable, peer_matrix, relevant_env, versions

    worlds = args.world or [max(1, torch.cuda.device_count() if torch.cuda.is_available() else 1)]
    bufs, errors = [], []
    for w in worlds:
        for p in args.precision:
            try:
                bufs.append(buffer_report(tokens=args.tokens, hidden=args.hidden, topk=args.topk,
                                          experts=args.experts, world=w, precision=p, align=args.align,
                                          transport=getattr(args, "transport", "auto")))
            except ValueError as e:
                errors.append(f"world {w}, {p}: {e}")
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm = dict(all_to_all_vdev_2d=hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d"))
        try:
            symm["nvshmem_available"] = bool(symm_mem.is_nvshmem_available())
        except Exception as e:  # noqa: BLE001
            symm["nvshmem_available"] = f"unknown ({type(e).__name__}: {e})"
    except Exception as e:  # noqa: BLE001
        symm = dict(error=f"{type(e).__name__}: {e}")
    mach = machine()
    return dict(machine=mach, peer_access=peer_matrix(), versions=versions(),
                nvshmem4py_import=nvshmem_importable() or "ok", torch_symmetric_memory=symm, env=relevant_env(),
                nvlink_multicast=multicast_state() if mach["gpus"] else None, buffers=bufs, buffer_errors=errors)


def multicast_state() -> str:
    """Whether NVLink multicast is off in this environment (only meaningful where a GPU is visible)."""
    from ..transport import check_env

    try:
        check_env()
        return "off (NVSHMEM_DISABLE_NVLS, TORCH_SYMM_MEM_DISABLE_MULTICAST, NCCL_NVLS_ENABLE set)"
    except RuntimeError as e:
        return f"NOT disabled in this shell: {e}"


def _mib(n: int) -> str:
    if n < 2**20:
        return f"{n:,} B"
    return f"{n / 2**20:,.1f} MiB"


def format_info(d: dict) -> str:
    m = d["machine"]
    out = [f"host {m['hostname']}  ({m['platform']}, {m['cpu_count']} CPUs)"]
    if m["gpus"]:
        out.append(f"GPUs: {m['gpu_count']}")
        for g in m["gpus"]:
            out.append(f"  cuda:{g['index']}  {g['name']}  {g['memory_gib']} GiB  sm_{g['capability'].replace('.', '')}"
                       f"  {g['sm_count']} SMs  L2 {(_mib(g['l2_bytes']) if g['l2_bytes'] else '?')}")
        pm = d["peer_access"]
        if len(pm) > 1:
            out.append("peer access (torch.cuda.can_device_access_peer; row = from):")
            out.append("        " + " ".join(f"{j:>4}" for j in range(len(pm))))
            for i, row in enumerate(pm):
                out.append(f"  {i:>4}  " + " ".join(f"{'-' if v is None else ('yes' if v else 'no'):>4}" for v in row))
    else:
        out.append("GPUs: none visible (CPU only: mxcomm bench runs the torch reference backend over gloo)")
    v = d["versions"]
    out.append("versions: " + ", ".join(f"{k} {v[k]}" for k in ("python", "torch", "cuda", "nccl", "triton", "mxcomm",
                                                                "nvshmem4py", "nvidia-nvshmem", "cuda-python",
                                                                "cuda-core", "mpi4py") if v.get(k)))
    missing = [k for k in ("nvshmem4py", "nvidia-nvshmem", "cuda-python", "mpi4py", "matplotlib", "tqdm") if not v.get(k)]
    if missing:
        out.append("not installed: " + ", ".join(missing))
    out.append(f"nvshmem.core import: {d['nvshmem4py_import']}")
    out.append(f"torch symmetric memory: {d['torch_symmetric_memory']}")
    if d.get("nvlink_multicast"):  # None without a GPU: nothing to say about multicast there
        out.append(f"NVLink multicast: {d['nvlink_multicast']}")
    if d["env"]:
        out.append("environment: " + " ".join(f"{k}={v}" for k, v in d["env"].items()))
    for b in d["buffers"]:
        out.append("")
        out.append(f"symmetric buffers per rank (nvshmem backend): {b['precision']}, EP={b['world']}, "
                   f"tokens={b['tokens']}, hidden={b['hidden']}, topk={b['topk']}, experts={b['experts']}, "
                   f"align={b['align']}  (max received rows {b['max_recv_rows']:,})")
        if "recv_window_rows" in b:
            out.append(f"  {b['path']} path: dispatch receive window {b['recv_window_rows']:,} rows (in rounds when a "
                       f"rank receives more; {b['worst_dispatch_rounds']} at the worst routing)")
        if "round_tokens" in b:
            out.append(f"  {b['path']} path: combine and combine backward in {b['combine_rounds']} round(s) of "
                       f"{b['round_tokens']:,} tokens of every source")
        if "call_output_rows" in b:
            out.append(f"  {b['path']} path: an exact-size dispatch of {b['tokens']:,} tokens runs as one captured "
                       f"call; each call's output (not symmetric memory) is a view of {b['call_output_rows']:,} rows, "
                       f"{_mib(b['call_output_bytes'])} with its scales, whatever the routing")
        if "call_output_margin_pct" in b:
            out.append(f"  {b['path']} path: an exact-size dispatch runs as one captured call (from the second call of "
                       f"a token count); each call's output (not symmetric memory) is a view of the rows the last call "
                       f"of its token count brought plus {b['call_output_margin_pct']} %")
        for r in b["regions"]:
            out.append(f"  {r['name']:<12} {str(tuple(r['shape'])):<28} {r['dtype']:<6} {_mib(r['bytes']):>14}")
        out.append("  by purpose: " + ", ".join(f"{k} {_mib(v)}" for k, v in b["by_purpose"].items()))
        out.append(f"  total {_mib(b['total'])} ({b['total']:,} bytes) -> NVSHMEM_SYMMETRIC_SIZE="
                   f"{b['nvshmem_symmetric_size']}")
    for e in d["buffer_errors"]:
        out.append(f"invalid config: {e}")
    return "\n".join(out) + "\n"


def run_info(args) -> int:
    """Print the ``mxcomm info`` report (text or ``--json``); 1 when every requested config is invalid."""
    import shutil
    import subprocess

    d = collect(args)
    if args.json:
        print(json.dumps(d, indent=1, default=str))
    else:
        print(format_info(d), end="")
    if getattr(args, "topo", False) and shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
            print(r.stdout)
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"nvidia-smi topo -m failed: {e}")
    return 1 if d["buffer_errors"] and not d["buffers"] else 0


__all__ = ["add_info_arguments", "check_info_args", "buffer_report", "collect", "format_info", "run_info",
           "multicast_state"]
