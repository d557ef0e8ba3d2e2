"""What the compiler makes of the EP kernels, on any machine (no GPU needed): registers, spills, barriers and the
widths of the global loads and stores of each kernel (the data kernels and the routing plan's), compiled for sm_90 as
the nvshmem backend launches it.

    python -m mxcomm.bench.tools.kernel_report [--hidden 7168] [--topk 8] [--experts 256] [--world 4]
                                               [--kernels pack,reduce] [--json FILE]

Every kernel variant the backend launches at these sizes (its default
:class:`~mxcomm.ep.nvshmem.launch_config.LaunchConfig`: chunks, warps, rows a step) is compiled ahead of time for sm_90
with its tensor arguments specialized as 16-byte aligned, as Triton specializes a launch on torch tensors
(:func:`compile_sm90`). An address a kernel reads from memory (a peer table, ``x`` by address) carries no such
alignment: a kernel that loads rows through one needs the hints, and a row load of 1 or 2 bytes in the table below is
the sign that it has none. Per variant:

* ``regs`` / ``spill``: registers a thread and local-memory bytes (``cuobjdump --dump-resource-usage`` of the cubin,
  from Triton's NVIDIA backend; ``-`` when it is missing);
* ``bar``: ``bar.sync`` in the PTX - each a trip of a layout conversion through shared memory (two per conversion),
  which stalls every warp of the program;
* ``loads`` / ``stores``: global memory instructions by bytes a thread moves per instruction (``16:4`` = four
  16-byte vector instructions in the code; loops are counted once).

Counts are of the code, not of its execution. They point at a kernel's layout choices; its speed is measured on a GPU
(``bench/bench_ep_kernels.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

_WIDTH = {"8": 1, "16": 2, "32": 4, "64": 8}
_MEM = re.compile(r"\b(ld|st)\.global(?:\.[A-Za-z0-9_:]+?)*?(?:\.v(\d))?\.[bfsu](8|16|32|64)\b")


@dataclass(frozen=True)
class Variant:
    """One launch of a kernel: its name in the report, the kernel (a name in ``module``, under ``mxcomm.ep.nvshmem``),
    argument types (``"*bf16"``, ``"i64"``, ...; unnamed arguments are ``i32``), constexprs, warps and whether FMA
    contraction is on (the partial sums launch with it off)."""

    name: str
    kernel: str
    types: dict
    consts: dict
    warps: int = 4
    fusion: bool = True
    module: str = "kernels"


@dataclass
class Report:
    """The compiled variant's figures (see the module doc)."""

    name: str
    regs: Optional[int]
    spill: Optional[int]
    bar: int
    loads: dict = field(default_factory=dict)
    stores: dict = field(default_factory=dict)


