"""The ``torch`` reference EP backend: quantize, then torch.distributed all-to-all (what
torchao-style MXFP8 EP does today). The oracle every fast path is checked against, and the
baseline every benchmark is compared to. Runs on CPU with gloo and on GPU with NCCL (or gloo,
staging through host memory).

Dispatch:
  1. quantize ``x`` once per token (``mxcomm.mx.quantize``, row layout, the config's scale mode);
  2. all_gather each rank's per-expert counts -> the ``[W, E]`` counts matrix -> RoutingPlan;
  3. send buffer = the quantized rows in send order (destination rank, destination row);
  4. ``all_to_all_single`` of payload and scales as uint8 views (NCCL does not take fp8);
  5. place the received rows at their expert-major rows (padding stays zero), then lay the
     scales out grouped-along-M (``MXTensor.with_layout``).
Combine (math in :mod:`mxcomm.ep.reference.backward`), one row per (token, rank):
  1. the origin sends, in send order, each valid slot's flat index ``t*k + j`` (int32) and fp32 route weight
     (``all_to_all_single``, 8 bytes per slot);
  2. each expert rank forms, per (source, token), the partial ``sum_j w[t,j] * expert_out[row(t,j)]`` in fp32
     (``j`` ascending, one vectorised step per ``j``), rounds it once (MXFP8 row-wise, or BF16) and sends one row
     per pair back, per source its tokens ascending (``all_to_all_single`` of payload + scale bytes packed in one
     uint8 row of ``H + H/32`` bytes, or of ``2H`` BF16 bytes);
  3. the origin decodes the partials and sums them in fp32 per token, the ranks in order of first appearance over
     ``j``; BF16 result.
Backward:
  * combine backward: the origin sends each valid slot's index and weight (8 bytes per slot) and ``grad_y`` once per
    (token, rank) as BF16 (``2H`` bytes per pair, per rank its tokens ascending); each expert rank forms the per-slot
    rows ``w[t,j] * grad_y[t]`` in fp32, rounds each (MXFP8 row-wise or BF16) into the expert-major layout, and with
    a :class:`CombineSaved` (the expert output, kept on the expert rank) dots ``grad_y`` with its expert rows and
    returns one fp32 per slot (the route-weight gradient);
  * dispatch backward: the combine exchange with every weight 1 (the slot indices only: 4 bytes per slot) on the
    decoded gradient (an MX gradient is dequantized, summed per (token, rank) and rounded again for transport).

It synchronises with the host (split sizes of the all-to-all live on the host) in both size
modes; ``exact_sizes=False`` only changes the output shapes.

Every collective goes through the group's :class:`~mxcomm.transport.BoundedGroup`: it waits at most
``EPConfig.timeout_s`` and carries a tag (``dispatch #5 (T=128)``); a peer that does not arrive, died, called another
step or refused its input makes every rank that waited raise :class:`~mxcomm.transport.PeerTimeout` naming it. On
NCCL a bounded wait blocks the host until the GPU work is done (a host sync per collective).
"""
from __future__ import annotations

import torch

from ...mx import MXTensor, ScaleLayout, quantize
from ...transport.bounded import BoundedGroup, CallTag
from ..collectives import collective_device
from ..config import EPConfig
from ..handle import CombineGrads, CombineSaved, DispatchResult, EPHandle
from ..plan import build_plan, local_counts, max_recv_rows, recv_rows, send_tokens
from .backward import bf16_saturated, decode_rows, route_weight_grad, sum_to_bf16


