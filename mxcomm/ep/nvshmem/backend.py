"""The ``nvshmem`` EP backend: dispatch/combine kernels that quantize in registers and write into
peers' NVSHMEM symmetric buffers (peer pointers, release/acquire flags at system scope, bounded waits).

This module is the engine every path shares (epochs, flags and counts, error words and bounded waits, the routing
plan and its captured graphs, output formatting, the reduce at the origin, the compiled-op state);
:mod:`mxcomm.ep.nvshmem.paths` holds one class per path (local, pull, push, put), each owning its buffers and
launching its kernels (:mod:`mxcomm.ep.nvshmem.kernels`). docs/design.md describes the protocol.

One call of :meth:`NvshmemBackend.dispatch` with the default pull dispatch (``transport="auto"`` on one node), all
on the current CUDA stream:

1. the middle, replayed from a CUDA graph captured per token count (:meth:`NvshmemBackend.run_middle`), three
   launches: ``pull_head_kernel`` (the device-side id check and this rank's per-expert counts; its last program
   advances the epoch and publishes the counts and a refusal word into every peer; every program packs token rows,
   each read once and quantized once, into this rank's send copy while the counts travel),
   ``scan_and_wait_kernel`` (the plan's per-block slot table; its last program waits for every peer's counts),
   ``plan_entries_kernel`` (the routing plan on the exchanged counts plus each received row's origin, and one
   pull-list entry per (token, destination rank) as the slots are placed; its last program waits for every
   source's entries); with ``plan_impl="torch"`` (tables too large for the Triton plan) the same steps in separate
   launches and torch ops.
   The copy of the status words the host sync reads and the copy of the plan the handle keeps (the checked ids and
   the plan share one buffer) are enqueued right after it, while the device still runs it;
2. exact sizes: the call's ONE host sync (:meth:`mxcomm.ep.nvshmem.status_words.StatusWords.check`): the output size,
   the error words and the refusals, one transfer; a rank with bad ids raises the detailed ValueError, the others
   PeerTimeout naming it, before anything is gathered;
3. ``pull_rows_kernel``: each listed token's row read once from its source's send copy through the peer pointer and
   stored at all its rows of a fresh output tensor (the entries kept as the dispatch's table), padding rows zero;
   ``scale_rows_to_grouped_kernel``: the scale rows into a fresh grouped-along-M blocked matrix.

Why pull: pushing the quantized rows into the receiver's symmetric buffer (``transport="push"``) still needs a copy
out of that buffer, because it is reused by the next call and results must not alias it. Pulling folds that copy
into the transfer, and a token row crosses the link once per destination RANK, not once per selected expert.

Combine and dispatch backward move one row per (token, rank) back: combine publishes the route weights to every
rank, each expert rank forms the weighted partial sum of a token's rows on it in fp32 and rounds it once
(``combine_partials_kernel``), and the origin sums the partials (``combine_reduce_kernel``). Combine backward brings
each BF16 gradient row once per (token, rank) to the expert rank, which weights and quantizes it per slot where it
lands and forms the route-weight gradient from the expert rows there (``pull_weighted_kernel``). None of them syncs
with the host. One rank (``"local"``): nothing travels; dispatch writes its output directly (``local_rows_kernel``;
an exact-size dispatch of a few tokens is one captured call, :mod:`mxcomm.ep.nvshmem.call_graph`),
the reduce forms the one partial from the expert rows in place (``local_reduce_kernel``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...kernels.mx_device import SCALE_MODE_IDS
from ...kernels.launch import cdiv, fast_kernel, next_pow2
from ...mx import MXTensor, ScaleLayout, grouped_m_rows, round_up
from ... import transport as tp
from ..config import EPConfig
from .launch_config import LaunchConfig
from . import plan_kernels
from ..handle import CombineGrads, CombineSaved, DispatchResult, EPHandle
from ..plan import (FLAG_ROWS, RoutingPlan, buffer_regions, call_output_rows, combine_slots, dispatch_path,
                    local_counts, max_recv_rows)
from .call_graph import CallGraph, CallGraphRing, CallOutputs, CallShape, CapturedCall, PlanLayout
from .plan_graph import PlanGraph, PlanOutputs, compute_plan
from .paths import PATHS, PUSH_BLOCK, fp32_weights
from .state import NvshmemState, RowOrigins, handle_origins, row_origins
from .status_words import StatusWords

_MAX_PLAN_GRAPHS = 16  # captured plan graphs kept per backend (least recently used dropped)


@dataclass(frozen=True)
class GroupedScalesLaunch:
    """How ``scale_rows_to_grouped_kernel`` (or its captured-call twin) fills a grouped blocked scale matrix: its
    ``grid``, ``word`` (4-byte columns: ``H`` a multiple of 128), ``n_col_tiles`` 4-column tiles per tile-row, and
    the constexprs ``C`` (``H / 32``), ``CB``, ``G_POW2``."""

    grid: tuple
    word: bool
    n_col_tiles: int
    C: int
    CB: int
    G_POW2: int


class NvshmemBackend:
    """GPU backend over NVSHMEM symmetric buffers (see module doc). Built by ``EPGroup``.

    NVSHMEM is initialised through ``mxcomm.transport.init_nvshmem(group=group)`` (or joins an
    existing initialisation). The symmetric buffers are allocated once here.
    """

    device_side_checks = True  # expert ids are checked here (see checked_ids), not by the group

    def __init__(self, config: EPConfig, group, rank: int, world_size: int, *, group_id: int = 0, bounded=None,
                 heap=None, puts=None):
        self.config = config
        self.group_id = group_id
        self.bounded = bounded  # the group's BoundedGroup (bootstrap side channel); the data path waits on the device
        self.rank, self.world = rank, world_size
        if heap is None:
            heap = self._open_heap(group, rank, world_size)
        self.heap = heap
        self.device = heap.ctx.device
        W = world_size
        self.El = config.num_local_experts(W)
        self.R_max = max_recv_rows(config, W)
        self.mx = config.precision == "mxfp8"
        if config.num_sms is not None:
            sms = config.num_sms
        elif self.device.type == "cuda":
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:  # Triton interpreter (tests of the data path on CPU)
            sms = 1
        self.sms = sms
        self.launch = config.launch if config.launch is not None else LaunchConfig()
        # routing plan: "triton" (mxcomm.ep.nvshmem.plan_kernels: the id check + counts + per-block slot table in two
        # kernels, the plan in one, bit-identical to the torch ops) where its tables fit, else "torch" (~60 torch ops,
        # on the GPU replayed from a CUDA graph captured per token count)
        self.plan_impl = "triton" if plan_kernels.fits(W, config.num_experts) else "torch"
        # the per-block slot table of this call's ids (check_and_count or the pull head writes it, the plan reads it):
        # a fixed address, so the captured plan reads the current call's table
        self.slot_prefix = (torch.empty(plan_kernels.slot_blocks(config.max_tokens_per_rank, config.topk)
                                        * (config.num_experts + 1), dtype=torch.int32, device=self.device)
                            if self.plan_impl == "triton" else None)
        self.int_round = self.device.type != "cuda"  # the interpreter's fp8 cast is not RNE
        # put-with-signal path: forced by the config, or needed because a peer has no peer pointer
        self.put_mode = config.transport == "put" or not getattr(heap.ctx, "all_local", True)
        # towards the experts: "pull" (the default on one node: receivers read the packed rows through peer
        # pointers), "local" (one rank: straight into the output), "push" or "put" (mxcomm.ep.plan.dispatch_path)
        self.path = dispatch_path(config, W, self.put_mode)
        self.local = self.path == "local"
        bufs = {r.name: self.heap.alloc(r.name, r.shape, r.dtype) for r in buffer_regions(config, W, self.put_mode)}
        self.nslot = combine_slots(config, W)  # slots of a comb_q copy
        E = config.num_experts
        # partials returned by combine, 2 copies (see kernels.combine); none on the local path
        self.comb = (bufs["ep.comb_q"], bufs["ep.comb_s"]) if "ep.comb_q" in bufs else None
        self.counts, self.flags = bufs["ep.counts"], bufs["ep.flags"]
        self.counts_mat = self.counts.local[:W * E].view(W, E)  # the counts matrix; then one refusal word per rank
        self.refusal_words = self.counts.local[W * E:]
        n_rows = len(FLAG_ROWS)
        self.flag_rows = tuple(self.flags.local[i] for i in range(n_rows))
        # views made once: each tensor index costs the host microseconds per call
        self.epoch = torch.zeros(2, dtype=torch.int64, device=self.device)  # [dispatch, combine]
        self.d_epoch, self.c_epoch = self.epoch[0:1], self.epoch[1:2]
        self.expect = torch.zeros(n_rows, W, dtype=torch.int64, device=self.device)  # arrivals expected per flag
        self.expect_rows = tuple(self.expect[i] for i in range(n_rows))
        # the words the host reads at its one sync of an exact-size call (one transfer): [0] a bounded wait's timeout
        # (mxcomm.transport.errors), [1] bad expert ids seen on the device, [2] the row count of the last plan,
        # [3] 1 + the lowest rank that refused its input of the last dispatch (0: none; pull path)
        self.status_words = StatusWords(self.device, rank, config.num_experts, config.exact_sizes, self.capturing)
        self.status = self.status_words.words
        self.err, self.input_err = self.status_words.err, self.status_words.input_err
        self.timeout_ns = tp.timeout_ns(config.timeout_s)
        self.mode_id = SCALE_MODE_IDS[config.scale_mode]
        # captured graphs, least recently used first: ("plan" | "pull" | "local", T, idx dtype, plan impl) -> PlanGraph
        # of a dispatch's middle; ("local-call", T, idx dtype) -> the one-rank path's whole dispatch, ("local-reduce",
        # T, mx, passthrough, weighted) -> its combine's / dispatch backward's reduce (a CallGraphRing; paths.local)
        self._plan_graphs: dict = {}
        self._seen_keys: dict = {}  # keys of those graphs seen once and not captured yet, oldest first
        self._call_shapes: dict = {}  # (T, ids dtype) -> CallShape of a dispatch run as one call
        # this call's counts (check_and_count writes them here) and, in the last word, whether this rank refused its
        # input (bad expert ids): a fixed-address input of the captured middle of a dispatch (see run_middle)
        self.counts_in = torch.zeros(E + 1, dtype=torch.int32, device=self.device)
        # the tickets of kernels whose last program finishes the launch's work (mxcomm.transport.flags.last_to_arrive;
        # each is 0 between launches): the pull dispatch's head, its scan with the wait for the counts, its plan with
        # the pull-list entries and their wait; the partial sums with their wait (combine, dispatch backward); combine
        # backward's weighted rows with the wait for the route-weight gradients; combine backward's pack with its
        # "ready". And the head's per-expert totals (zero between launches)
        self.tickets = torch.zeros(6, dtype=torch.int32, device=self.device)
        self.count_totals = torch.zeros(E + 1, dtype=torch.int32, device=self.device)
        # the path object: its buffers and kernels (mxcomm.ep.nvshmem.paths)
        impl = PATHS[self.path]
        self.impl = impl(self, bufs, puts) if self.path == "put" else impl(self, bufs)

    @property
    def puts(self):
        """The put path's NVSHMEM put/wait interface (``mxcomm.ep.nvshmem.put_path.Puts``); AttributeError elsewhere."""
        return self.impl.puts

    @staticmethod
    def _open_heap(group, rank: int, world_size: int):
        if not torch.cuda.is_available():
            raise RuntimeError("the 'nvshmem' backend needs a CUDA GPU")
        if tp.is_initialized():
            ctx = tp.current_context()
        else:
            import torch.distributed as dist

            ctx = tp.init_nvshmem(group=group if group is not None else dist.group.WORLD)
        if (ctx.rank, ctx.world) != (rank, world_size):
            raise RuntimeError(
                f"NVSHMEM runs as PE {ctx.rank} of {ctx.world}, but the EP group is rank {rank} of {world_size}"
            )
        return tp.SymmetricHeap(ctx)

    # -- launch settings (self.launch; grids are per-SM counts times self.sms, the same on every rank) -------
    # Kernels whose programs each signal every rank when done (a system-scope release per program and peer) get no
    # more programs than a call of max_tokens_per_rank tokens has work units: past them a program only signals.
    # The caps depend on the config alone, so every rank launches (and expects) the same number.
    @property
    def programs(self) -> int:
        """Programs of combine_partials_kernel and pull_weighted_kernel (receivers count them: identical on every
        rank): per SM, capped at the (source, token) entries a call can have (``W * T_max``)."""
        return min(self.sms * self.launch.partials_per_sm, self.world * self.config.max_tokens_per_rank)

    @property
    def dispatch_programs(self) -> int:
        """Programs of the sending dispatch kernels / pack_rows_kernel / pull_rows_kernel / the reduce, at most: a
        launch takes no more than its work units (:meth:`output_programs`; the pack, tokens; the reduce,
        :meth:`_reduce_grid`)."""
        return self.sms * self.launch.dispatch_per_sm

    def output_programs(self, units: int) -> int:
        """Grid of the kernels that write a fresh expert-major output (the local path's ``local_rows_kernel``,
        ``pull_rows_kernel``): their programs take ``units`` work items (tokens, or pull-list entries) and then the
        groups' padding rows, a group each, so programs past both counts would only start and exit (four ranks,
        ``max_tokens_per_rank`` 128, 132 SMs: 512 programs of 2112). No receiver counts them (they signal nothing),
        so the grid may follow the call."""
        return max(1, min(self.dispatch_programs, max(units, self.El)))

    @property
    def sender_programs(self) -> int:
        """Programs of the push and put paths' sending kernels (``push_rows_kernel`` signals every rank): capped at
        ``T_max`` tokens."""
        return min(self.dispatch_programs, self.config.max_tokens_per_rank)

    @property
    def push_programs(self) -> int:
        """Programs of push_entries_kernel per destination rank (blocks of ``PUSH_BLOCK`` tokens; each signals its
        destination once): capped at ``T_max``'s blocks."""
        return min(self.sms * self.launch.push_per_sm, cdiv(self.config.max_tokens_per_rank, PUSH_BLOCK))

    @property
    def route_grad_programs(self) -> int:
        return self.sms * self.launch.route_grad_per_sm

    def dispatch_warps(self, weighted: bool) -> int:
        """Warps per program of the sending dispatch kernels (``weighted``: combine backward's per-slot
        quantization)."""
        return self.launch.weighted_warps if weighted else self.launch.dispatch_warps

    def _reduce_grid(self, T: int, H: int, chunk: int) -> tuple:
        """Grid of combine_reduce_kernel / local_reduce_kernel for ``T > 0`` tokens: up to ``dispatch_programs``
        programs over the tokens; when there are fewer tokens than that, each row's chunks are dealt out over a second
        axis as well (at 128 tokens a program per token would walk its whole row alone)."""
        tokens = min(T, self.dispatch_programs)
        return tokens, max(1, min(cdiv(H, chunk), self.dispatch_programs // tokens))

    @property
    def memory_bytes(self) -> int:
        return self.heap.nbytes

    def refuse(self, op: str, exc: BaseException) -> None:
        """Nothing to tell: the peers' device-side waits (bounded by ``timeout_s``) raise PeerTimeout naming this
        rank."""

    # -- what the compiled ops carry (mxcomm.ep.backend.Backend) -------------------------------
    def state_tensors(self, handle: EPHandle) -> list:
        """Row origins (src, pos: int32 ``[R]``), the device row count (int32 ``[1]``) and (several ranks) the
        dispatch's table (int32 ``[W * T_max, k]``)."""
        o = handle_origins(handle)
        st = handle.backend_state
        return [o.src, o.pos, st.num_rows_dev] + ([] if st.table is None else [st.table])

    def state_shapes(self, num_tokens: int, num_rows: int) -> list:
        shapes = [(num_rows,), (num_rows,), (1,)]
        if not self.local:
            shapes.append((self.world * self.config.max_tokens_per_rank, self.config.topk))
        return shapes

    def handle_fields(self, plan: RoutingPlan, tensors: list) -> dict:
        src, pos, nrd, *table = tensors
        return dict(backend_state=NvshmemState(origins=RowOrigins(src=src, pos=pos), num_rows_dev=nrd,
                                               table=table[0] if table else None))

    def note_refusals(self) -> None:
        """After the counts exchange (inside a dispatch's middle): this rank's refusal word for its peers, and
        ``status[3]`` = 1 + the lowest rank that refused (read at the call's host sync), for the torch plan (the
        Triton plan's tables program writes it). Exact-size mode only: in the no-sync mode bad ids are dropped and the
        call goes on."""
        from .kernels.signals import first_refusal_kernel

        if self.config.exact_sizes:
            fast_kernel(first_refusal_kernel)[(1,)](self.refusal_words, self.world, self.status_words.refused,
                                                    W_POW2=next_pow2(self.world))

    def _sanitize(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """Device-side check of expert ids (no host sync): out-of-range ids and repeats within a token
        become -1 (dropped) so nothing is written out of bounds; ``input_err`` records it."""
        E = self.config.num_experts
        idx = topk_idx.to(torch.int64)
        bad = (idx < -1) | (idx >= E)
        if idx.shape[1] > 1:
            srt, order = torch.sort(torch.where(bad, torch.full_like(idx, -1), idx), dim=1, stable=True)
            dup_sorted = torch.zeros_like(bad)
            dup_sorted[:, 1:] = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
            bad = bad | torch.zeros_like(bad).scatter_(1, order, dup_sorted)
        self.input_err.add_(bad.any().to(torch.int64))
        return torch.where(bad, torch.full_like(idx, -1), idx).to(topk_idx.dtype)

    def checked_ids(self, topk_idx: torch.Tensor, store: Optional[torch.Tensor] = None,
                    counts_out: Optional[torch.Tensor] = None, refusal_word: bool = False,
                    new_epoch: bool = False) -> torch.Tensor:
        """The expert ids checked on the device (bad ids and repeats within a token become -1: nothing is sent for
        them, ``input_err`` records them); this rank's int32 ``[E]`` counts go into ``counts_out``, else into the head
        of ``counts_in``.

        ``store``: :meth:`plan_store`'s buffer of this call (the ids go to its head). ``refusal_word``: also copy
        ``input_err`` into ``counts_in[E]``, the refusal word the counts exchange publishes. ``new_epoch``: also
        advance the dispatch epoch ``d_epoch``. (The Triton plan's pull dispatch does both in its head kernel.)

        No host sync here. Exact-size mode: the caller's one sync reads ``input_err`` with the other status words,
        before anything is sent or written, and raises the detailed ValueError of
        :func:`mxcomm.ep.ids.check_expert_ids` (:meth:`StatusWords.check` with the caller's ids). No-sync mode: a
        later call raises it (see :meth:`StatusWords.check_async`)."""
        E = self.config.num_experts
        counts = self.counts_in[:E] if counts_out is None else counts_out
        word = self.counts_in[E:E + 1] if refusal_word else None
        if self.plan_impl == "triton":
            ids = plan_kernels.check_and_count(topk_idx, E, self.input_err, check=True, prefix_buf=self.slot_prefix,
                                               counts_out=counts, ids_out=store).ids
        else:
            ids = self._sanitize(topk_idx)
            counts.copy_(local_counts(ids, E))
        if word is not None:
            word.copy_(self.input_err)
        if new_epoch:
            self.d_epoch.add_(1)
        return ids

    def plan_store(self, topk_idx: torch.Tensor) -> Optional[torch.Tensor]:
        """A fresh int32 buffer for this call's checked ids and Triton plan (:func:`plan_kernels.plan_storage`;
        None for the torch plan): the outputs of a captured middle in one storage."""
        if self.plan_impl != "triton":
            return None
        T, k = topk_idx.shape
        return plan_kernels.plan_storage(self.world, self.config.num_experts, T, k, 0 if self.local else self.R_max,
                                         self.device)

    def capturing(self) -> bool:
        """True while the current stream is being captured into a CUDA graph."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def check_errors(self) -> None:
        """Host sync: raise any error the device recorded. Bad expert ids are reported once (cleared); a
        peer timeout stays set (the group's protocol state is lost after it). The only error report of
        calls replayed from a CUDA graph (nothing is checked inside the graph). Capture of exact-size
        groups is refused by ``EPGroup`` before it gets here."""
        self.status_words.check("device error words")

    def after_call(self, what: str, waited: bool) -> None:
        """The error check that ends a call whose output sizes are known without the device (combine and both
        backward passes; the push and put dispatches' rounds after their one sync), in both size modes: no host
        sync - :meth:`StatusWords.check_async` raises an error an earlier call recorded (a bounded wait that timed
        out), and the next exact-size dispatch (its one sync) or :meth:`check_errors` raises this call's. A call that
        waited for nothing could not have recorded one."""
        if waited:
            self.status_words.check_async(what)

    def grouped_scales_launch(self, rows: int) -> "GroupedScalesLaunch":
        """How ``scale_rows_to_grouped_kernel`` fills a grouped blocked matrix of ``rows`` rows (a multiple of 128)."""
        C = self.config.hidden // 32
        cp = round_up(C, 4)
        word = C % 4 == 0  # 4-byte columns (H a multiple of 128)
        ncols = cp // 4 if word else cp
        cb = next_pow2(ncols) if word else min(32, next_pow2(cp))
        return GroupedScalesLaunch(grid=(rows // 128, cdiv(ncols, cb)), word=word, n_col_tiles=cp // 4, C=C, CB=cb,
                                   G_POW2=next_pow2(self.El))

    def grouped_scales_at(self, table: torch.Tensor, rows_slot: int, slot: int, cap_slot: int, plan: RoutingPlan,
                          scale_rows: int) -> None:
        """Inside a captured call: enqueue the grouped blocked scales (zeros for padding) of the row-major scale rows
        at the address in ``table[rows_slot]`` (uint8 ``[>= n_rows, H/32]``, contiguous, 16-byte aligned) into the
        tensor at the address in ``table[slot]``, sized for an output of ``table[cap_slot]`` rows (its
        ``grouped_m_rows(cap, El)`` rows written; nothing when the plan's ``n_rows`` exceeds the capacity), with a
        grid for ``scale_rows`` rows of the matrix, the most any call of the capture has
        (``scale_rows_to_grouped_at_kernel``)."""
        from .kernels.layout import scale_rows_to_grouped_at_kernel

        g = self.grouped_scales_launch(scale_rows)
        fast_kernel(scale_rows_to_grouped_at_kernel)[g.grid](
            table, rows_slot, slot, cap_slot, plan.offs, plan.num_rows, plan.expert_counts, self.El, g.n_col_tiles,
            C=g.C, CB=g.CB, G_POW2=g.G_POW2, WORD=g.word, TAIL=True, num_warps=4,
        )

    def _grouped_scales(self, plan: RoutingPlan, R: int, scale_rows: torch.Tensor) -> torch.Tensor:
        """Fresh grouped-along-M blocked scales ``[grouped_m_rows(R, El), round_up(H/32, 4)]`` uint8 of the
        received rows (zeros for padding), from their row-major scale rows ``scale_rows`` (uint8 ``[>= R, H/32]``)."""
        from .kernels.layout import scale_rows_to_grouped_kernel

        rows = grouped_m_rows(R, self.El)
        g = self.grouped_scales_launch(rows)
        out = torch.empty(rows, 4 * g.n_col_tiles, dtype=torch.uint8, device=self.device)
        src = scale_rows.reshape(-1)
        fast_kernel(scale_rows_to_grouped_kernel)[g.grid](
            src.view(torch.int32) if g.word else src, out.view(torch.int32) if g.word else out, plan.offs,
            plan.num_rows, plan.expert_counts, self.El, g.n_col_tiles, C=g.C, CB=g.CB, G_POW2=g.G_POW2, WORD=g.word,
            TAIL=self.config.exact_sizes, num_warps=4,
        )
        return out

    def _plan_extra(self, plan: RoutingPlan, topk_idx: torch.Tensor) -> dict:
        """Backend maps computed with the plan: row origins (R_max rows; not on the local path, whose dispatch does
        not read them)."""
        if self.local:
            return {}
        o = row_origins(plan, self.R_max)
        return {"origin_src": o.src, "origin_pos": o.pos}

    def compute_plan(self, counts: torch.Tensor, topk_idx: torch.Tensor, refusals: bool = False,
                     store: Optional[torch.Tensor] = None,
                     jobs: Optional[plan_kernels.PlanJobs] = None) -> PlanOutputs:
        """The plan (and row origins) from the counts matrix, with ``self.plan_impl``'s kernels; in exact-size mode
        also the status words read at the call's host sync: the output's row count and (``refusals``: after a counts
        exchange that carried every rank's refusal word) the lowest refusing rank (the Triton plan writes both from
        its tables program). ``store``: :meth:`plan_store`'s buffer of this call (the plan goes after its ids).
        ``jobs`` (Triton plan): the kernel to launch instead of ``plan_kernel`` (see :class:`plan_kernels.PlanJobs`)."""
        T, k = topk_idx.shape
        exact = self.config.exact_sizes
        if self.plan_impl == "triton" and (T or jobs is not None):  # (jobs: its launch must happen with no tokens too)
            # the table check_and_count wrote for these ids (this call's, at a fixed address)
            n_keys = counts.shape[1] + 1
            pre = self.slot_prefix[:plan_kernels.slot_blocks(T, k) * n_keys].view(-1, n_keys)
            out = plan_kernels.triton_plan(counts, topk_idx, self.rank, self.config.align, self.R_max, prefix=pre,
                                           origins=not self.local, status=self.status if exact else None,
                                           refusals=self.refusal_words if refusals else None,
                                           out=None if store is None else store[T * k:], jobs=jobs)
            return PlanOutputs(plan=out["plan"], extra={n: v for n, v in out.items() if n != "plan"})
        if refusals:
            self.note_refusals()
        po = compute_plan(counts.clone(), topk_idx, self.rank, self.config.align, self._plan_extra)
        if exact:  # the output size, read at the call's one host sync with the error words
            self.status_words.rows.copy_(po.plan.num_rows)
        return po

    def plan_from_counts(self, topk_idx: torch.Tensor) -> PlanOutputs:
        """The routing plan of this call from the exchanged counts and refusal words (the status words of the
        call's host sync: the row count and the lowest refusing rank, :meth:`compute_plan`): replayed from a CUDA
        graph captured once per token count and plan implementation on the GPU (see plan_graph), computed eagerly
        elsewhere."""
        T, k = topk_idx.shape
        compute = functools.partial(self.compute_plan, refusals=True)
        if self.device.type != "cuda" or T == 0 or self.capturing():  # an outer capture records the kernels
            return compute(self.counts_mat, topk_idx)
        key = ("plan", T, topk_idx.dtype, self.plan_impl)
        g = self._plan_graphs.pop(key, None)
        if g is None:
            g = PlanGraph(self.counts_mat, T, k, topk_idx.dtype, compute)
        self.remember_graph(key, g)
        return g(topk_idx)

    def _received(self, plan: RoutingPlan, R: int, mx: bool, q: torch.Tensor, scale_rows: torch.Tensor,
                  grouped: Optional[torch.Tensor] = None):
        """The received rows ``q`` (fresh uint8 ``[R, row bytes]``, from the path's dispatch or combine backward)
        as the dispatch-layout output: bf16 rows, or an MXTensor with its scales swizzled out of ``scale_rows`` (the
        row-major scale rows the receiving kernel wrote), or ``grouped`` when the path wrote them so itself."""
        if not mx:
            return q.view(torch.bfloat16)
        s = self._grouped_scales(plan, R, scale_rows) if grouped is None else grouped
        return MXTensor(
            qdata=q.view(torch.float8_e4m3fn), scales=s, axis=1, layout=ScaleLayout.GROUPED_M,
            mode=self.config.scale_mode, orig_dtype=torch.bfloat16, group_offs=plan.offs,
        )

    # -- dispatch ----------------------------------------------------------------------------
    def run_middle(self, middle: Callable[[torch.Tensor, torch.Tensor], PlanOutputs],
                   topk_idx: torch.Tensor) -> PlanOutputs:
        """Run a path's dispatch middle ``middle(counts_buf, topk_idx)`` (the id check and the plan; on the pull path
        also pack, counts exchange and pull-list entries) for this call's ``topk_idx``. On the GPU it is captured into
        a CUDA graph per (path, token count, id dtype, plan implementation) after the first eager call with that key
        and replayed afterwards (its launches cost the host more than its GPU work; a key is captured at its second
        call, so a token count seen once is never captured); its inputs go through fixed-address buffers (the
        path's, and ``counts_in``). Eager on the interpreter, for T = 0, and inside an outer capture (which records
        its kernels). Returns outputs the caller owns (a replay's are copied, :meth:`PlanGraph.snapshot`: the copies
        are enqueued at once, so an exact-size dispatch makes them while the device runs the middle, before its
        host sync). The status words' copy for that sync is enqueued before them (:meth:`StatusWords.start_read`)."""
        T, k = topk_idx.shape
        graphs = self.device.type == "cuda" and T > 0 and not self.capturing()
        key = (self.path, T, topk_idx.dtype, self.plan_impl)
        g = self.captured_graph(key) if graphs else None
        if g is None:
            # eager (the first call with a key compiles every kernel); captured at the key's second call, so a token
            # count seen once (a last, smaller batch) costs no capture
            po = middle(self.counts_mat, topk_idx)
            if graphs and self.second_sighting(key):
                self.remember_graph(key, PlanGraph(self.counts_mat, T, k, topk_idx.dtype, middle, warmup=False))
            self.status_words.start_read()
            return po
        g.replay(topk_idx)
        self.status_words.start_read()  # before the snapshot's host work, which then overlaps the transfer
        return g.snapshot()

    def call_shape(self, T: int, dtype: torch.dtype) -> CallShape:
        """What this path's exact-size dispatch of ``T`` tokens (ids of ``dtype``) run as one call is captured for: the
        most output rows a call passes (the fixed storage of :func:`mxcomm.ep.plan.call_output_rows`; on the pull
        path above its limit, whose output is sized per call, the worst case ``R_max``), their grouped scale rows,
        and the int32 words of the plan's store (:meth:`plan_store`'s size). Made once per key."""
        shape = self._call_shapes.get((T, dtype))
        if shape is None:
            cfg = self.config
            k, E = cfg.topk, cfg.num_experts
            # the fixed storage where there is one, else (the pull path above LaunchConfig.peer_call_tokens, its
            # output sized per call) the worst case
            rows = call_output_rows(cfg, self.world, T, self.launch) or self.R_max
            words = T * k + plan_kernels.plan_numel(self.world, E, T, k, 0 if self.local else self.R_max)
            shape = self._call_shapes[(T, dtype)] = CallShape(T=T, dtype=dtype, rows=rows,
                                                              scale_rows=grouped_m_rows(rows, self.El),
                                                              plan_words=words)
        return shape

    def run_call(self, key, addresses: tuple, body: Callable[[torch.Tensor], CallOutputs]) -> PlanLayout:
        """Run a dispatch as one call: ``body(table)`` enqueues all of it, reading its tensors' addresses from the
        int64 table ``table`` (``addresses``, ints, in the order ``body`` reads them). On the GPU it is captured into
        a :class:`CallGraph` at a key's second call (as :meth:`run_middle`'s middles) and replayed afterwards with
        this call's ``addresses``; eager elsewhere, at a key's first two calls and on the interpreter. The body
        enqueues the copy of the status words (CUDA) that the call's host sync reads (as soon as it lands: kernels the
        body enqueues after it may still run then). Returns the layout of the call's copy of its plan
        (:meth:`PlanLayout.read`)."""
        cuda = self.device.type == "cuda"
        cap = self.captured_graph(key) if cuda else None
        if cap is not None:
            self.status_words.arm()
            cap.graph.replay(addresses)
            self.status_words.note_copy_enqueued(cap.graph.done)
            return cap.layout
        table = torch.tensor(addresses, dtype=torch.int64).to(self.device)
        if cuda:
            self.status_words.arm()
        layout = PlanLayout.of(body(table).middle)
        if cuda:
            self.status_words.note_copy_enqueued()
            if self.second_sighting(key):
                graph = CallGraph(self.device, len(addresses), body)
                self.remember_graph(key, CapturedCall(graph=graph, layout=PlanLayout.of(graph.outputs.middle)))
        return layout

    def run_ring_call(self, key, addresses: tuple, body: Callable[[torch.Tensor], object], copies: int) -> None:
        """Run a call that returns nothing of its own (its outputs are the caller's tensors): ``body(table)`` enqueues
        it, reading its tensors' addresses from the int64 table ``table`` (``addresses``, ints, in the order ``body``
        reads them). On the GPU it is captured into a :class:`CallGraphRing` of up to ``copies`` graphs at a key's
        second call (as :meth:`run_call`'s calls) and replayed afterwards with this call's ``addresses``; eager
        elsewhere, at a key's first two calls and on the interpreter."""
        cuda = self.device.type == "cuda"
        ring = self.captured_graph(key) if cuda else None
        if ring is not None:
            ring.replay(addresses)
            return
        body(torch.tensor(addresses, dtype=torch.int64).to(self.device))
        if cuda and self.second_sighting(key):
            self.remember_graph(key, CallGraphRing(self.device, len(addresses), body, copies))

    def captured_graph(self, key):
        """The graph kept for ``key`` (now the most recently used), or None."""
        g = self._plan_graphs.pop(key, None)
        if g is not None:
            self._plan_graphs[key] = g
        return g

    def second_sighting(self, key) -> bool:
        """Whether a call with ``key`` (and no graph kept for it) came before: time to capture it. Notes the first
        (at most ``8 * _MAX_PLAN_GRAPHS`` keys, oldest dropped)."""
        if self._seen_keys.pop(key, None) is not None:
            return True
        while len(self._seen_keys) >= 8 * _MAX_PLAN_GRAPHS:
            self._seen_keys.pop(next(iter(self._seen_keys)))
        self._seen_keys[key] = True
        return False

    def remember_graph(self, key, g) -> None:
        """Keep ``g`` as the most recently used captured graph (at most ``_MAX_PLAN_GRAPHS``: varying token
        counts must not grow memory)."""
        while len(self._plan_graphs) >= _MAX_PLAN_GRAPHS:
            self._plan_graphs.pop(next(iter(self._plan_graphs)))
        self._plan_graphs[key] = g

    def output_rows(self, what: str, ids: torch.Tensor | None = None) -> int:
        """The row count of this dispatch's output: exact-size mode reads it at the call's one host sync with the error
        words (:meth:`StatusWords.check`; ``ids``: the caller's ids whose check was deferred to it); no-sync mode: the
        worst case ``R_max``, errors raised by a later call."""
        if self.config.exact_sizes:
            return self.status_words.check(what, ids=ids, started=True).rows
        self.status_words.check_async(what)
        return self.R_max

    def origins_from(self, po: PlanOutputs, R: int) -> "RowOrigins":
        """The first ``R`` row origins computed with the plan ``po``."""
        return RowOrigins(src=po.extra["origin_src"][:R], pos=po.extra["origin_pos"][:R])

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        cfg = self.config
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}, the nvshmem backend runs on {self.device}")
        self.impl.refuse_capture()
        T = x.shape[0]
        rows = self.impl.dispatch(x.contiguous(), topk_idx, topk_weights)
        plan, R = rows.kept.plan, rows.num_rows
        out_x = self._received(plan, R, self.mx, rows.q, rows.scale_rows, rows.grouped_scales)
        result = DispatchResult(x=out_x, offs=plan.offs, counts=plan.expert_counts, num_rows=R)
        handle = EPHandle(
            config=cfg, group_id=self.group_id, plan=plan, topk_idx=rows.ids, topk_weights=topk_weights,
            weights_version=topk_weights._version, num_tokens=T, num_rows=R, device=x.device,
            backend_state=NvshmemState(origins=rows.origins, num_rows_dev=plan.num_rows, table=rows.table,
                                       weights=rows.weights),
        )
        return result, handle

    # -- combine (and dispatch backward: the same direction) ---------------------------------
    def _to_origin(self, rows, handle: EPHandle, quantize_rows: bool, weights: Optional[torch.Tensor],
                   what: str) -> torch.Tensor:
        """One row per (token, rank) back to the origins, then the sum of a token's partials there.

        ``rows``: bf16 ``[R, H]`` or an ``MXTensor`` (decoded before the sum); ``weights``: float ``[T, k]`` route
        weights (combine) or None (every weight 1: dispatch backward). Each expert rank forms the partial sum of a
        token's rows on it (weighted, fp32, ``j`` ascending; the weights that came with the dispatch, or every rank's
        exchanged: :meth:`EnginePath.combine_weights`), rounds it once (MXFP8 when ``quantize_rows``, else BF16)
        and sends it to the origin, which sums the token's partials in fp32 (ranks in the order of
        their first slot). One rank: the reduce forms the one partial from the rows in place. Returns bf16 ``[T, H]``.
        """
        from .kernels.combine import combine_reduce_kernel

        self.impl.refuse_capture()
        cfg = self.config
        H, k = cfg.hidden, cfg.topk
        plan = handle.plan
        passthrough = isinstance(rows, MXTensor)  # decoded before the sum
        mx = quantize_rows
        if passthrough:
            payload = rows.qdata.view(torch.uint8).contiguous()
            in_scales = rows.row_scales().contiguous()
        else:
            payload, in_scales = rows.contiguous(), self.err  # in_scales unused
        T = handle.num_tokens
        y = torch.empty(T, H, dtype=torch.bfloat16, device=self.device)
        own = self.local
        w = None  # the reduce's weights: one rank only (several: the partials come weighted)
        if own and weights is not None:
            w = fp32_weights(weights)
        if not own:
            self.c_epoch.add_(1)  # picks the comb_q copy (parity); tags the weights
            w_src = self.impl.combine_weights(weights, handle)
            self.impl.send_partials(payload, in_scales, handle, mx, passthrough, w_src)
        if T and own:
            self.impl.reduce(payload, in_scales, plan, w, y, mx, passthrough)
        elif T:
            comb_q, comb_s = self.comb
            chunk = self.launch.reduce_row_chunk(H, False, mx)
            fast_kernel(combine_reduce_kernel)[self._reduce_grid(T, H, chunk)](
                comb_q.local if mx else comb_q.local.view(torch.bfloat16), comb_s.local, plan.send_pos,
                plan.dest_rank, y, T, self.c_epoch, self.nslot, self.world, H=H, K=k, P=min(k, self.world), CHUNK=chunk,
                MX=mx,
                INT_ROUND=self.int_round, num_warps=self.launch.reduce_warps, enable_fp_fusion=False,
            )
        self.after_call(what, waited=not own)
        return y

    def combine(self, expert_out: torch.Tensor, handle: EPHandle, quantize_rows: bool) -> torch.Tensor:
        return self._to_origin(expert_out, handle, quantize_rows, handle.topk_weights, "combine partials")

    def combine_for_backward(self, expert_out: torch.Tensor, handle: EPHandle, quantize_rows: bool):
        """Forward combine; what the route-weight gradient needs is the expert output itself (kept where it is)."""
        return self.combine(expert_out, handle, quantize_rows), CombineSaved(rows=expert_out)

    def dispatch_backward(self, grad_recv, handle: EPHandle, quantize_rows: bool) -> torch.Tensor:
        """The gradient rows of each (token, rank) summed on the expert rank (fp32; an MX gradient decoded first),
        rounded once (MXFP8 when ``quantize_rows``, else BF16) and summed over the token's ranks at the origin."""
        return self._to_origin(grad_recv, handle, quantize_rows, None, "dispatch-backward partials")

    # -- combine backward (the dispatch direction) ------------------------------------------
    def combine_backward(self, grad_y: torch.Tensor, handle: EPHandle, saved, quantize_rows: bool) -> CombineGrads:
        """``g = w[t,j] * grad_y[t]`` quantized per slot where the rows land (route weighting fused with the gradient
        quantization), one BF16 gradient row per (token, rank) crossing; the route-weight gradient ``<grad_y[t],
        out[row(t, j)]>`` formed on the expert rank from the rows the forward combine was given (``saved.rows``)."""
        self.impl.refuse_capture()
        cfg = self.config
        if quantize_rows != self.mx:
            raise NotImplementedError(
                f"the nvshmem backend's combine backward sends {'MXFP8' if self.mx else 'BF16'} rows (it reuses the "
                f"dispatch buffers sized for precision={cfg.precision!r}); quantize={quantize_rows} is not supported"
            )
        plan = handle.plan
        w = fp32_weights(handle.topk_weights)
        expert_out = None if saved is None else saved.rows.contiguous()
        rows = self.impl.combine_backward(grad_y.contiguous(), w, handle, quantize_rows, expert_out)
        self.after_call("combine-backward rows", waited=not self.local)
        grad_out = self._received(plan, handle.num_rows, quantize_rows, rows.q, rows.scale_rows)
        return CombineGrads(grad_expert_out=grad_out, grad_weights=rows.grad_w)


__all__ = ["NvshmemBackend", "row_origins", "RowOrigins", "handle_origins"]