def compile_sm90(fn, types: dict, num_warps: int = 4, fusion: bool = True, **consts):
    """Compile the ``@triton.jit`` function ``fn`` for sm_90 without a GPU, its pointer arguments specialized as
    16-byte aligned (a launch's specialization of torch tensors). ``types``: argument name -> Triton type string
    (default ``"i32"``); ``consts``: constexpr values (defaults filled in). Returns the compiled kernel (``.asm``:
    ``ptx``, ``cubin``, ``ttgir``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                              enable_fp_fusion=fusion))


def memory_widths(ptx: str) -> tuple[dict, dict]:
    """``(loads, stores)``: global memory instructions of the PTX by bytes a thread moves per instruction."""
    out = ({}, {})
    for op, vec, bits in _MEM.findall(ptx):
        width = int(vec or 1) * _WIDTH[bits]
        hist = out[op == "st"]
        hist[width] = hist.get(width, 0) + 1
    return tuple(dict(sorted(h.items())) for h in out)


def _resources(cubin: bytes) -> tuple[Optional[int], Optional[int]]:
    """``(registers, local bytes)`` of the cubin's kernel, or ``(None, None)`` without ``cuobjdump``."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    exe = str(tool) if tool.exists() else shutil.which("cuobjdump")
    if exe is None:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([exe, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs, local = re.search(r"REG:(\d+)", text), re.search(r"LOCAL:(\d+)", text)
    return (int(regs.group(1)) if regs else None), (int(local.group(1)) if local else None)


def variants(H: int, K: int, E: int, W: int) -> list[Variant]:
    """The kernel variants the nvshmem backend launches for hidden ``H``, top-``K`` of ``E`` experts and ``W`` ranks,
    with the default launch settings: chunks from the :class:`LaunchConfig` methods the backend calls; the constexprs
    of each launch site in :mod:`mxcomm.ep.nvshmem.paths` and :mod:`mxcomm.ep.nvshmem.backend` (the gather's and the
    zeroing chunks, the scale layout's tiles of ``NvshmemBackend._grouped_scales``) written out here."""
    from mxcomm.ep.nvshmem import plan_kernels
    from mxcomm.ep.nvshmem.launch_config import LaunchConfig
    from mxcomm.ep.nvshmem.paths import PUSH_BLOCK
    from mxcomm.ep.plan import pull_entry_words
    from mxcomm.kernels.launch import next_pow2

    L = LaunchConfig()
    C, words = H // 32, H // 8
    i32, i64, u8, bf16, f32 = "*i32", "*i64", "*u8", "*bf16", "*fp32"
    row_chunk, qdq = L.row_chunk(H), L.row_chunk(H, weighted=True)
    disp = dict(x_ptr=bf16, dest_rank_ptr=i32, dest_row_ptr=i32, out_ptr=u8, s_peers=i64, w_ptr=f32, offs_ptr=i32,
                counts_ptr=i32, n_rows_ptr=i32)
    local = dict(H=H, K=K, MX=True, MODE=0, INT_ROUND=False)
    pack = dict(x_slot=i64, send_q_ptr=u8, send_s_ptr=u8, epoch_ptr=i64)
    part = dict(out_ptr=bf16, out_s_ptr=u8, table_ptr=i32, origin_pos_ptr=i32, w_ptr=f32, q_peers=i64, s_peers=i64,
                flags_peers=i64, epoch_ptr=i64, err_ptr=i64, ticket_ptr=i32, flags_row_ptr=i64, expect_row_ptr=i64,
                timeout_ns="i64")
    pconst = dict(H=H, K=K, CHUNK=L.partials_row_chunk(H), MODE=0, INT_ROUND=False, ROWS=L.partials_rows)
    red = dict(comb_q_ptr=u8, comb_s_ptr=u8, send_pos_ptr=i32, dest_rank_ptr=i32, y_ptr=bf16, epoch_ptr=i64)
    own = dict(rows_ptr=bf16, rows_s_ptr=u8, dest_rank_ptr=i32, dest_row_ptr=i32, w_ptr=f32, y_ptr=bf16)
    weighted = dict(dst_ptr=u8, dst_s_ptr=u8, offs_ptr=i32, counts_ptr=i32, n_rows_ptr=i32, g_peers=i64, w_peers=i64,
                    table_ptr=i32, epoch_ptr=i64, out_ptr=bf16, gw_peers=i64, flags_peers=i64, ticket_ptr=i32,
                    flags_row_ptr=i64, expect_row_ptr=i64, err_ptr=i64, timeout_ns="i64")
    tok, how = plan_kernels.tokens_per_block(K), plan_kernels.plan_launch(W, E)
    plan_ptrs = {n: "*i64" if n == "status_ptr" else i32 for n in plan_kernels.plan_kernel.arg_names
                 if n.endswith("_ptr")}
    return [
        Variant("id check and counts", "slot_check_hist_kernel",
                dict(idx_ptr="*i64", out_ptr=i32, hist_ptr=i32, err_ptr=i64),
                dict(K=K, K_POW2=next_pow2(K), TOK=tok, CHECK=True, ZERO_BLOCK=min(1024, next_pow2(E + 1))),
                module="plan_kernels"),
        Variant("routing plan", "plan_kernel", plan_ptrs,
                dict(W_POW2=next_pow2(W), EL_POW2=next_pow2(E // W), S=tok * K, S_POW2=next_pow2(tok * K),
                     BLOCK=how.origin_rows, STATUS=True), how.warps, module="plan_kernels"),
        Variant("dispatch, one rank", "local_rows_kernel", disp, dict(local, CHUNK=row_chunk, WEIGHTED=False),
                L.dispatch_warps),
        Variant("combine backward rows, one rank", "local_rows_kernel", disp, dict(local, CHUNK=qdq, WEIGHTED=True),
                L.weighted_warps),
        Variant("pack, x by address", "pack_rows_kernel", pack,
                dict(H=H, CHUNK=row_chunk, MX=True, MODE=0, INT_ROUND=False), L.dispatch_warps),
        Variant("pack, gradient rows + weights, ready", "pack_ready_kernel",
                dict(g_ptr=bf16, send_q_ptr=bf16, epoch_ptr=i64, w_ptr=f32, send_w_ptr=f32, ticket_ptr=i32,
                     flags_peers=i64), dict(H=H, CHUNK=row_chunk, K=K, K_POW2=next_pow2(K)),
                L.dispatch_warps),
        Variant("pull head: check, counts, publish, pack", "pull_head_kernel",
                dict(idx_ptr="*i64", ids_ptr=i32, hist_ptr=i32, input_err_ptr=i64, totals_ptr=i32, counts_ptr=i32,
                     ticket_ptr=i32, counts_peers=i64, flags_peers=i64, epoch_ptr=i64, x_slot=i64, send_q_ptr=u8,
                     send_s_ptr=u8),
                dict(K=K, K_POW2=next_pow2(K), TOK=tok, KEYS=min(1024, next_pow2(E + 1)), PUB_BLOCK=1024, H=H,
                     CHUNK=row_chunk, MX=True, MODE=0, INT_ROUND=False), L.dispatch_warps),
        Variant("pull scan + wait for the counts", "scan_and_wait_kernel",
                dict(hist_ptr=i32, counts_ptr=i32, ticket_ptr=i32, flags_local=i64, epoch_ptr=i64, err_ptr=i64,
                     timeout_ns="i64"), dict(BLOCK_B=256, BLOCK_K=8)),
        Variant("pull-list entries", "push_entries_kernel",
                dict(dest_rank_ptr=i32, dest_row_ptr=i32, w_ptr=f32, list_peers=i64, flags_peers=i64, epoch_ptr=i64),
                dict(K=K, EW=pull_entry_words(K), BLOCK=PUSH_BLOCK)),
        Variant("pull plan + entries + their wait", "plan_entries_kernel",
                dict(plan_ptrs, w_ptr=f32, list_peers=i64, flags_peers=i64, epoch_ptr=i64, ticket_ptr=i32,
                     flags_row_ptr=i64, expect_row_ptr=i64, err_ptr=i64, timeout_ns="i64"),
                dict(W_POW2=next_pow2(W), EL_POW2=next_pow2(E // W), S=tok * K, S_POW2=next_pow2(tok * K),
                     BLOCK=how.origin_rows, STATUS=True, K=K, EW=pull_entry_words(K)), how.warps),
        Variant("gather (pull)", "pull_rows_kernel",
                dict(dst_ptr=i64, dst_s_ptr=u8, offs_ptr=i32, counts_ptr=i32, n_rows_ptr=i32, q_peers=i64,
                     s_peers=i64, list_ptr=i32, table_ptr=i32, wtab_ptr=i32, epoch_ptr=i64),
                dict(ROW_WORDS=words, CHUNK=min(512, next_pow2(words)), C=C, C_POW2=next_pow2(C), K=K,
                     K_POW2=next_pow2(K), EW=pull_entry_words(K), MX=True)),
        Variant("scale layout", "scale_rows_to_grouped_kernel",
                dict(rows_ptr=i32, out_ptr=i32, offs_ptr=i32, n_rows_ptr=i32, counts_ptr=i32) if C % 4 == 0 else
                dict(rows_ptr=u8, out_ptr=u8, offs_ptr=i32, n_rows_ptr=i32, counts_ptr=i32),
                dict(C=C, CB=next_pow2(-(-C // 4)) if C % 4 == 0 else min(32, next_pow2(C)), G_POW2=next_pow2(E // W),
                     WORD=C % 4 == 0, TAIL=True)),
        Variant("partials, combine", "combine_partials_kernel", part,
                dict(pconst, P=min(K, W), MX=True, PASS=False, WEIGHTED=True, WAIT=True), L.weighted_warps, False),
        Variant("partials, MX dispatch backward", "combine_partials_kernel", dict(part, out_ptr=u8),
                dict(pconst, P=min(K, W), MX=True, PASS=True, WEIGHTED=False, WAIT=True), L.weighted_warps, False),
        Variant("partials, BF16 transport", "combine_partials_kernel", part,
                dict(pconst, P=min(K, W), MX=False, PASS=False, WEIGHTED=True, WAIT=True), L.weighted_warps, False),
        Variant("reduce, MX partials", "combine_reduce_kernel", red,
                dict(H=H, K=K, P=min(K, W), CHUNK=L.reduce_row_chunk(H, False, True), MX=True, INT_ROUND=False),
                L.reduce_warps, False),
        Variant("reduce, BF16 partials", "combine_reduce_kernel", dict(red, comb_q_ptr=bf16),
                dict(H=H, K=K, P=min(K, W), CHUNK=L.reduce_row_chunk(H, False, False), MX=False, INT_ROUND=False),
                L.reduce_warps, False),
        Variant("reduce, one rank (MX rounding)", "local_reduce_kernel", own,
                dict(H=H, K=K, CHUNK=L.reduce_row_chunk(H, True, True), MX=True, PASS=False, WEIGHTED=True, MODE=0,
                     INT_ROUND=False), 4, False),
        Variant("weighted rows + route grad", "pull_weighted_kernel", weighted,
                dict(H=H, CHUNK=qdq, K=K, K_POW2=next_pow2(K), MX=True, MODE=0, INT_ROUND=False,
                     ZCHUNK=min(512, next_pow2(words)), ROUTE_GRAD=True, WAIT=True), L.weighted_warps),
        # the put path: a round's partials staged, a round's weighted rows from the rows puts delivered
        Variant("partials, put path round", "stage_partials_kernel", part,
                dict(pconst, MX=True, PASS=False, WEIGHTED=True), L.weighted_warps, False),
        Variant("weighted rows, put path round", "round_weighted_kernel", weighted,
                dict(H=H, CHUNK=qdq, K=K, K_POW2=next_pow2(K), MX=True, MODE=0, INT_ROUND=False,
                     ZCHUNK=min(512, next_pow2(words)), ROUTE_GRAD=True), L.weighted_warps),
    ]


def report(v: Variant) -> Report:
    """Compile one variant and read its figures."""
    import importlib

    kernel = getattr(importlib.import_module(f"mxcomm.ep.nvshmem.{v.module}"), v.kernel)
    k = compile_sm90(kernel, v.types, v.warps, v.fusion, **v.consts)
    regs, spill = _resources(k.asm["cubin"])
    loads, stores = memory_widths(k.asm["ptx"])
    return Report(v.name, regs, spill, k.asm["ptx"].count("bar.sync"), loads, stores)


def _hist(h: dict) -> str:
    return " ".join(f"{w}:{n}" for w, n in h.items()) or "-"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--world", type=int, default=4, help="ranks (the reduce's partials per token: min(topk, world))")
    ap.add_argument("--kernels", default="", help="comma list: report only variants whose kernel or name holds one")
    ap.add_argument("--json", default=None, help="also write the reports here")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("kernel_report compiles for sm_90: run it without TRITON_INTERPRET (the interpreter's kernels "
                         "cannot be compiled)")
    if a.hidden % 32 or a.hidden < 32:
        raise SystemExit(f"--hidden {a.hidden}: a positive multiple of 32 (the MX block)")
    if a.world < 1 or a.experts % a.world or a.topk < 1:
        raise SystemExit(f"--experts {a.experts} over --world {a.world} ranks, --topk {a.topk}: experts a multiple of "
                         f"the ranks, topk >= 1")
    keys = [s for s in a.kernels.split(",") if s]
    chosen = [v for v in variants(a.hidden, a.topk, a.experts, a.world)
              if not keys or any(s in v.kernel or s in v.name for s in keys)]
    if not chosen:
        raise SystemExit(f"--kernels {a.kernels!r} matches no variant")
    print(f"sm_90, H={a.hidden}, top-{a.topk} of {a.experts} experts, {a.world} ranks, default LaunchConfig; "
          f"loads/stores: bytes a thread per instruction:count")
    print(f"{'variant':34} {'regs':>5} {'spill':>5} {'bar':>4}  {'loads':28} stores")
    out = []
    for v in chosen:
        r = report(v)
        out.append(r)
        fmt = (lambda x: "-" if x is None else str(x))
        print(f"{r.name:34} {fmt(r.regs):>5} {fmt(r.spill):>5} {r.bar:>4}  {_hist(r.loads):28} {_hist(r.stores)}",
              flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(hidden=a.hidden, topk=a.topk, world=a.world,
                                                reports=[r.__dict__ for r in out]), indent=1))


if __name__ == "__main__":
    main()
