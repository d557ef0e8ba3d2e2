"""The routing plan shared by every EP backend: who sends which (token, k) row where.

Pure, device-agnostic torch (CPU and CUDA), no device-to-host sync: every function here
takes and returns tensors on the input's device. All plan tensors are int32 and contiguous
so GPU kernels can read them directly.

Terms (``W`` ranks, ``E`` experts, ``El = E / W`` local experts, ``T`` tokens, ``k`` = topk):

* ``counts [W, E]`` int32: ``counts[s, e]`` = rows source rank ``s`` sends to global expert
  ``e`` = number of valid slots ``(t, j)`` of rank ``s`` with ``topk_idx[t, j] == e``. Every rank
  holds the whole matrix (all_gather in the reference backend; peer buffers in the GPU backend).
* Expert-major layout on receiving rank ``r``: local expert 0's group, then 1, ...; inside
  global expert ``e``'s group the rows of source rank 0 (in its ``(t, j)`` order, token
  ascending then ``j``), then source 1, ...; then zero rows up to a multiple of ``align``.
  Group ``e`` has ``n_e = sum_s counts[s, e]`` real rows and ``round_up(n_e, align)`` rows.
* Send order on origin rank ``s``: its valid slots sorted by (global expert, t, j) - which is
  the order (destination rank, destination row), since experts are contiguous per rank.
  The reference backend's all-to-all send buffer is exactly this order, and the combine
  answer comes back in it.
* Receive order on rank ``r`` (what an all-to-all delivers): for each source ``s``, for each
  local expert, that source's block of rows - see :func:`recv_rows`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..mx.layouts import round_up
from .config import EPConfig
from .nvshmem.launch_config import LaunchConfig



@dataclass(frozen=True)
class RoutingPlan:
    """Routing of one dispatch/combine, seen from one rank (all tensors int32, contiguous, one device).

    Scalars:
        rank, world_size, num_experts, num_local_experts, align, topk, num_tokens (T).
    Whole group:
        counts: ``[W, E]`` rows each source rank sends to each global expert.
    Send side (this rank as the origin of tokens):
        dest_rank: ``[T, k]`` destination rank of slot ``(t, j)``, -1 if dropped.
        dest_row: ``[T, k]`` row of that slot in the destination's expert-major buffer, -1 if dropped.
        send_pos: ``[T, k]`` position of the slot in this rank's send order, -1 if dropped.
        send_order: ``[T*k]`` flat slot index ``t*k + j`` at each send position; the first
            ``num_send`` entries are the valid slots, the rest are the dropped slots.
        send_splits: ``[W]`` rows sent to each destination rank.
        num_send: ``[1]`` total rows sent (``send_splits.sum()``).
    Receive side (this rank as the owner of local experts ``rank*El .. rank*El+El-1``):
        recv_splits: ``[W]`` rows received from each source rank.
        expert_counts: ``[El]`` real rows per local expert.
        offs: ``[El]`` END offsets of each local expert's padded group (multiples of ``align``).
        src_row_start: ``[W, El]`` row where source ``s``'s block of local expert ``e`` starts.
        src_send_pos: ``[W, El]`` position of that block's first row in source ``s``'s send order
            (where a combine that pushes rows back writes them on the origin).
        num_rows: ``[1]`` rows of the expert-major buffer, ``offs[-1]``.
        num_recv: ``[1]`` real rows received (``recv_splits.sum()``).
    """

    rank: int
    world_size: int
    num_experts: int
    num_local_experts: int
    align: int
    topk: int
    num_tokens: int
    counts: torch.Tensor
    dest_rank: torch.Tensor
    dest_row: torch.Tensor
    send_pos: torch.Tensor
    send_order: torch.Tensor
    send_splits: torch.Tensor
    num_send: torch.Tensor
    recv_splits: torch.Tensor
    expert_counts: torch.Tensor
    offs: torch.Tensor
    src_row_start: torch.Tensor
    src_send_pos: torch.Tensor
    num_rows: torch.Tensor
    num_recv: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.counts.device


#: Names of the tensor fields of :class:`RoutingPlan`, in declaration order.
PLAN_TENSORS = tuple(f.name for f in fields(RoutingPlan) if f.type in ("torch.Tensor", torch.Tensor))


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def local_counts(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows this rank sends to each global expert: int32 ``[E]`` (no host sync).

    Args:
        topk_idx: int32/int64 ``[T, k]``, values in ``[-1, E)`` (-1 = dropped slot; not checked here).
        num_experts: E.
    """
    idx = topk_idx.reshape(-1).to(torch.int64)
    key = torch.where(idx >= 0, idx, torch.full_like(idx, num_experts))
    c = torch.zeros(num_experts + 1, dtype=torch.int64, device=idx.device)
    c.scatter_add_(0, key, torch.ones_like(key))
    return _i32(c[:num_experts])


