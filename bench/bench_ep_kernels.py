"""The EP data kernels alone on one GPU - dispatch (quantize + scatter) and combine's reduce - against
the device copy ceiling and, for dispatch, a naive baseline kernel.

    python3 bench/bench_ep_kernels.py [--tokens 8192] [--hidden 7168] [--topk 8] [--experts 256]
                                      [--impls mxcomm.ep.nvshmem.kernels,other.module]

No NVSHMEM: with one rank every slot stays on this GPU, so the kernels are launched with one-entry pointer
tables that point at plain CUDA tensors (what the backend passes in loopback, minus the symmetric heap).
The routing plan is the library's (``mxcomm.ep.plan.build_plan``; random top-k routing, every expert
local), built once outside the timed region. ``--impls`` names modules providing the library's kernels
(``push_rows_kernel``, ``local_rows_kernel``, ``combine_reduce_kernel``, ``local_reduce_kernel``, ...) with its
signatures (to compare an implementation against another in the same run).

Timed (``--timer graph``, the default: median CUDA-event time of a CUDA-graph replay of 10 launches, divided by
10, so the host's launch time is not counted; ``--timer events``: events around one eager launch, which counts
it), for each module and (programs, warps, chunk):

* ``dispatch``: BF16 read once per token (``T*H*2``) + MXFP8 payload and scales written once per valid
  selection (``S*(H + H/32)``). Checked: payload and blocked scales equal the plain-torch reference
  (``mxcomm.mx.reference.quantize``) placed at the plan's rows.
* the receivers of the push dispatch: ``copyout`` (the received rows out of the symmetric buffer into a fresh
  tensor, padding zero) and ``swizzle`` (row-major scale rows -> the grouped blocked matrix), each checked;
* the pull dispatch: ``pack`` (each token row quantized once into the send buffer) and ``gather``
  (``pull_rows_kernel``: the receiver reads each listed token row and scale row once and stores them at all the
  token's rows: payload into a fresh tensor, scale rows into the staging rows the swizzle reads);
* ``push_path`` (dispatch + copyout + swizzle) and ``pull_path`` (pack + gather + swizzle): each path's
  three launches timed together, with the dispatch byte count;
* ``naive`` (dispatch baseline, this file's kernel): one program per token loads the row once, quantizes
  it once and stores it to each destination row, scales row-major. Same bytes, same check.
* ``reduce``: the origin's sum of the partials that came home (one rank: one MXFP8 partial per token, at its combine
  slot, ``mxcomm.ep.plan.combine_slots``): ``T*(H + H/32)`` read + ``T*H*2`` written. Checked against the plain-torch
  partial (the fp32 weighted sum of the token's rows, quantized) dequantized (bf16 output; max |diff| reported, must be
  within bf16 rounding).
* ``reduce_ranks`` (``--ops reduce_ranks``, ``--world W``): the reduce at the origin of a ``W``-rank world - each
  token's experts live on ranks ``expert // (E / W)``, so it sums one MXFP8 partial per distinct rank (random rows,
  quantized, at the token's combine slot for the rank, as the expert side stores them), in the order of the
  ranks' first slots: ``P*(H + H/32)`` read (``P`` partials) + ``T*H*2`` written. Checked against the plain-torch sum
  of the dequantized partials (bf16 rounding). Run it in a process confined to part of the GPU (MPS,
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) to see it as one of several ranks sharing the GPU does;
* ``partials_ranks`` (``--ops partials_ranks``, ``--world W``, ``--rows``): the expert side of combine in a ``W``-rank
  world (``combine_partials_kernel``) - this rank holds experts ``[0, E / W)``; each of ``W`` sources routes its tokens
  at random (source 0 as the other ops), the rows here are expert-major, and for every (source, token) that lists rows
  here the weighted fp32 sum of its rows is quantized once into that source's combine buffer (``W`` buffers and flag
  words on this GPU): ``R*H*2`` read (the ``R`` expert rows) + one MXFP8 partial per listed entry written. Checked
  bit for bit against the plain-torch sum (products rounded, then added in slot order) quantized by the reference,
  and every program's arrival at every rank;
* ``weighted_ranks`` (``--ops weighted_ranks``, ``--world W``): the expert side of combine backward in
  the same world (``pull_weighted_kernel`` with the route-weight gradient): every (source, token) listing rows here
  has its BF16 gradient row read once from that source's rows, and each of its rows gets ``w * g`` quantized, the
  expert row read for ``<g, out[row]>`` into that source's ``gw``: one BF16 row read per listed entry + ``R*H*2``
  read + ``R*(H + H/32)`` written. Checked bit for bit (payload, row-major scales) against the reference quantization
  of the fp32 products, the route-weight gradients against a float64 dot, and every program's arrival;
* ``local_path``: the one-rank dispatch (``local_rows_kernel`` straight into the fresh output, the unfilled rows
  zeroed at the end of the same launch, then the swizzle), checked like the other paths;
* ``reduce_own``: the one-rank combine (``local_reduce_kernel``: every row read as bf16 from the expert
  output, the weighted sum quantized in registers): ``S*H*2`` read + ``T*H*2`` written; same check as ``reduce``.
* ``pattern`` (``--ops pattern``): ceilings of the dispatch's access pattern - the same reads, writes, rows and
  order without the quantization (``pattern_scatter_kernel``: plain, through TMA descriptors, writes alone), a
  torch copy and a ``zero_()`` of the same byte count; ``pattern_ceiling_gbps`` = the fastest scatter, and each
  ``dispatch`` / ``local_path`` result gets ``vs_pattern_ceiling``;
* ``ceiling``: ``dst.copy_(src)`` of 1 GiB (read + write counted).

Writes JSON to ``--out``; exits non-zero if any output is wrong.
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))

from mxcomm.bench.ceiling import device_copy, event_median_ms
from mxcomm.bench.env_info import machine, versions
from mxcomm.ep.plan import build_plan, local_counts, pull_entry_words
from mxcomm.kernels.mx_device import blocked_scale_offset, mx_quantize_tile
from mxcomm.mx import round_up
from mxcomm.mx.layouts import blocked_index, grouped_m_row_map, grouped_m_rows
from mxcomm.mx.reference import quantize


@triton.jit
def naive_dispatch_kernel(x_ptr, T, dest_row_ptr, srow_ptr, q_ptr, s_ptr, n_col_tiles, H: tl.constexpr,
                          K: tl.constexpr, CHUNK: tl.constexpr, INT_ROUND: tl.constexpr, BLOCKED: tl.constexpr):
    """Baseline: program ``t`` (persistent over tokens) loads bf16 row ``x[t, :]`` once (``CHUNK`` at a
    time), quantizes it once (rceil) and stores payload row ``q[dest_row[t, j]]`` (uint8 ``[*, H]``) for
    each valid slot ``j`` (``dest_row >= 0``), its scales row-major at ``s[dest_row[t, j]]`` (uint8
    ``[*, H/32]``) or, with ``BLOCKED``, at row ``srow[t, j]`` of the 128x4-blocked layout."""
    NB: tl.constexpr = CHUNK // 32
    offs = tl.arange(0, CHUNK)
    bcols = tl.arange(0, NB)
    t = tl.program_id(0).to(tl.int64)
    while t < T:
        for c0 in tl.static_range(0, H, CHUNK):
            m = (c0 + offs) < H
            x = tl.load(x_ptr + t * H + c0 + offs, mask=m, other=0.0)
            q2, s = mx_quantize_tile(tl.reshape(x, (NB, 32)), 0, INT_ROUND, 1)
            q = tl.reshape(q2, (CHUNK,))
            cols = c0 // 32 + bcols
            for j in tl.static_range(K):
                row = tl.load(dest_row_ptr + t * K + j).to(tl.int64)
                if row >= 0:
                    tl.store(q_ptr + row * H + c0 + offs, q, mask=m)
                    if BLOCKED:
                        srow = tl.load(srow_ptr + t * K + j).to(tl.int64)
                        tl.store(s_ptr + blocked_scale_offset(srow, cols, n_col_tiles), s, mask=cols < H // 32)
                    else:
                        tl.store(s_ptr + row * (H // 32) + cols, s, mask=cols < H // 32)
        t += tl.num_programs(0)


@triton.jit
def pattern_scatter_kernel(x_ptr, xdesc, T, dest_row_ptr, q_ptr, s_ptr, H: tl.constexpr, K: tl.constexpr,
                           CHUNK: tl.constexpr, LOAD: tl.constexpr, TMA_LOAD: tl.constexpr, TMA_STORE: tl.constexpr):
    """The dispatch's memory traffic without its arithmetic (a ceiling for that access pattern): program ``t``
    (persistent over tokens, like ``local_rows_kernel``) reads row ``x[t, :]`` (int16 ``[T, H]``, the bf16 bits)
    once, ``CHUNK`` at a time, and stores its high bytes to payload row ``q[dest_row[t, j]]`` (uint8 ``[*, H]``) and
    ``NB`` bytes ``t + column`` to scale row ``s[dest_row[t, j]]`` (uint8 ``[*, H/32]``) for each valid slot ``j``.
    ``LOAD`` False: no reads (payload bytes ``t + offset``; writes alone). ``TMA_LOAD`` / ``TMA_STORE``: the row
    pieces go through tensor descriptors (``xdesc`` over x viewed ``[T, H/256, 256]``; ``q_ptr`` then a descriptor
    over q viewed ``[*, H/256, 256]``; block ``[1, CHUNK/256, 256]``) instead of plain loads / stores."""
    NB: tl.constexpr = CHUNK // 32
    C: tl.constexpr = H // 32
    offs = tl.arange(0, CHUNK)
    bcols = tl.arange(0, NB)
    t = tl.program_id(0)
    while t < T:
        for c0 in tl.static_range(0, H, CHUNK):
            m = (c0 + offs) < H
            if not LOAD:
                q = (offs + t).to(tl.uint8)
            elif TMA_LOAD:
                q = (tl.reshape(xdesc.load([t, c0 // 256, 0]), (CHUNK,)) >> 8).to(tl.uint8)
            else:
                q = (tl.load(x_ptr + t.to(tl.int64) * H + c0 + offs, mask=m, other=0) >> 8).to(tl.uint8)
            cols = c0 // 32 + bcols
            s = (cols + t).to(tl.uint8)
            for j in tl.static_range(K):
                row = tl.load(dest_row_ptr + t * K + j)
                if row >= 0:
                    if TMA_STORE:
                        q_ptr.store([row, c0 // 256, 0], tl.reshape(q, (1, CHUNK // 256, 256)))
                    else:
                        dst = q_ptr + tl.multiple_of(row.to(tl.int64) * H + c0, 16) + offs
                        tl.store(tl.max_contiguous(tl.multiple_of(dst, 16), 16), q, mask=m)
                    tl.store(s_ptr + row.to(tl.int64) * C + cols, s, mask=cols < C)
        t += tl.num_programs(0)


def _event_median_us(fn, iters: int) -> float:
    return event_median_ms(fn, iters, torch.device("cuda")) * 1e3


def _graph_median_us(fn, iters: int, reps: int = 10) -> float:
    """Kernel time without host launch gaps: ``reps`` calls of ``fn`` captured into one CUDA graph, the median
    CUDA-event time of a replay divided by ``reps``. (Events around one eager launch also count the part of the
    host's Triton launch time, up to ~30 µs, that the GPU spends idle: short kernels look slower than they are.)"""
    fn()  # compiled and warm before the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return event_median_ms(g.replay, iters, torch.device("cuda")) * 1e3 / reps


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


class Lab:
    """Inputs, plan and reference outputs of one configuration; ``record`` times and checks a launch."""

    def __init__(self, args):
        self.args = args
        self.interp = os.environ.get("TRITON_INTERPRET") == "1"
        self.worlds = {}  # op -> inputs, reference and buffers made once for every module timed
        dev = self.dev = torch.device("cpu" if self.interp else "cuda")
        T, H, k, E = self.T, self.H, self.k, self.E = args.tokens, args.hidden, args.topk, args.experts
        C = self.C = H // 32
        g = torch.Generator().manual_seed(0)
        idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k].to(torch.int32)
        if args.drop:  # some dropped slots (-1), as a capacity limit would leave them
            idx[torch.rand(T, k, generator=g) < args.drop] = -1
        self.idx = idx.to(dev)
        self.x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
        self.plan = build_plan(local_counts(self.idx, E)[None], self.idx, 0, args.align)
        dr = self.plan.dest_row.long()  # each slot's row in the grouped blocked scale matrix
        rmap = grouped_m_row_map(self.plan.offs, max(int(self.plan.num_rows), 1))
        self.srow = torch.where(dr >= 0, rmap[dr.clamp(min=0)], -1).to(torch.int32)
        self.R = R = int(self.plan.num_rows)
        self.n_col_tiles = round_up(C, 4) // 4
        self.s_bytes = (round_up(R + 128 * E, 128) // 128) * self.n_col_tiles * 512
        self.S = int((self.idx >= 0).sum())
        self.sms = 1 if self.interp else torch.cuda.get_device_properties(dev).multi_processor_count
        self.results = []
        self.layouts = [{"row": False, "blocked": True}[v] for v in args.scales.split(",")]
        # reference dispatch output: payload row and scales of each valid slot
        ref = quantize(self.x)
        keep = self.plan.dest_row.reshape(-1) >= 0
        tok = torch.arange(T, device=dev).repeat_interleave(k)[keep]
        self.slot_rows = self.plan.dest_row.reshape(-1)[keep].long()
        self.slot_tok = tok
        self.ref_q_tok = ref.qdata.view(torch.uint8)  # each token row quantized once (the pull path's send rows)
        self.ref_s_tok = ref.scales.view(torch.uint8).reshape(T, C)
        self.slot_srows = self.srow.reshape(-1)[keep].long()
        self.ref_q = ref.qdata.view(torch.uint8)[tok]
        self.ref_s = ref.scales.view(torch.uint8).reshape(T, C)[tok]
        cols = torch.arange(C, device=dev)
        self.boff = blocked_index(self.slot_srows[:, None], cols[None, :], self.n_col_tiles)
        # combine input: one partial per token (one rank: the weighted sum of all its rows, fp32, j ascending),
        # quantized, at the token's combine slot (mxcomm.ep.plan.combine_slots, W = 1: slot t when 1 < k, else the
        # send position of its slot; both copies hold the same rows)
        nslot = T * min(1, k)
        self.nslot = nslot
        self.w = torch.rand(T, k, generator=g).to(dev)
        xs = self.x.float()
        part = torch.zeros(T, H, dtype=torch.float32, device=dev)
        for j in range(k):
            on = (self.plan.dest_row[:, j] >= 0).view(T, 1)
            part = part + torch.where(on, self.w[:, j:j + 1] * xs, torch.zeros((), device=dev))
        qp = quantize(part)
        has = (self.plan.dest_rank >= 0).any(1)  # one rank: every valid slot goes here
        lead = torch.arange(T, device=dev) if 1 < k else self.plan.send_pos[:, 0].long().clamp(min=0)
        self.comb_q = torch.zeros(2, nslot, 2 * H, dtype=torch.uint8, device=dev)
        self.comb_s = torch.zeros(2, nslot, C, dtype=torch.uint8, device=dev)
        for c in range(2):  # row pos of a copy at byte pos * H from the copy's start
            self.comb_q[c].view(-1)[: nslot * H].view(nslot, H)[lead[has]] = qp.qdata.view(torch.uint8)[has]
            self.comb_s[c][lead[has]] = qp.scales.view(torch.uint8).reshape(T, C)[has]
        deq = qp.dequantize(torch.float32, saturate_to=torch.bfloat16)
        self.ref_y = torch.where(has.view(T, 1), deq, torch.zeros((), device=dev)).to(torch.bfloat16)
        # the same rows as a one-rank expert output (bf16, expert-major): quantized they give ref_q, so ref_y holds
        self.own_x = torch.zeros(max(self.R, 1), H, dtype=torch.bfloat16, device=dev)
        self.own_x[self.slot_rows] = self.x[tok]

    def grids(self) -> list[int]:
        """Program counts of the sweep: ``--programs`` per SM, or 'tokens' (one per token)."""
        return [self.T if p == "tokens" else self.sms * int(p) for p in self.args.programs.split(",")]

    def ptrs(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([t.data_ptr()], dtype=torch.int64, device=self.dev)

    def record(self, op: str, impl: str, params: dict, fn, check, nbytes: int | None = None) -> None:
        ok, detail = check(fn)
        timer, us = self.args.timer, float("nan")
        if not self.interp and timer == "graph":
            try:
                us = _graph_median_us(fn, self.args.iters)
            except RuntimeError as exc:  # not capturable: fall back to events, and say so in the result
                torch.cuda.synchronize()
                timer = f"events (graph capture failed: {str(exc)[:120]})"
        if not self.interp and timer != "graph":
            us = _event_median_us(fn, self.args.iters)
        T, H, C, S = self.T, self.H, self.C, self.S
        if nbytes is None:  # the same count for dispatch and reduce (read/write swapped)
            nbytes = T * H * 2 + S * (H + C)
        res = dict(op=op, impl=impl, **params, timer=timer, us=us, gbps=nbytes / (us * 1e-6) / 1e9, bytes=nbytes, correct=ok,
                   **detail)
        self.results.append(res)
        print(json.dumps(res), flush=True)

    # -- dispatch -------------------------------------------------------------------------------
    def dispatch_check(self, q, s, row_major_scales: bool):
        """Payload rows and scales equal the reference (row-major scales at the payload row, or blocked)."""
        def check(fn):
            q.zero_()
            s.zero_()
            fn()
            ok_q = torch.equal(q[self.slot_rows], self.ref_q)
            if row_major_scales:
                got_s = s.view(-1)[: self.R * self.C].view(self.R, self.C)[self.slot_rows]
            else:
                got_s = s[self.boff]
            ok_s = torch.equal(got_s, self.ref_s)
            return bool(ok_q and ok_s), dict(payload_equal=bool(ok_q), scales_equal=bool(ok_s))
        return check

    def bench_dispatch(self, mod, impl: str) -> None:
        """The module's push dispatch (``push_rows_kernel``: row-major scales at the payload rows), the receiver's
        ``copyout`` (``copy_out_rows_kernel``) and ``swizzle`` (``scale_rows_to_grouped_kernel``, byte and word
        columns), and the pull dispatch (``pack`` = ``pack_rows_kernel``, then ``gather`` = ``pull_rows_kernel``
        over the pull list of ``push_entries_kernel``); ``push_path`` / ``pull_path`` time each path's three
        launches in sequence (what a dispatch call runs besides its plan and handshakes; 602 MB counted as for
        ``dispatch``)."""
        a, dev = self.args, self.dev
        T, H, C, R, E = self.T, self.H, self.C, self.R, self.E
        q = torch.empty(R, H, dtype=torch.uint8, device=dev)
        s = torch.empty(R, C, dtype=torch.uint8, device=dev)
        qp, sp = self.ptrs(q), self.ptrs(s)
        flags = torch.zeros(3, 1, dtype=torch.int64, device=dev)
        fp, w = self.ptrs(flags), torch.zeros(1, dtype=torch.float32, device=dev)
        chunk0 = _ints(a.chunks)[0]

        def push(programs, warps, chunk):
            mod.push_rows_kernel[(programs,)](
                self.x, T, self.plan.dest_rank, self.plan.dest_row, qp, sp, fp, 0, 1, H=H, K=self.k, CHUNK=chunk,
                MX=True, MODE=0, INT_ROUND=self.interp, SKIP_EMPTY=False, num_warps=warps)

        for programs in self.grids():
            for warps in _ints(a.warps):
                for chunk in _ints(a.chunks):
                    self.record("dispatch", impl, dict(programs=programs, warps=warps, chunk=chunk, scales="row"),
                                lambda programs=programs, warps=warps, chunk=chunk: push(programs, warps, chunk),
                                self.dispatch_check(q, s, True))
        # receiver side: origin rank (0) of each real row, -1 elsewhere
        src = torch.full((max(R, 1),), -1, dtype=torch.int32, device=dev)
        src[self.slot_rows] = 0
        epoch = torch.ones(1, dtype=torch.int64, device=dev)  # tag 1, parity 1: send copy 1
        send_q = torch.zeros(2, T, H, dtype=torch.uint8, device=dev)
        send_s = torch.zeros(2, T, C, dtype=torch.uint8, device=dev)
        w_in = torch.rand(T, self.k, device=dev)  # the route weights the entries carry
        sqp, ssp = self.ptrs(send_q), self.ptrs(send_s)
        ew = pull_entry_words(self.k)
        plist = torch.zeros(1, T, ew, dtype=torch.int32, device=dev)
        out_q = torch.empty(R, H, dtype=torch.uint8, device=dev)
        cp = round_up(C, 4)
        rows = grouped_m_rows(R, E)
        out_s = torch.empty(rows, cp, dtype=torch.uint8, device=dev)
        cb0 = min(_ints(a.scale_cbs)[0], triton.next_power_of_2(cp))
        word = C % 4 == 0
        words = H // 8
        progs = self.sms * 16

        x_slot = self.ptrs(self.x)  # x by address, as the backend passes it (a captured graph replays any call's x)

        def pack(programs=progs, warps=4, chunk=chunk0):
            mod.pack_rows_kernel[(min(T, programs),)](
                x_slot, T, send_q, send_s, epoch, T, T * H, H=H, CHUNK=chunk, MX=True, MODE=0,
                INT_ROUND=self.interp, num_warps=warps)

        # the pull list of this plan (one entry per token; the entry kernel is part of the plan step, not timed)
        mod.push_entries_kernel[(self.sms,)](self.plan.dest_rank, self.plan.dest_row, w_in, T, self.ptrs(plist), fp,
                                             epoch, 0, 1, T, K=self.k, EW=ew, BLOCK=64, num_warps=4)

        table = torch.empty(T, self.k, dtype=torch.int32, device=dev)  # the dispatch's table (one rank: T entries)
        wtab = torch.empty(T, self.k, dtype=torch.int32, device=dev)  # and its route weights (fp32 bits)

        def copy_rows():
            mod.copy_out_rows_kernel[(min(R, self.sms * 16),)](
                q.view(torch.int64), out_q.view(torch.int64), self.plan.num_rows, src, R, 0, R,
                ROW_WORDS=words, CHUNK=min(512, triton.next_power_of_2(words)), num_warps=4)

        def pull_rows(programs=progs, warps=4, chunk=512):
            mod.pull_rows_kernel[(min(max(R, T), programs),)](
                out_q.view(torch.int64), s, self.plan.offs, self.plan.expert_counts, self.plan.num_rows, E, R, sqp,
                ssp, plist, table, wtab, epoch, T, 1, T * H // 8, ROW_WORDS=words,
                CHUNK=min(chunk, triton.next_power_of_2(words)), C=C, C_POW2=triton.next_power_of_2(C), K=self.k,
                K_POW2=triton.next_power_of_2(self.k), EW=ew, MX=True, num_warps=warps)

        def scale_cb(wordwise, cb):  # word columns: a whole tile-row per program (what the backend launches)
            return triton.next_power_of_2(cp // 4) if wordwise else min(cb, triton.next_power_of_2(cp))

        def scales(wordwise=word, cb=cb0, warps=4):
            ncols = cp // 4 if wordwise else cp
            cb = scale_cb(wordwise, cb)
            mod.scale_rows_to_grouped_kernel[(rows // 128, triton.cdiv(ncols, cb))](
                s.view(torch.int32) if wordwise else s, out_s.view(torch.int32) if wordwise else out_s,
                self.plan.offs, self.plan.num_rows, self.plan.expert_counts, E, cp // 4, C=C, CB=cb,
                G_POW2=triton.next_power_of_2(E), WORD=wordwise, TAIL=True, num_warps=warps)  # exact sizes

        def rows_check(fn):
            out_q.fill_(0xAB)
            fn()
            ok = torch.equal(out_q[self.slot_rows], self.ref_q)
            pad = torch.ones(R, dtype=torch.bool, device=dev)
            pad[self.slot_rows] = False
            zero = bool((out_q[pad] == 0).all())
            return bool(ok and zero), dict(payload_equal=bool(ok), padding_zero=zero)

        def scales_check(fn):
            out_s.fill_(0xAB)
            fn()
            flat = out_s.view(-1)
            ok = torch.equal(flat[self.boff], self.ref_s)
            rest = torch.ones_like(flat, dtype=torch.bool)
            rest[self.boff.reshape(-1)] = False
            zero = bool((flat[rest] == 0).all())  # padding written as zeros (0xAB = never written)
            return bool(ok and zero), dict(scales_equal=bool(ok), padding_zero=zero)

        def pack_check(fn):
            send_q.zero_()
            send_s.zero_()
            fn()
            ok_q = torch.equal(send_q[1], self.ref_q_tok)  # epoch 1: copy 1
            ok_s = torch.equal(send_s[1], self.ref_s_tok)
            return bool(ok_q and ok_s), dict(payload_equal=bool(ok_q), scales_equal=bool(ok_s))

        def both(check_a, check_b):
            def check(fn):
                ok_a, da = check_a(fn)
                ok_b, db = check_b(fn)
                return ok_a and ok_b, {**{f"rows_{k}": v for k, v in da.items()}, **{f"scales_{k}": v for k, v in db.items()}}
            return check

        n_rows_bytes = self.S * H + R * H  # real rows read, every output row written
        n_scale_bytes = self.S * C + out_s.numel()
        push(self.grids()[0], _ints(a.warps)[0], chunk0)  # recv_q / recv_s hold this plan's rows
        self.record("copyout", impl, dict(programs=min(R, progs)), copy_rows, rows_check, nbytes=n_rows_bytes)
        for wordwise in sorted({False, word}):
            for cb in sorted({scale_cb(wordwise, c) for c in _ints(a.scale_cbs)}):
                for warps in _ints(a.warps):
                    ncols = cp // 4 if wordwise else cp
                    self.record("swizzle", impl, dict(programs=rows // 128 * triton.cdiv(ncols, cb), warps=warps,
                                                      chunk=cb, word=wordwise),
                                lambda wordwise=wordwise, cb=cb, warps=warps: scales(wordwise, cb, warps), scales_check,
                                nbytes=n_scale_bytes)
        for programs in self.grids():
            for warps in _ints(a.warps):
                for chunk in _ints(a.chunks):
                    self.record("pack", impl, dict(programs=min(T, programs), warps=warps, chunk=chunk),
                                lambda programs=programs, warps=warps, chunk=chunk: pack(programs, warps, chunk),
                                pack_check, nbytes=T * H * 2 + T * (H + C))
        pack()
        s.zero_()  # the gather stages the scale rows here again
        # pull gather: each token row (and scale row) read once, stored at every selection's row; padding zeroed
        for programs, warps, gchunk in itertools.product(self.grids(), _ints(a.warps), _ints(a.gather_chunks)):
            self.record("gather", impl, dict(programs=min(max(R, T), programs), warps=warps, chunk=gchunk),
                        lambda programs=programs, warps=warps, gchunk=gchunk: pull_rows(programs, warps, gchunk),
                        both(rows_check, lambda fn: scales_check(lambda: (fn(), scales()))),
                        nbytes=T * (H + C) + R * H + self.S * C)
        g0, w0 = self.grids()[0], _ints(a.warps)[0]
        self.record("push_path", impl, dict(programs=g0, warps=w0, chunk=chunk0),
                    lambda: (push(g0, w0, chunk0), copy_rows(), scales()), both(rows_check, scales_check))
        self.record("pull_path", impl, dict(programs=progs, warps=4, chunk=chunk0),
                    lambda: (pack(), pull_rows(), scales()), both(rows_check, scales_check))
        if hasattr(mod, "local_rows_kernel"):  # the local path (one rank): straight into the output

            def local():
                mod.local_rows_kernel[(g0,)](
                    self.x, T, self.plan.dest_rank, self.plan.dest_row, out_q, sp, w, self.plan.offs,
                    self.plan.expert_counts, self.plan.num_rows, R, E, H=H, K=self.k, CHUNK=chunk0, MX=True, MODE=0,
                    INT_ROUND=self.interp, WEIGHTED=False, num_warps=w0)
                scales()

            self.record("local_path", impl, dict(programs=g0, warps=w0, chunk=chunk0), local,
                        both(rows_check, scales_check))

    def bench_naive(self) -> None:
        q = torch.empty(self.R, self.H, dtype=torch.uint8, device=self.dev)
        s_rows = torch.empty(self.R * self.C, dtype=torch.uint8, device=self.dev)
        s_blk = torch.empty(self.s_bytes, dtype=torch.uint8, device=self.dev)
        for blocked in self.layouts:
            s = s_blk if blocked else s_rows
            for programs in self.grids():
                for warps in _ints(self.args.warps):
                    for chunk in _ints(self.args.chunks):
                        fn = (lambda programs=programs, warps=warps, chunk=chunk, s=s, blocked=blocked:
                              naive_dispatch_kernel[(programs,)](
                                  self.x, self.T, self.plan.dest_row, self.srow, q, s, self.n_col_tiles, H=self.H,
                                  K=self.k, CHUNK=chunk, INT_ROUND=self.interp, BLOCKED=blocked, num_warps=warps))
                        self.record("dispatch", "naive", dict(programs=programs, warps=warps, chunk=chunk,
                                                              scales="blocked" if blocked else "row"),
                                    fn, self.dispatch_check(q, s, not blocked))

    def bench_pattern(self) -> None:
        """Ceilings of the dispatch's access pattern on this GPU, same bytes and rows as ``dispatch``
        (``pattern_scatter_kernel``: ``scatter`` plain loads and stores, ``scatter_tma_load`` /
        ``scatter_tma_store`` / ``scatter_tma`` through tensor descriptors (GPU, ``H % 256 == 0``), ``write_only``
        without the reads, counted ``S*(H + H/32)``), plus ``torch_copy`` (``dst.copy_(src)`` moving the same
        byte count: half read, half written) and ``torch_zero`` (``zero_()`` of that many bytes)."""
        from triton.tools.tensor_descriptor import TensorDescriptor

        T, H, C, R, dev = self.T, self.H, self.C, self.R, self.dev
        xi = self.x.view(torch.int16)
        q = torch.empty(max(R, 1), H, dtype=torch.uint8, device=dev)
        s = torch.empty(max(R, 1), C, dtype=torch.uint8, device=dev)
        tok = self.slot_tok
        cols = torch.arange(C, device=dev)
        want_s = ((tok[:, None] + cols[None, :]) & 255).to(torch.uint8)

        def check_for(load, chunk):
            if load:
                want_q = (xi >> 8).to(torch.uint8)[tok]
            else:  # byte t + offset within the chunk
                want_q = ((tok[:, None] + torch.arange(H, device=dev)[None, :] % chunk) & 255).to(torch.uint8)

            def check(fn):
                q.zero_()
                s.zero_()
                fn()
                ok_q = torch.equal(q[self.slot_rows], want_q)
                ok_s = torch.equal(s[self.slot_rows], want_s)
                return bool(ok_q and ok_s), dict(payload_equal=bool(ok_q), scales_equal=bool(ok_s))
            return check

        tma = not self.interp and H % 256 == 0
        variants = [("scatter", True, False, False), ("write_only", False, False, False)]
        if tma:
            variants += [("scatter_tma_load", True, True, False), ("scatter_tma_store", True, False, True),
                         ("scatter_tma", True, True, True)]
        for name, load, tma_load, tma_store in variants:
            for programs in self.grids():
                for warps in _ints(self.args.warps):
                    for chunk in _ints(self.args.chunks):
                        if (tma_load or tma_store) and chunk % 256:
                            continue
                        blk = [1, chunk // 256, 256]
                        xd = TensorDescriptor.from_tensor(xi.view(T, H // 256, 256), blk) if tma_load else xi
                        qd = TensorDescriptor.from_tensor(q.view(-1, H // 256, 256), blk) if tma_store else q
                        fn = (lambda programs=programs, warps=warps, chunk=chunk, load=load, tl_=tma_load, ts=tma_store,
                              xd=xd, qd=qd: pattern_scatter_kernel[(programs,)](
                                  xi, xd, T, self.plan.dest_row, qd, s, H=H, K=self.k, CHUNK=chunk, LOAD=load,
                                  TMA_LOAD=tl_, TMA_STORE=ts, num_warps=warps))
                        self.record("pattern", name, dict(programs=programs, warps=warps, chunk=chunk), fn,
                                    check_for(load, chunk), nbytes=None if load else self.S * (H + C))
        if not self.interp:
            nbytes = T * H * 2 + self.S * (H + C)
            src = torch.randint(0, 256, (nbytes // 2,), dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)

            def copied(fn):
                dst.zero_()
                fn()
                return bool(torch.equal(dst, src)), {}
            self.record("pattern", "torch_copy", {}, lambda: dst.copy_(src), copied, nbytes=2 * (nbytes // 2))
            del src, dst
            buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)

            def zeroed(fn):
                buf.fill_(1)
                fn()
                return bool((buf == 0).all()), {}
            self.record("pattern", "torch_zero", {}, lambda: buf.zero_(), zeroed, nbytes=nbytes)

    # -- combine reduce ------------------------------------------------------------------------
    def bench_reduce(self, mod, impl: str) -> None:
        a = self.args
        y = torch.empty(self.T, self.H, dtype=torch.bfloat16, device=self.dev)
        epoch = torch.zeros(1, dtype=torch.int64, device=self.dev)
        kern = mod.combine_reduce_kernel

        def check(fn):
            y.zero_()
            fn()
            d = (y.float() - self.ref_y.float()).abs()
            tol = self.ref_y.float().abs() * 2.0 ** -7 + 1e-30  # one bf16 rounding step
            ok = bool((d <= tol).all())
            return ok, dict(max_abs_diff=float(d.max()) if d.numel() else 0.0)

        own = getattr(mod, "local_reduce_kernel", None)  # one rank: the partial formed from the expert rows
        args = (self.comb_q, self.comb_s, self.plan.send_pos, self.plan.dest_rank, y, self.T, epoch, self.nslot, 1)
        own_args = (self.own_x, self.comb_s, self.plan.dest_rank, self.plan.dest_row, self.w, y, self.T)
        for programs in self.grids():
            for warps in _ints(a.warps):
                for chunk in _ints(a.chunks):
                    fn = (lambda programs=programs, warps=warps, chunk=chunk: kern[(programs,)](
                        *args, H=self.H, K=self.k, P=1, CHUNK=chunk, MX=True, INT_ROUND=self.interp,
                        num_warps=warps, enable_fp_fusion=False))
                    self.record("reduce", impl, dict(programs=programs, warps=warps, chunk=chunk), fn, check,
                                nbytes=self.T * (self.H + self.H // 32) + self.T * self.H * 2)
                    if own is not None:  # one rank: every slot's row read as bf16, summed, quantized here
                        fn = (lambda programs=programs, warps=warps, chunk=chunk: own[(programs,)](
                            *own_args, H=self.H, K=self.k, CHUNK=chunk, MX=True, PASS=False, WEIGHTED=True, MODE=0,
                            INT_ROUND=self.interp, num_warps=warps, enable_fp_fusion=False))
                        self.record("reduce_own", impl, dict(programs=programs, warps=warps, chunk=chunk), fn, check,
                                    nbytes=self.S * self.H * 2 + self.T * self.H * 2)

    def bench_reduce_ranks(self, mod, impl: str) -> None:
        """``reduce_ranks`` (see the module doc): the origin's reduce of one MXFP8 partial per (token, rank)."""
        a, T, H, k, E, C, dev = self.args, self.T, self.H, self.k, self.E, self.C, self.dev
        W = a.world
        if E % W:
            raise SystemExit(f"--experts {E} is not a multiple of --world {W}")
        dest_rank = torch.where(self.idx >= 0, self.idx // (E // W), -1).to(torch.int32)
        counts = local_counts(self.idx, E)
        plan = build_plan(counts[None].expand(W, E).contiguous(), self.idx, 0, a.align)
        send_pos = plan.send_pos
        g = torch.Generator().manual_seed(1)
        y_ref = torch.zeros(T, H, dtype=torch.float32, device=dev)
        nslot = T * min(W, k)  # (mxcomm.ep.plan.combine_slots)
        comb_q = torch.zeros(2, nslot, 2 * H, dtype=torch.uint8, device=dev)
        comb_s = torch.zeros(2, nslot, C, dtype=torch.uint8, device=dev)
        seen = torch.zeros(T, W, dtype=torch.bool, device=dev)
        P = 0
        for j in range(k):  # slot j leads its rank when no earlier slot of the token goes there
            r = dest_rank[:, j].long()
            lead = (r >= 0) & ~seen.gather(1, r.clamp(min=0)[:, None])[:, 0]
            seen.scatter_(1, r.clamp(min=0)[:, None], seen.gather(1, r.clamp(min=0)[:, None]) | lead[:, None])
            n = int(lead.sum())
            if not n:
                continue
            qp = quantize(torch.randn(n, H, generator=g).to(dev))
            # the token's combine slot for rank r: t * W + r when W < k, else the leading slot's send position
            pos = (torch.arange(T, device=dev) * W + r)[lead] if W < k else send_pos[:, j].long()[lead]
            comb_q[0].view(-1)[: nslot * H].view(nslot, H)[pos] = qp.qdata.view(torch.uint8)
            comb_s[0][pos] = qp.scales.view(torch.uint8).reshape(n, C)
            y_ref[lead] = y_ref[lead] + qp.dequantize(torch.float32, saturate_to=torch.bfloat16)
            P += n
        ref = y_ref.to(torch.bfloat16)
        y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        epoch = torch.zeros(1, dtype=torch.int64, device=dev)
        kern = mod.combine_reduce_kernel

        def check(fn):
            y.zero_()
            fn()
            d = (y.float() - ref.float()).abs()
            ok = bool((d <= ref.float().abs() * 2.0 ** -7 + 1e-30).all())
            return ok, dict(max_abs_diff=float(d.max()) if d.numel() else 0.0)

        for programs in self.grids():
            for warps in _ints(a.warps):
                for chunk in _ints(a.chunks):
                    fn = (lambda programs=programs, warps=warps, chunk=chunk: kern[(programs,)](
                        comb_q, comb_s, send_pos, dest_rank, y, T, epoch, nslot, W, H=H, K=k, P=min(k, W),
                        CHUNK=chunk, MX=True, INT_ROUND=self.interp, num_warps=warps, enable_fp_fusion=False))
                    self.record("reduce_ranks", impl, dict(programs=programs, warps=warps, chunk=chunk, world=W,
                                                           partials=P), fn, check, nbytes=P * (H + C) + T * H * 2)

    def expert_side_world(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0 of a ``W``-rank world holds experts ``[0, E / W)``; source 0 routes like the other ops, the other
        sources at random. Returns the dispatch's table here (int32 ``[W * T, k]``: each (source, token)'s expert-major
        rows per slot, -1 elsewhere; CPU) and the ``[R, 3]`` (source, token, slot) of every row ``0..R-1``."""
        a, T, k, E = self.args, self.T, self.k, self.E
        W = a.world
        if E % W:
            raise SystemExit(f"--experts {E} is not a multiple of --world {W}")
        ids = [self.idx.cpu()]
        for _ in range(1, W):
            i = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k].to(torch.int32)
            if a.drop:
                i[torch.rand(T, k, generator=g) < a.drop] = -1
            ids.append(i)
        idx = torch.stack(ids)  # [W, T, k]
        here = (idx >= 0) & (idx < E // W)  # rank 0 holds experts [0, E / W)
        src, tok, slot = here.nonzero(as_tuple=True)
        order = torch.argsort(idx[src, tok, slot].long() * (W * T) + src * T + tok, stable=True)  # expert-major
        src, tok, slot = src[order], tok[order], slot[order]
        table = torch.full((W * T, k), -1, dtype=torch.int32)
        table[src * T + tok, slot] = torch.arange(int(src.numel()), dtype=torch.int32)
        return table, torch.stack([src, tok, slot], 1)

    def made_once(self, op: str, make) -> SimpleNamespace:
        """``make()`` for ``op`` the first time, then the same inputs, reference and buffers for every module timed."""
        if op not in self.worlds:
            self.worlds[op] = make()
        return self.worlds[op]

    def partials_world(self) -> SimpleNamespace:
        """The inputs, reference and buffers of ``partials_ranks``."""
        T, H, k, C, dev = self.T, self.H, self.k, self.C, self.dev
        W = self.args.world
        g = torch.Generator().manual_seed(2)
        table, rows = self.expert_side_world(g)
        tok, slot = rows[:, 1], rows[:, 2]
        R = int(rows.shape[0])
        origin_pos = (tok * k + slot).to(torch.int32)  # a slot's send position at its origin (one per (t, j))
        out = torch.randn(max(R, 1), H, generator=g).to(torch.bfloat16)
        ws = torch.rand(W, T, k, generator=g)
        nslot = T * min(W, k)  # (mxcomm.ep.plan.combine_slots)
        # reference: each listed entry's partial, products rounded then added in slot order, quantized once
        listed = (table >= 0).any(1).nonzero()[:, 0]
        part = torch.zeros(int(listed.numel()), H, dtype=torch.float32)
        for j in range(k):
            r = table[listed, j].long()
            on = (r >= 0)[:, None]
            prod = ws.reshape(W * T, k)[listed, j][:, None] * out[r.clamp(min=0)].float()
            part = part + torch.where(on, prod, torch.zeros(()))
        ref = quantize(part)
        lead_slot = torch.argmax((table[listed] >= 0).to(torch.int32), dim=1)
        table, origin_pos, out, ws = (t.to(dev) for t in (table, origin_pos, out, ws))
        comb_q = [torch.zeros(2, nslot, 2 * H, dtype=torch.uint8, device=dev) for _ in range(W)]
        comb_s = [torch.zeros(2, nslot, C, dtype=torch.uint8, device=dev) for _ in range(W)]
        flags = [torch.zeros(6, W, dtype=torch.int64, device=dev) for _ in range(W)]
        ptrs = {name: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev)
                for name, ts in (("q", comb_q), ("s", comb_s), ("f", flags))}
        return SimpleNamespace(table=table, R=R, origin_pos=origin_pos, out=out, nslot=nslot, listed=listed, ref=ref,
                               # the combine slot of (token, this rank 0): t * W when W < k, else the leading send
                               # position
                               ref_pos=(listed % T) * W if W < k else (listed % T) * k + lead_slot,
                               ref_src=listed // T, comb_q=comb_q,
                               comb_s=comb_s, flags=flags, ptrs=ptrs, ws=ws,  # ws: fp32 [W, T, k], by table entry
                               epoch=torch.zeros(1, dtype=torch.int64, device=dev),
                               err=torch.zeros(1, dtype=torch.int64, device=dev))

    def bench_partials_ranks(self, mod, impl: str) -> None:
        """``partials_ranks`` (see the module doc): the expert side of a ``W``-rank world, one MXFP8 partial per
        (source, token) that lists rows here."""
        a, T, H, k, C, dev = self.args, self.T, self.H, self.k, self.C, self.dev
        W = a.world
        v = self.made_once("partials_ranks", self.partials_world)
        table, R, origin_pos, out, nslot, listed, ref = v.table, v.R, v.origin_pos, v.out, v.nslot, v.listed, v.ref
        ref_pos, ref_src, comb_q, comb_s, flags, ptrs, epoch = (v.ref_pos, v.ref_src, v.comb_q, v.comb_s, v.flags,
                                                                v.ptrs, v.epoch)
        kern = mod.combine_partials_kernel

        def check_for(programs):
            def check(fn):
                for t in comb_q + comb_s + flags:
                    t.zero_()
                fn()
                ok = all(int(f[2, 0]) == programs for f in flags)  # every program arrived at every rank once
                for s_ in range(W):
                    mine = ref_src == s_
                    pos = ref_pos[mine].to(dev)
                    got_q = comb_q[s_][0].view(-1)[: nslot * H].view(nslot, H)[pos]
                    ok = ok and torch.equal(got_q.cpu(), ref.qdata.view(torch.uint8)[mine])
                    ok = ok and torch.equal(comb_s[s_][0][pos].cpu(), ref.scales.view(torch.uint8).reshape(-1, C)[mine])
                return ok, dict(entries=int(listed.numel()))
            return check

        for programs in self.grids():
            for warps in _ints(a.warps):
                for chunk in _ints(a.chunks):
                    for rows in _ints(a.rows):
                        fn = (lambda programs=programs, warps=warps, chunk=chunk, rows=rows: kern[(programs,)](
                            out, comb_s[0], table, origin_pos, v.ws, ptrs["q"], ptrs["s"], ptrs["f"], 0, W, T,
                            epoch, nslot, v.err, H=H, K=k, P=min(k, W), CHUNK=chunk, MX=True, PASS=False,
                            WEIGHTED=True, MODE=0, INT_ROUND=self.interp, ROWS=rows, num_warps=warps,
                            enable_fp_fusion=False))
                        self.record("partials_ranks", impl, dict(programs=programs, warps=warps, chunk=chunk,
                                                                 rows=rows, world=W, expert_rows=R),
                                    fn, check_for(programs), nbytes=R * H * 2 + int(listed.numel()) * (H + C))

    def weighted_world(self) -> SimpleNamespace:
        """The inputs, reference and buffers of ``weighted_ranks``."""
        T, H, k, C, dev = self.T, self.H, self.k, self.C, self.dev
        W = self.args.world
        g = torch.Generator().manual_seed(3)
        table, rows = self.expert_side_world(g)
        src, tok, slot = rows[:, 0], rows[:, 1], rows[:, 2]
        R = int(rows.shape[0])
        entries = int((table >= 0).any(1).sum())
        grads = (torch.randn(W, T, H, generator=g) * 2).to(torch.bfloat16)  # each source's send copy (one copy)
        ws = torch.randn(W, T, k, generator=g)
        out = torch.randn(max(R, 1), H, generator=g).to(torch.bfloat16)
        ref = quantize(ws[src, tok, slot][:, None] * grads[src, tok].float())  # w * g, quantized per row
        prods = grads[src, tok].double() * out[:R].double()
        ref_gw, gw_tol = prods.sum(1), 2e-5 * prods.abs().sum(1) + 1e-6  # fp32 sums in another order: within this
        table, out, grads, ws = (t.to(dev) for t in (table, out, grads, ws))
        dst = torch.empty(max(R, 1), H, dtype=torch.uint8, device=dev)
        dst_s = torch.empty(max(R, 1), C, dtype=torch.uint8, device=dev)
        gw = [torch.zeros(T, k, device=dev) for _ in range(W)]
        flags = [torch.zeros(6, W, dtype=torch.int64, device=dev) for _ in range(W)]
        ptrs = {name: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev)
                for name, ts in (("g", list(grads)), ("w", list(ws)), ("gw", gw), ("f", flags))}
        one_group = torch.tensor([R], dtype=torch.int32, device=dev)  # offs = counts = [R]: no padding rows
        epoch = torch.zeros(1, dtype=torch.int64, device=dev)
        # grads, ws, gw and flags are kept: ptrs holds their addresses
        return SimpleNamespace(table=table, src=src, tok=tok, slot=slot, R=R, entries=entries, grads=grads, ws=ws,
                               out=out, ref=ref, ref_gw=ref_gw, gw_tol=gw_tol, dst=dst, dst_s=dst_s, gw=gw,
                               flags=flags, ptrs=ptrs, one_group=one_group, epoch=epoch)

    def bench_weighted_ranks(self, mod, impl: str) -> None:
        """``weighted_ranks`` (see the module doc): combine backward's expert side of a ``W``-rank world, with the
        route-weight gradient."""
        a, T, H, k, C = self.args, self.T, self.H, self.k, self.C
        W = a.world
        v = self.made_once("weighted_ranks", self.weighted_world)
        src, tok, slot, R, entries = v.src, v.tok, v.slot, v.R, v.entries
        ref, ref_gw, gw_tol, table, out = v.ref, v.ref_gw, v.gw_tol, v.table, v.out
        dst, dst_s, gw, flags, ptrs, one_group, epoch = v.dst, v.dst_s, v.gw, v.flags, v.ptrs, v.one_group, v.epoch
        kern = mod.pull_weighted_kernel

        def check_for(programs):
            def check(fn):
                for t in [dst, dst_s] + gw + flags:
                    t.zero_()
                fn()
                ok = all(int(f[4, 0]) == programs for f in flags)  # every program arrived at every rank once
                ok = ok and torch.equal(dst[:R].cpu(), ref.qdata.view(torch.uint8))
                ok = ok and torch.equal(dst_s[:R].cpu(), ref.scales.view(torch.uint8).reshape(R, C))
                got_gw = torch.stack(gw).cpu()[src, tok, slot].double()
                err = float((got_gw - ref_gw).abs().max()) if R else 0.0
                ok = ok and bool(((got_gw - ref_gw).abs() <= gw_tol).all())
                return ok, dict(entries=entries, gw_max_abs_diff=err)
            return check

        for programs in self.grids():
            for warps in _ints(a.warps):
                for chunk in _ints(a.chunks):
                    fn = (lambda programs=programs, warps=warps, chunk=chunk: kern[(programs,)](
                        dst, dst_s, one_group, one_group, one_group, 1, R, ptrs["g"], ptrs["w"], table, epoch, T, W,
                        0, 0, out, ptrs["gw"], ptrs["f"], 0, H=H, CHUNK=chunk, K=k, K_POW2=triton.next_power_of_2(k),
                        MX=True, MODE=0, INT_ROUND=self.interp, ZCHUNK=512, ROUTE_GRAD=True, num_warps=warps))
                    self.record("weighted_ranks", impl, dict(programs=programs, warps=warps, chunk=chunk, world=W,
                                                             expert_rows=R),
                                fn, check_for(programs), nbytes=entries * H * 2 + R * (2 * H + H + C))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--align", type=int, default=32)
    ap.add_argument("--drop", type=float, default=0.0, help="fraction of slots dropped (-1)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--world", type=int, default=4,
                    help="reduce_ranks / partials_ranks / weighted_ranks: ranks the experts are spread over")
    ap.add_argument("--timer", choices=("graph", "events"), default="graph",
                    help="graph: 10 launches captured in a CUDA graph, replay time / 10 (kernel time, no host launch "
                         "gaps); events: CUDA events around one eager launch (it includes "
                         "part of the host's launch time, up to ~30 µs per Triton launch)")
    ap.add_argument("--ops", default="dispatch,naive,reduce")
    ap.add_argument("--impls", default="mxcomm.ep.nvshmem.kernels")
    ap.add_argument("--programs", default="4,tokens", help="programs per SM, or 'tokens' (one per token)")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--chunks", default="1024")
    ap.add_argument("--rows", default="2",
                    help="partials_ranks: listed rows summed a step (LaunchConfig.partials_rows)")
    ap.add_argument("--gather-chunks", default="512", help="8-byte words per row chunk of the pull gather")
    ap.add_argument("--scale-cbs", default="32", help="scale columns per program of the swizzle (bytes; the word variant covers a row)")
    ap.add_argument("--scales", default="row,blocked", help="scale layouts of the naive kernel: row,blocked")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ep_kernels.json"))
    args = ap.parse_args()
    lab = Lab(args)
    ops = args.ops.split(",")
    for name in args.impls.split(","):
        mod = importlib.import_module(name)
        if "dispatch" in ops:
            lab.bench_dispatch(mod, name)
        if "reduce" in ops:
            lab.bench_reduce(mod, name)
        if "reduce_ranks" in ops:
            lab.bench_reduce_ranks(mod, name)
        if "partials_ranks" in ops:
            lab.bench_partials_ranks(mod, name)
        if "weighted_ranks" in ops:
            lab.bench_weighted_ranks(mod, name)
    if "naive" in ops:
        lab.bench_naive()
    if "pattern" in ops:
        lab.bench_pattern()
    out = dict(benchmark="ep_kernels", machine=machine(), versions=versions(),
               config=dict(tokens=lab.T, hidden=lab.H, topk=lab.k, experts=lab.E, align=args.align, drop=args.drop,
                           selections=lab.S, rows=lab.R),
               byte_accounting="T*H*2 (bf16 tokens) + S*(H + H/32) (MXFP8 rows, one per selection): dispatch reads "
                               "the first and writes the second, reduce the reverse",
               results=lab.results)
    if not lab.interp:
        out["copy_ceiling_gbps"] = device_copy(lab.dev, iters=args.iters)["gbps"]
        for r in lab.results:
            r["vs_copy_ceiling"] = r["gbps"] / out["copy_ceiling_gbps"]
        print(f"copy ceiling {out['copy_ceiling_gbps']:.0f} GB/s", flush=True)
        scat = [r["gbps"] for r in lab.results if r["op"] == "pattern" and r["impl"].startswith("scatter")]
        if scat:  # the fastest plain move of the dispatch's bytes, rows and order, without the quantization
            out["pattern_ceiling_gbps"] = max(scat)
            for r in lab.results:
                if r["op"] in ("dispatch", "local_path"):
                    r["vs_pattern_ceiling"] = r["gbps"] / out["pattern_ceiling_gbps"]
            print(f"pattern ceiling (scatter without quantization) {out['pattern_ceiling_gbps']:.0f} GB/s", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    bad = [r for r in lab.results if not r["correct"]]
    if bad:
        raise SystemExit(f"{len(bad)} run(s) gave wrong output: {bad}")


if __name__ == "__main__":
    main()