def weighted_combine(rows: torch.Tensor, send_pos: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``y[t] = sum_j w[t,j] * rows[send_pos[t,j]]`` in fp32, j ascending (each product rounded to fp32, then
    the add), entries -1 add nothing.

    Args:
        rows: float ``[n, H]``.
        send_pos: int ``[T, k]`` position in ``rows`` of each term, -1 = none.
        topk_weights: float ``[T, k]``.
    Returns:
        float32 ``[T, H]``.
    """
    n, H = rows.shape
    T, k = send_pos.shape
    rows = torch.cat([rows.to(torch.float32), rows.new_zeros(1, H, dtype=torch.float32)])
    pos = send_pos.to(torch.int64)
    w = topk_weights.to(torch.float32)
    acc = torch.zeros(T, H, dtype=torch.float32, device=rows.device)
    for j in range(k):
        valid = pos[:, j] >= 0
        v = rows[torch.where(valid, pos[:, j], torch.full_like(pos[:, j], n))]
        acc = acc + torch.where(valid.view(T, 1), w[:, j].view(T, 1) * v, torch.zeros_like(v))
    return acc


class TorchBackend:
    """Reference backend (see module doc). Built by :class:`mxcomm.ep.group.EPGroup`."""

    path = "all_to_all"
    device_side_checks = False
    memory_bytes = 0  # no symmetric buffers: every call allocates its own

    def __init__(self, config: EPConfig, group, rank: int, world_size: int, *, group_id: int = 0,
                 bounded: BoundedGroup | None = None):
        self.config = config
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.group_id = group_id
        self.num_local_experts = config.num_local_experts(world_size)
        # every collective waits at most config.timeout_s and names the peers on failure (mxcomm.transport.bounded)
        self.bounded = bounded if bounded is not None else BoundedGroup(group, timeout_s=config.timeout_s)
        self._calls = 0  # calls of this group's steps: the tag each exchange carries
        self._tag = CallTag("none", 0)

    def _begin(self, op: str, detail: str) -> None:
        """A step starts: the tag its exchanges carry (``op #n (detail)``), compared on a failure."""
        self._calls += 1
        self._tag = CallTag(op, self._calls, detail)

    def refuse(self, op: str, exc: BaseException) -> None:
        self.bounded.refuse(CallTag(op, self._calls + 1, "input refused"), exc)

    # -- the backend protocol's small parts (mxcomm.ep.backend) -----------------------------------
    def check_errors(self) -> None:
        """Nothing to do: every call checks itself synchronously."""

    def state_tensors(self, handle: EPHandle) -> list:
        return []

    def state_shapes(self, num_tokens: int, num_rows: int) -> list:
        return []

    def handle_fields(self, plan, tensors: list) -> dict:
        """Host split sizes of the all-to-alls, read from the plan (a host sync)."""
        return dict(send_splits_host=tuple(plan.send_splits.tolist()), recv_splits_host=tuple(plan.recv_splits.tolist()))

    # -- collectives (stage through the group's device when the data lives elsewhere) --------
    def _all_gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return counts.view(1, -1)
        dev = collective_device(self.group, counts.device)
        bufs = self.bounded.all_gather(counts.to(dev), self._tag)
        return torch.stack(bufs).to(counts.device)

    def _all_to_all(self, send: torch.Tensor, send_splits: list, recv_splits: list) -> torch.Tensor:
        """Row all-to-all of a uint8 ``[n, B]`` tensor; returns uint8 ``[sum(recv_splits), B]``."""
        if self.world_size == 1:
            return send.clone()
        dev = collective_device(self.group, send.device)
        out = torch.empty(sum(recv_splits), send.shape[1], dtype=torch.uint8, device=dev)
        self.bounded.all_to_all_single(out, send.to(dev).contiguous(), recv_splits, send_splits, self._tag)
        return out.to(send.device)

    # -- dispatch ---------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        self._begin("dispatch", f"T={x.shape[0]}")
        cfg = self.config
        dev = x.device
        T, H = x.shape
        counts = self._all_gather_counts(local_counts(topk_idx, cfg.num_experts))
        plan = build_plan(counts, topk_idx.to(dev), self.rank, cfg.align)
        send_splits = plan.send_splits.tolist()
        recv_splits = plan.recv_splits.tolist()
        n_send = sum(send_splits)
        R = int(plan.num_rows.item()) if cfg.exact_sizes else max_recv_rows(cfg, self.world_size)

        tok = send_tokens(plan, n_send)
        if cfg.precision == "mxfp8":
            q = quantize(x, mode=cfg.scale_mode)  # once per token, row layout
            out_x = self._rows_to_experts(q.qdata.view(torch.uint8)[tok], q.scales[tok], plan, R, send_splits, recv_splits)
        else:
            payload = x.contiguous().view(torch.uint8)  # [T, 2H] bytes of bf16
            out_x = self._rows_to_experts(payload[tok], None, plan, R, send_splits, recv_splits)

        result = DispatchResult(x=out_x, offs=plan.offs, counts=plan.expert_counts, num_rows=R)
        handle = EPHandle(
            config=cfg, group_id=self.group_id, plan=plan, topk_idx=topk_idx, topk_weights=topk_weights,
            weights_version=topk_weights._version, num_tokens=T, num_rows=R, device=dev,
            send_splits_host=tuple(send_splits), recv_splits_host=tuple(recv_splits),
        )
        return result, handle

    # -- row movement shared by the forward and backward passes --------------------------------
    def _rows_to_experts(self, payload, scales, plan, R: int, send_splits: list, recv_splits: list):
        """Send rows in send order to the expert ranks and lay them out expert-major.

        Args:
            payload: uint8 ``[n_send, B]`` (MXFP8 payload bytes, B = H; or BF16 bytes, B = 2H).
            scales: uint8 ``[n_send, H/32]`` row scales (MXFP8) or None (BF16).
        Returns:
            MXTensor ``[R, H]`` with GROUPED_M scales on ``plan.offs`` (MXFP8) or bfloat16 ``[R, H]``;
            padding rows zero.
        """
        recv_p = self._all_to_all(payload, send_splits, recv_splits)
        recv_s = None if scales is None else self._all_to_all(scales, send_splits, recv_splits)
        return self._expert_major(recv_p, recv_s, plan, R)

    def _expert_major(self, payload, scales, plan, R: int):
        """Rows in receive order -> the expert-major layout: payload uint8 ``[n_recv, B]`` and row scales uint8
        ``[n_recv, H/32]`` (MXFP8) or None (BF16 bytes). Returns an MXTensor with GROUPED_M scales on ``plan.offs`` or
        bfloat16 ``[R, H]``; padding rows zero (payload and scale bytes)."""
        dev = payload.device
        rows = recv_rows(plan, payload.shape[0]).to(torch.int64)
        out_p = torch.zeros(R, payload.shape[1], dtype=torch.uint8, device=dev)
        out_p[rows] = payload
        if scales is None:
            return out_p.view(torch.bfloat16)
        out_s = torch.zeros(R, scales.shape[1], dtype=torch.uint8, device=dev)
        out_s[rows] = scales
        mx = MXTensor(
            qdata=out_p.view(torch.float8_e4m3fn), scales=out_s, axis=1, layout=ScaleLayout.ROW,
            mode=self.config.scale_mode, orig_dtype=torch.bfloat16,
        )
        return mx.with_layout(ScaleLayout.GROUPED_M, plan.offs)

    # -- combine-direction exchanges: one row per (token, rank) ----------------------------------
    def _slots_at_experts(self, handle: EPHandle, weights):
        """Tell the expert ranks which slot each row they received is: one all-to-all in send order of the flat slot
        ``t*k + j`` (int32) and, with ``weights``, its fp32 route weight (4 or 8 bytes per valid slot).

        Returns:
            the :class:`_Pairs` this rank holds rows of as the expert side (weights 1 when ``weights`` is None).
        """
        plan = handle.plan
        send_splits, recv_splits = list(handle.send_splits_host), list(handle.recv_splits_host)
        slot = plan.send_order[: sum(send_splits)].to(torch.int32)
        meta = slot.view(-1, 1)
        if weights is not None:
            w = weights.reshape(-1).to(torch.float32)[slot.to(torch.int64)]
            meta = torch.stack([slot, w.view(torch.int32)], 1)
        got = self._all_to_all(meta.contiguous().view(torch.uint8), send_splits, recv_splits).view(torch.int32)
        dev, k = got.device, plan.topk
        rslot = got[:, 0].to(torch.int64)
        rj = rslot % k
        src = torch.repeat_interleave(torch.arange(self.world_size, device=dev),
                                      torch.tensor(recv_splits, dtype=torch.int64, device=dev))
        # pairs (source, token), sources ascending then tokens ascending: the order of the rows sent back
        span = handle.config.max_tokens_per_rank + 1
        uniq, inv = torch.unique(src * span + rslot // k, sorted=True, return_inverse=True)
        n = uniq.numel()
        pos = torch.full((n, k), -1, dtype=torch.int64, device=dev)
        pos[inv, rj] = recv_rows(plan, sum(recv_splits)).to(torch.int64)
        wm = torch.zeros(n, k, dtype=torch.float32, device=dev)
        if weights is None:
            wm[inv, rj] = 1.0
        else:
            wm[inv, rj] = got[:, 1].contiguous().view(torch.float32)
        splits = torch.bincount(uniq // span, minlength=self.world_size).tolist()
        return _Pairs(pos=pos, weights=wm, inv=inv, slot_j=rj, splits=splits)

    def _home_pairs(self, handle: EPHandle):
        """The origin's (token, rank) pairs, rank-major with tokens ascending per rank (the order both directions
        of the per-pair exchanges use).

        Returns:
            ``(tok, splits, first)``: ``tok`` int64 ``[n_pairs]`` the token of each pair; ``splits[d]`` the pairs
            with rank ``d`` (host ints); ``first`` int64 ``[T, k]``: the position of the pair ``(t, dest(t, j))``
            where ``j`` is the first slot of ``t`` on that rank, else -1 (a sum over ``j`` of the pairs at
            ``first`` takes the ranks in order of first appearance).
        """
        plan = handle.plan
        W, T, k = self.world_size, plan.num_tokens, plan.topk
        dest = plan.dest_rank.to(torch.int64)
        dev = dest.device
        valid = dest >= 0
        d = torch.where(valid, dest, torch.full_like(dest, W))
        has = torch.zeros(T, W + 1, dtype=torch.bool, device=dev)
        has.scatter_(1, d, torch.ones_like(valid))
        has = has[:, :W].t()                                               # [W, T]
        at = (torch.cumsum(has.reshape(-1).to(torch.int64), 0) - 1).view(W, T)  # position of pair (d, t)
        earlier = torch.tril(torch.ones(k, k, dtype=torch.bool, device=dev), diagonal=-1)  # j' < j
        first = valid & ~((d.unsqueeze(2) == d.unsqueeze(1)) & earlier).any(2)
        tok = torch.arange(T, device=dev).view(T, 1).expand(T, k)
        pos = torch.where(first, at[d.clamp(max=W - 1), tok], torch.full_like(dest, -1))
        return torch.nonzero(has, as_tuple=True)[1], has.sum(1).tolist(), pos

    def _encode(self, p: torch.Tensor, quantize_rows: bool) -> torch.Tensor:
        """fp32 rows -> the bytes that travel: MXFP8 payload + row scales ``[n, H + H/32]`` or BF16 ``[n, 2H]``."""
        if quantize_rows:
            q = quantize(p, mode=self.config.scale_mode)
            return torch.cat([q.qdata.view(torch.uint8), q.scales], 1)
        return bf16_saturated(p).contiguous().view(torch.uint8)

    def _decode(self, b: torch.Tensor, quantize_rows: bool) -> torch.Tensor:
        """The travelled bytes of :meth:`_encode` -> fp32 values (``Tq`` of the rows)."""
        H = self.config.hidden
        if quantize_rows:
            mx = MXTensor(qdata=b[:, :H].contiguous().view(torch.float8_e4m3fn), scales=b[:, H:].contiguous(), axis=1,
                          layout=ScaleLayout.ROW, mode=self.config.scale_mode, orig_dtype=torch.bfloat16)
            return mx.dequantize(torch.float32, saturate_to=torch.bfloat16)
        return b.contiguous().view(torch.bfloat16).to(torch.float32)

    def _reduce_to_origin(self, vals: torch.Tensor, handle: EPHandle, weights, quantize_rows: bool) -> torch.Tensor:
        """The combine formula: partials per (token, rank) on the expert side from the fp32 expert-major rows
        ``vals`` and ``weights`` (None: every weight 1), one rounded row per pair back, the origin's sum. Returns
        bfloat16 ``[T, H]``."""
        pairs = self._slots_at_experts(handle, weights)
        part = weighted_combine(vals, pairs.pos, pairs.weights)  # fp32 [n_pairs, H], j ascending
        _, home_splits, first = self._home_pairs(handle)
        got = self._all_to_all(self._encode(part, quantize_rows), pairs.splits, home_splits)
        back = self._decode(got, quantize_rows)
        ones = torch.ones(first.shape, dtype=torch.float32, device=back.device)
        bad = weighted_combine((~torch.isfinite(back)).to(torch.float32), first, ones) > 0  # a partial Inf/NaN there
        return sum_to_bf16(weighted_combine(back, first, ones), ~bad)

    # -- combine ----------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, handle: EPHandle, quantize_rows: bool) -> torch.Tensor:
        return self._combine(expert_out, handle, quantize_rows, "combine")[0]

    def combine_for_backward(self, expert_out: torch.Tensor, handle: EPHandle, quantize_rows: bool):
        """Forward combine that also returns what the route-weight gradient needs: the expert output itself
        (:class:`CombineSaved`; nothing is copied)."""
        return self._combine(expert_out, handle, quantize_rows, "combine_for_backward")

    def _combine(self, expert_out: torch.Tensor, handle: EPHandle, quantize_rows: bool, op: str):
        self._begin(op, f"T={handle.num_tokens}")
        y = self._reduce_to_origin(expert_out, handle, handle.topk_weights, quantize_rows)
        return y, CombineSaved(rows=expert_out)

    # -- backward ---------------------------------------------------------------------------
    def combine_backward(self, grad_y: torch.Tensor, handle: EPHandle, saved, quantize_rows: bool) -> CombineGrads:
        """See :meth:`mxcomm.ep.steps.EPSteps.combine_backward` (math in :mod:`mxcomm.ep.reference.backward`):
        ``grad_y`` crosses once per (token, rank) as BF16 with the slots' indices and weights; each expert rank forms
        the per-slot rows ``w[t,j] * grad_y[t]`` (fp32), rounds each (MXFP8 row-wise or BF16) into the dispatch
        layout, and with ``saved`` (its expert output) returns ``<grad_y[t], expert_out[row(t,j)]>`` per slot."""
        self._begin("combine_backward", f"T={handle.num_tokens}")
        plan = handle.plan
        pairs = self._slots_at_experts(handle, handle.topk_weights)
        tok, home_splits, _ = self._home_pairs(handle)
        gy = self._all_to_all(grad_y.contiguous()[tok].view(torch.uint8), home_splits, pairs.splits)
        gy = gy.view(torch.bfloat16)                                              # [n_pairs, H] on the expert side
        w = pairs.weights[pairs.inv, pairs.slot_j]                                # receive order
        g = w.view(-1, 1) * gy[pairs.inv].to(torch.float32)                       # w[t,j] * grad_y[t], fp32
        if quantize_rows:
            q = quantize(g, mode=self.config.scale_mode)
            grad_out = self._expert_major(q.qdata.view(torch.uint8), q.scales, plan, handle.num_rows)
        else:
            grad_out = self._expert_major(g.to(torch.bfloat16).view(torch.uint8), None, plan, handle.num_rows)
        grad_w = None if saved is None else self._route_weight_grad(gy, pairs, handle, saved.rows)
        return CombineGrads(grad_expert_out=grad_out, grad_weights=grad_w)

    def _route_weight_grad(self, gy: torch.Tensor, pairs: "_Pairs", handle: EPHandle,
                           expert_out: torch.Tensor) -> torch.Tensor:
        """``grad_w[t,j] = <grad_y[t], expert_out[row(t,j)]>`` formed where the expert rows are (``gy``: ``grad_y`` of
        each pair, there); the dots (fp32) go home one per slot. Returns float32 ``[T, k]``."""
        plan = handle.plan
        send_splits, recv_splits = list(handle.send_splits_host), list(handle.recv_splits_host)
        dots = route_weight_grad(gy, expert_out, pairs.pos)  # [n_pairs, k] fp32
        per_row = dots[pairs.inv, pairs.slot_j].contiguous()   # receive order
        back = self._all_to_all(per_row.view(torch.uint8).view(-1, 4), recv_splits, send_splits)
        vals = back.contiguous().view(torch.float32).view(-1)  # send order
        pos = plan.send_pos.to(torch.int64)
        vals = torch.cat([vals, vals.new_zeros(1)])
        return torch.where(pos >= 0, vals[torch.where(pos >= 0, pos, torch.full_like(pos, vals.numel() - 1))],
                           torch.zeros((), dtype=torch.float32, device=vals.device))

    def dispatch_backward(self, grad_recv, handle: EPHandle, quantize_rows: bool) -> torch.Tensor:
        """See :meth:`mxcomm.ep.steps.EPSteps.dispatch_backward` (math in :mod:`mxcomm.ep.reference.backward`)."""
        self._begin("dispatch_backward", f"T={handle.num_tokens}")
        return self._reduce_to_origin(decode_rows(grad_recv), handle, None, quantize_rows)


class _Pairs:
    """The (source, token) pairs an expert rank holds rows of, sources ascending then tokens ascending.

    Attributes:
        pos: int64 ``[n, k]``: the expert-major row of slot ``j`` of the pair's token here, -1 where that slot is not
            on this rank.
        weights: float32 ``[n, k]``: its route weight (1 for the dispatch backward), 0 where ``pos`` is -1.
        inv: int64 ``[n_recv]``: the pair of each received row (receive order); slot_j: its slot ``j``.
        splits: pairs per source rank (host ints).
    """

    __slots__ = ("pos", "weights", "inv", "slot_j", "splits")

    def __init__(self, pos, weights, inv, slot_j, splits):
        self.pos, self.weights, self.inv, self.slot_j, self.splits = pos, weights, inv, slot_j, splits


__all__ = ["TorchBackend", "weighted_combine"]