def build_plan(counts: torch.Tensor, topk_idx: torch.Tensor, rank: int, align: int) -> RoutingPlan:
    """Build this rank's :class:`RoutingPlan` (no host sync).

    Args:
        counts: int ``[W, E]``, the all-ranks counts matrix (row ``rank`` must equal
            ``local_counts(topk_idx, E)``).
        topk_idx: int32/int64 ``[T, k]`` of this rank, -1 = dropped. Must hold no duplicate
            expert within a row (callers validate).
        rank: this rank, ``0 <= rank < W``.
        align: group padding (32 or 128).
    """
    if counts.dim() != 2:
        raise ValueError(f"counts must be [world, experts], got shape {tuple(counts.shape)}")
    W, E = counts.shape
    if E % W:
        raise ValueError(f"num_experts {E} is not a multiple of world size {W}")
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [T, k], got shape {tuple(topk_idx.shape)}")
    if not 0 <= rank < W:
        raise ValueError(f"rank {rank} out of range for world size {W}")
    El = E // W
    T, k = topk_idx.shape
    dev = counts.device
    c = counts.to(torch.int64)

    # Layout of every rank's expert-major buffer (computable by all ranks from counts).
    n_e = c.sum(0)                                        # [E] real rows per expert
    p_e = (n_e + align - 1) // align * align              # [E] padded rows per expert
    p_re = p_e.view(W, El)
    gstart = (torch.cumsum(p_re, 1) - p_re).reshape(E)    # [E] group start inside its rank's buffer
    src_excl = torch.cumsum(c, 0) - c                     # [W, E] rows of lower sources in expert e's group
    send_excl = torch.cumsum(c, 1) - c                    # [W, E] start of block (s, e) in s's send order

    # Send side.
    idx = topk_idx.reshape(-1).to(torch.int64).to(dev)
    n = idx.numel()
    valid = idx >= 0
    key = torch.where(valid, idx, torch.full_like(idx, E))
    order = torch.argsort(key, stable=True)               # send order: (expert, t, j); dropped last
    inv = torch.empty_like(order)
    inv[order] = torch.arange(n, dtype=torch.int64, device=dev)
    ke = torch.clamp(key, max=E - 1)
    occ = inv - send_excl[rank][ke]                       # index of the slot inside its (rank, expert) block
    neg = torch.full_like(idx, -1)
    dest_rank = torch.where(valid, ke // El, neg)
    dest_row = torch.where(valid, gstart[ke] + src_excl[rank][ke] + occ, neg)
    send_pos = torch.where(valid, inv, neg)
    send_splits = c[rank].view(W, El).sum(1)

    # Receive side.
    lo = rank * El
    padded = p_e[lo:lo + El]
    offs = torch.cumsum(padded, 0)
    src_row_start = (offs - padded).view(1, El) + src_excl[:, lo:lo + El]
    recv_splits = c[:, lo:lo + El].sum(1)

    return RoutingPlan(
        rank=rank, world_size=W, num_experts=E, num_local_experts=El, align=align, topk=k, num_tokens=T,
        counts=_i32(c),
        dest_rank=_i32(dest_rank.view(T, k)),
        dest_row=_i32(dest_row.view(T, k)),
        send_pos=_i32(send_pos.view(T, k)),
        send_order=_i32(order),
        send_splits=_i32(send_splits),
        num_send=_i32(send_splits.sum().view(1)),
        recv_splits=_i32(recv_splits),
        expert_counts=_i32(n_e[lo:lo + El]),
        offs=_i32(offs),
        src_row_start=_i32(src_row_start),
        src_send_pos=_i32(send_excl[:, lo:lo + El]),
        num_rows=_i32(offs[-1:]),
        num_recv=_i32(recv_splits.sum().view(1)),
    )


def recv_rows(plan: RoutingPlan, n: int) -> torch.Tensor:
    """Expert-major row of each row in receive order: int32 ``[n]`` (no host sync).

    Receive order is source-rank major, then local expert, then the source's send order
    (exactly what ``all_to_all_single`` with ``recv_splits`` delivers, and the order in which
    combine returns rows to the sources). Entries ``j >= num_recv`` are -1, so ``n`` may be a
    worst-case bound.
    """
    W, El = plan.world_size, plan.num_local_experts
    dev = plan.device
    lo = plan.rank * El
    sizes = plan.counts[:, lo:lo + El].to(torch.int64).reshape(-1)   # [(s, e)]
    ends = torch.cumsum(sizes, 0)
    starts = ends - sizes
    j = torch.arange(n, dtype=torch.int64, device=dev)
    seg = torch.searchsorted(ends, j, right=True)
    valid = seg < W * El
    segc = torch.clamp(seg, max=W * El - 1)
    rows = plan.src_row_start.to(torch.int64).reshape(-1)[segc] + j - starts[segc]
    return _i32(torch.where(valid, rows, torch.full_like(rows, -1)))


def send_tokens(plan: RoutingPlan, n: int) -> torch.Tensor:
    """Token index of each of the first ``n`` send positions: int64 ``[n]`` (``n <= T*k``)."""
    return plan.send_order[:n].to(torch.int64) // plan.topk


# ---------------------------------------------------------------- worst-case sizes ----

def max_rows_per_source(config: EPConfig, world_size: int) -> int:
    """Most rows one source rank can send to one destination rank: ``T_max * min(k, El)``."""
    return config.max_tokens_per_rank * min(config.topk, config.num_local_experts(world_size))


def max_recv_rows(config: EPConfig, world_size: int) -> int:
    """Worst-case rows of a rank's expert-major buffer (R bound used when ``exact_sizes=False``).

    ``round_up(W * T_max * min(k, El) + El * (align - 1), align)``: each token sends at most
    ``min(k, El)`` rows to one rank (no duplicate experts per token), and padding adds at most
    ``align - 1`` rows per local expert.
    """
    El = config.num_local_experts(world_size)
    return round_up(world_size * max_rows_per_source(config, world_size) + El * (config.align - 1), config.align)


def call_output_rows(config: EPConfig, world_size: int, tokens: int,
                     launch: LaunchConfig | None = None) -> int | None:
    """Rows of the storage an exact-size ``nvshmem`` dispatch of ``tokens`` tokens (> 0, the Triton plan) returns
    its output in when it runs as one captured call - the output its first ``R`` rows, its grouped scales likewise
    sized for these rows - when that storage is fixed, or None (the output is allocated at exactly ``R`` rows, or,
    on the pull path above ``LaunchConfig.peer_call_tokens``, sized from the calls before: ``peer_guess_pct``). On one
    rank (the local path) up to ``LaunchConfig.call_graph_tokens`` tokens: the most rows the call's tokens can fill,
    ``T min(k, E) + E (align - 1)`` rounded up to ``align``; on the pull path when ``world_size *
    max_tokens_per_rank <= LaunchConfig.peer_call_tokens``: the worst case, :func:`max_recv_rows`. ``launch``: the
    backend's launch settings (default ``config.launch``, else the defaults)."""
    launch = launch or config.launch or LaunchConfig()
    path = dispatch_path(config, world_size)
    if not config.exact_sizes or tokens <= 0:
        return None
    if path == "local" and tokens <= launch.call_graph_tokens:
        E = config.num_experts
        return round_up(tokens * min(config.topk, E) + E * (config.align - 1), config.align)
    if path == "pull" and world_size * config.max_tokens_per_rank <= launch.peer_call_tokens:
        return max_recv_rows(config, world_size)
    return None


def recv_window_rows(config: EPConfig, world_size: int, put_path: bool = False) -> int:
    """Rows of the push and put paths' dispatch receive window (``ep.recv_q`` / ``ep.recv_s``; a dispatch that
    brings some rank more moves its rows in rounds of this many): ``config.recv_window_rows``, by default the rows a
    balanced routing brings a rank (``round_up(T_max * k + El * (align - 1), align)``), on the put path at least the
    rows of the bytes its ``recv_q`` holds anyway (a round of combine backward's gradient rows: ``W *``
    :func:`put_round_tokens` rows of ``2H`` bytes); never more than the worst case :func:`max_recv_rows`."""
    R = max_recv_rows(config, world_size)
    if config.recv_window_rows is not None:
        return min(config.recv_window_rows, R)
    H, T, k = config.hidden, config.max_tokens_per_rank, config.topk
    row = H * (1 if config.precision == "mxfp8" else 2)
    El = config.num_local_experts(world_size)
    rows = round_up(T * k + El * (config.align - 1), config.align)
    if put_path:
        rows = max(rows, -(-world_size * put_round_tokens(config, world_size) * 2 * H // row))
    return min(rows, R)


def put_round_tokens(config: EPConfig, world_size: int) -> int:
    """Tokens per round of the put path's combine direction and combine backward: the entries ``(source, token)``
    of ``T_c`` tokens of every source (``W * T_c`` rows) are staged and put (combine), or received (combine
    backward), per round, ``ceil(T_max / T_c)`` rounds. ``T_max`` (one round) up to ``W = k``; above, ``T_max * k //
    W`` (at least 1): the rows stay ``T_max * k`` at any world size instead of growing with ``W * T_max``. With
    ``config.recv_window_rows`` set, at most what fits that window's bytes (``W * T_c`` gradient rows of ``2H``
    bytes), so that the window bounds ``recv_q`` for combine backward too."""
    T, k, W = config.max_tokens_per_rank, config.topk, world_size
    tc = T if W <= k else max(1, T * k // W)
    if config.recv_window_rows is not None:
        H = config.hidden
        row = H * (1 if config.precision == "mxfp8" else 2)
        tc = min(tc, max(1, config.recv_window_rows * row // (W * 2 * H)))
    return tc


def padded_group_rows(plan: RoutingPlan) -> torch.Tensor:
    """int64 ``[W, El]``: the rows of every rank's expert groups, padded to ``align``, from the group's counts (the
    same on every rank)."""
    W, El, a = plan.world_size, plan.num_local_experts, plan.align
    return ((plan.counts.to(torch.int64).sum(0) + a - 1) // a * a).view(W, El)


def received_rows(plan: RoutingPlan) -> torch.Tensor:
    """int64 ``[W]``: the expert-major rows (padding included) every rank receives in the plan's dispatch."""
    return padded_group_rows(plan).sum(1)


@dataclass(frozen=True)
class BufferRegion:
    """One symmetric buffer of the GPU backend: name, shape, dtype (allocated once per rank)."""

    name: str
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def pull_entry_words(topk: int) -> int:
    """int32 words of one pull-list entry: a 64-bit epoch tag, ``topk`` rows and the token's ``topk`` route weights
    (fp32 bits), padded to a power of two."""
    return 1 << (2 * topk + 1).bit_length()  # smallest power of two >= 2 * topk + 2


def dispatch_path(config: EPConfig, world_size: int, put_path: bool | None = None) -> str:
    """How the ``nvshmem`` backend moves rows (the single source of that choice), one of ``"local"``, ``"pull"``,
    ``"push"``, ``"put"`` (:data:`mxcomm.ep.config.PATHS`):

    * ``"put"``: put-with-signal (``put_path``; default ``config.transport == "put"``);
    * ``"local"``: one rank (``transport`` ``"auto"`` or ``"local"``): nothing leaves the GPU, so the sending kernel
      quantizes each token row once and stores it straight into the fresh output at every selection's row;
    * ``"pull"``: several ranks (``transport`` ``"auto"`` or ``"local"``), or ``transport="pull"`` (also on one rank,
      through its own buffers): receivers read packed rows through peer pointers;
    * ``"push"``: ``transport="push"``: senders store into the receivers' ``recv_q``.
    """
    if put_path is None:
        put_path = config.transport == "put"
    if put_path:
        return "put"
    if config.transport in ("auto", "local"):
        return "local" if world_size == 1 else "pull"
    return "pull" if config.transport == "pull" else "push"


def buffer_regions(config: EPConfig, world_size: int, put_path: bool | None = None) -> list[BufferRegion]:
    """The symmetric buffers the ``nvshmem`` backend allocates per rank (the single source of their sizes).

    Every path:

    * ``ep.counts`` int32 ``[W * E + W]``: the counts matrix ``[W, E]`` (row ``s`` written by rank ``s``), then
      every rank's refusal word (non-zero: it refused its input of this dispatch); ``ep.flags`` int64
      ``[len(FLAG_ROWS), W]`` (:data:`FLAG_ROWS`).

    Several ranks (every path but ``local``):

    * ``ep.comb_q`` uint8 ``[2, T_max*min(W, k), 2H]``: the partials combine (and dispatch backward) return, one per
      (token, rank), at the token's combine slot for that rank (:func:`combine_slots`: ``t * W + rank`` with ``W <
      k``, else the send position of the token's leading slot on that rank; two copies, alternate epochs; a BF16 row
      takes 2H bytes, MXFP8 rows are packed H bytes apart from the start of their copy);
    * ``ep.comb_s`` uint8 ``[2, T_max*min(W, k), H/32]``: their scale bytes;
    * ``ep.comb_w`` float32 ``[W, T_max, k]``: the route weights of every source (row ``s``), published at each
      combine for the expert side's weighted partial sums;
    * ``ep.comb_gw`` float32 ``[W, T_max, k]``: the route-weight gradients the expert ranks form in combine backward
      (row ``d``: those of the slots on rank ``d``);
    * ``ep.send_q`` uint8 ``[2, T_max, 2H]``: this rank's rows in two copies (alternate epochs of the dispatch
      direction): the pull dispatch's MXFP8 rows (H bytes apart from the start of a copy, quantized once) and
      combine backward's BF16 gradient rows; receivers read them through peer pointers (the put path: one copy,
      combine backward's rows staged for its puts);
    * ``ep.send_w`` float32 ``[2, T_max, k]``: combine backward's route weights of those rows (put path: one copy);
    * ``ep.pull_list`` int32 ``[W, T_max, pull_entry_words(k)]``: one entry per (source token, this rank) of each
      dispatch, ``[epoch (2 words), row of slot 0, ..., row of slot k-1, weight of slot 0, ..., weight of slot k-1]``
      (expert-major rows here, -1 for slots going elsewhere; the token's route weights, fp32 bits); the dispatch keeps
      its rows and weights as the handle's table (combine and combine backward move one row per entry; combine
      weights its partial sums with those weights when it is given the dispatch's).

    The pull path (the default with several ranks on one node) adds ``ep.send_s`` uint8 ``[2, T_max, H/32]`` (the
    MXFP8 rows' scale bytes); it has no receive buffer: receivers read what they need into fresh tensors, so none of
    its symmetric buffers depends on the routing. The ``push`` and ``put`` paths receive dispatch into a window of
    the expert-major rows, ``ep.recv_q`` uint8 ``[R_w, H]`` (mxfp8) or ``[R_w, 2H]`` (bf16 bytes) and ``ep.recv_s``
    uint8 ``[R_w, H/32]`` (their scale rows; 1 byte for bf16) with ``R_w`` = :func:`recv_window_rows` (a dispatch
    that brings some rank more moves in rounds), so none of their symmetric buffers depends on the routing either (the
    one-rank ``local`` path keeps ``recv_s`` ``[R_max, H/32]``, for the scale rows its kernel writes). The put path
    (``put_path``; default: ``config.transport == "put"``) adds its staging (``ep.stage_q`` uint8 ``[S, 2H]`` and
    ``ep.stage_s`` ``[S, H/32]`` with ``S = max(T_max * k, W * T_c)``, ``T_c`` = :func:`put_round_tokens`: the rows a
    dispatch sends, at most ``T_max * k`` in send order, or a round of the partials combine and dispatch backward
    return, one per (source, token) entry of the table for ``T_c`` tokens; ``ep.stage_list`` (pull-list entries per
    destination), ``ep.stage_gw``) and ``ep.recv_w`` float32 ``[W, T_max, k]``; its ``recv_q`` also holds a round of
    combine backward's gradient rows, one per (source, token) of ``T_c`` tokens: at least ``W * T_c * 2H`` bytes.
    """
    config.validate(world_size)
    path = dispatch_path(config, world_size, put_path)
    H, T, k, W = config.hidden, config.max_tokens_per_rank, config.topk, world_size
    R = max_recv_rows(config, world_size)
    mx = config.precision == "mxfp8"
    EW = pull_entry_words(k)
    regions = []
    window = recv_window_rows(config, W, path == "put") if path in ("push", "put") else R
    if path in ("push", "put"):
        row = H * (1 if mx else 2)
        rows = max(window, -(-W * put_round_tokens(config, W) * 2 * H // row)) if path == "put" else window
        regions.append(BufferRegion("ep.recv_q", (rows, row), torch.uint8))
    if path != "pull":
        regions.append(BufferRegion("ep.recv_s", (window, H // 32) if mx else (1,), torch.uint8))
    if path != "local":
        copies = 1 if path == "put" else 2  # the put path's send buffer is combine backward's staging alone
        regions += combine_regions(config, W) + [
            BufferRegion("ep.comb_w", (W, T, k), torch.float32),
            BufferRegion("ep.comb_gw", (W, T, k), torch.float32),
            BufferRegion("ep.send_q", (copies, T, 2 * H), torch.uint8),
            BufferRegion("ep.send_w", (copies, T, k), torch.float32),
            BufferRegion("ep.pull_list", (W, T, EW), torch.int32),
        ]
    regions += [
        BufferRegion("ep.counts", (W * config.num_experts + W,), torch.int32),
        BufferRegion("ep.flags", (len(FLAG_ROWS), W), torch.int64),
    ]
    if path == "pull":
        regions.append(BufferRegion("ep.send_s", (2, T, H // 32) if mx else (1,), torch.uint8))
    if path == "put":
        stage = max(T * k, W * put_round_tokens(config, W))
        regions += [
            BufferRegion("ep.stage_q", (stage, 2 * H), torch.uint8),
            BufferRegion("ep.stage_s", (stage, H // 32), torch.uint8),
            BufferRegion("ep.stage_list", (W, T, EW), torch.int32),
            BufferRegion("ep.stage_gw", (W, T, k), torch.float32),
            BufferRegion("ep.recv_w", (W, T, k), torch.float32),
        ]
    return regions


#: Rows of ``ep.flags`` (entry ``[row, s]`` is written by rank ``s``; flags only grow): the counts exchange and the
#: "ready" handshake (dispatch epoch), dispatch-direction arrivals, combine-direction arrivals, combine's published
#: route weights (combine epoch), combine backward's route-weight gradients, and the push and put paths' dispatch
#: rounds (every receiver copied the window out: the next round may write into it).
FLAG_ROWS = ("counts", "dispatch", "combine", "weights", "route_grad", "window")


def combine_slots(config: EPConfig, world_size: int) -> int:
    """Slots of one copy of ``ep.comb_q`` / ``ep.comb_s``: the partials combine (and dispatch backward) return to a
    rank, one per (token, rank), ``T_max * min(W, k)``. With ``W < k`` token ``t``'s partial from rank ``r`` is at
    slot ``t * W + r``; with ``W >= k`` a token has at most ``k`` partials, each at the send position of the token's
    leading slot on that rank (its first slot there), below ``T_max * k``."""
    return config.max_tokens_per_rank * min(world_size, config.topk)


def combine_regions(config: EPConfig, world_size: int) -> list[BufferRegion]:
    """``ep.comb_q`` / ``ep.comb_s``: the rows combine returns to this rank (see :func:`buffer_regions`)."""
    nslot = combine_slots(config, world_size)
    H = config.hidden
    return [BufferRegion("ep.comb_q", (2, nslot, 2 * H), torch.uint8),
            BufferRegion("ep.comb_s", (2, nslot, H // 32), torch.uint8)]


@dataclass(frozen=True)
class BufferSizes:
    """Bytes per rank of the GPU backend's symmetric buffers, by purpose (see :func:`buffer_regions`).

    dispatch_payload / dispatch_scales: the push and put paths' receive buffers (0 on the pull path; on the local
    path only the scale rows).
    combine_payload: the partials combine returns (two copies, incl. their scale bytes), the published route weights
    and the route-weight gradients coming home; 0 on the local path.
    counts, flags: the counts matrix and the signal words.
    put_staging: the put-with-signal path's staging buffers and its received weights (0 without it).
    pull_send: the send copies, their scales and weights, and the pull list (0 on the local path).
    """

    dispatch_payload: int
    dispatch_scales: int
    combine_payload: int
    counts: int
    flags: int
    put_staging: int = 0
    pull_send: int = 0

    @property
    def total(self) -> int:
        return (self.dispatch_payload + self.dispatch_scales + self.combine_payload + self.counts + self.flags
                + self.put_staging + self.pull_send)


def buffer_sizes(config: EPConfig, world_size: int, put_path: bool | None = None) -> BufferSizes:
    """Symmetric-buffer memory per rank the GPU backend allocates for ``config`` (see :class:`BufferSizes`;
    ``put_path`` as in :func:`buffer_regions`)."""
    b = {r.name: r.nbytes for r in buffer_regions(config, world_size, put_path)}
    return BufferSizes(
        dispatch_payload=b.get("ep.recv_q", 0),
        dispatch_scales=b.get("ep.recv_s", 0),
        combine_payload=sum(b.get(n, 0) for n in ("ep.comb_q", "ep.comb_s", "ep.comb_w", "ep.comb_gw")),
        counts=b["ep.counts"],
        flags=b["ep.flags"],
        put_staging=sum(b.get(n, 0) for n in ("ep.stage_q", "ep.stage_s", "ep.stage_list", "ep.stage_gw",
                                               "ep.recv_w")),
        pull_send=sum(b.get(n, 0) for n in ("ep.send_q", "ep.send_s", "ep.send_w", "ep.pull_list")),
    )


__all__ = ["RoutingPlan", "local_counts", "build_plan", "recv_rows", "send_tokens", "max_rows_per_source",
           "max_recv_rows", "call_output_rows", "recv_window_rows", "put_round_tokens", "padded_group_rows",
           "received_rows", "pull_entry_words", "FLAG_ROWS", "dispatch_path", "combine_slots", "combine_regions",
           "BufferSizes", "buffer_sizes", "BufferRegion", "buffer_regions"]
