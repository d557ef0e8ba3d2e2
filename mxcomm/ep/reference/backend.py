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
Combine: gather the expert rows in receive order, optionally quantize them (row-wise), the
reverse all-to-all, then the weighted fp32 sum at the origin (k ascending).
Backward (math in :mod:`mxcomm.ep.reference.backward`): combine backward = dispatch of the per-slot rows
``w * grad_y`` (fp32, then quantized) into the expert-major layout, plus the route-weight gradient
from the rows kept by :meth:`TorchBackend.combine_for_backward`; dispatch backward = combine of
``grad_recv`` with all weights 1.

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
from .backward import route_weight_grad, slot_grad_rows


def weighted_combine(rows: torch.Tensor, send_pos: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``y[t] = sum_j w[t,j] * rows[send_pos[t,j]]`` in fp32, j ascending, dropped slots (-1) give 0.

    Args:
        rows: float ``[n, H]`` returned expert rows in send order.
        send_pos: int ``[T, k]`` position of each slot in ``rows``, -1 = dropped.
        topk_weights: float ``[T, k]``.
    Returns:
        float32 ``[T, H]`` (the caller casts to bf16).
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
        dev = payload.device
        rows = recv_rows(plan, sum(recv_splits)).to(torch.int64)
        recv_p = self._all_to_all(payload, send_splits, recv_splits)
        out_p = torch.zeros(R, payload.shape[1], dtype=torch.uint8, device=dev)
        out_p[rows] = recv_p
        if scales is None:
            return out_p.view(torch.bfloat16)
        recv_s = self._all_to_all(scales, send_splits, recv_splits)
        out_s = torch.zeros(R, scales.shape[1], dtype=torch.uint8, device=dev)
        out_s[rows] = recv_s
        mx = MXTensor(
            qdata=out_p.view(torch.float8_e4m3fn), scales=out_s, axis=1, layout=ScaleLayout.ROW,
            mode=self.config.scale_mode, orig_dtype=torch.bfloat16,
        )
        return mx.with_layout(ScaleLayout.GROUPED_M, plan.offs)

    def _rows_to_origin(self, rows, handle: EPHandle, quantize_rows: bool):
        """Send expert-side rows (receive order) back to their origins.

        Args:
            rows: bfloat16/float ``[n_recv, H]`` dense rows, or an :class:`MXTensor` (ROW scales)
                sent as it is.
            quantize_rows: quantize dense rows to MXFP8 (row-wise, config scale mode) for transport.
        Returns:
            the rows at the origin in its send order: :class:`MXTensor` ``[n_send, H]`` (ROW scales)
            or bfloat16 ``[n_send, H]``.
        """
        back_splits = list(handle.recv_splits_host)   # rows this rank returns to each source
        home_splits = list(handle.send_splits_host)   # rows each expert rank returns to this rank
        if not isinstance(rows, MXTensor) and quantize_rows:
            rows = quantize(rows, mode=self.config.scale_mode)
        if isinstance(rows, MXTensor):
            got_p = self._all_to_all(rows.qdata.view(torch.uint8), back_splits, home_splits)
            got_s = self._all_to_all(rows.row_scales(), back_splits, home_splits)
            return MXTensor(
                qdata=got_p.view(torch.float8_e4m3fn), scales=got_s, axis=1, layout=ScaleLayout.ROW,
                mode=rows.mode, orig_dtype=torch.bfloat16,
            )
        got = self._all_to_all(rows.to(torch.bfloat16).contiguous().view(torch.uint8), back_splits, home_splits)
        return got.view(torch.bfloat16)

    # -- combine ----------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, handle: EPHandle, quantize_rows: bool) -> torch.Tensor:
        return self._combine(expert_out, handle, quantize_rows, "combine")[0]

    def combine_for_backward(self, expert_out: torch.Tensor, handle: EPHandle, quantize_rows: bool):
        """Forward combine that also returns the rows as they arrived (see :class:`CombineSaved`)."""
        return self._combine(expert_out, handle, quantize_rows, "combine_for_backward")

    def _combine(self, expert_out: torch.Tensor, handle: EPHandle, quantize_rows: bool, op: str):
        self._begin(op, f"T={handle.num_tokens}")
        plan = handle.plan
        n_recv, n_send = sum(handle.recv_splits_host), sum(handle.send_splits_host)
        rows = expert_out[recv_rows(plan, n_recv).to(torch.int64)]  # [n_recv, H] in receive order
        back = self._rows_to_origin(rows, handle, quantize_rows)
        vals = back.dequantize(torch.float32, saturate_to=torch.bfloat16) if isinstance(back, MXTensor) else back.to(torch.float32)
        assert vals.shape == (n_send, self.config.hidden)
        y = weighted_combine(vals, plan.send_pos, handle.topk_weights).to(torch.bfloat16)
        return y, CombineSaved(rows=back)

    # -- backward ---------------------------------------------------------------------------
    def combine_backward(self, grad_y: torch.Tensor, handle: EPHandle, saved, quantize_rows: bool) -> CombineGrads:
        """See :meth:`mxcomm.ep.steps.EPSteps.combine_backward` (math in :mod:`mxcomm.ep.reference.backward`)."""
        self._begin("combine_backward", f"T={handle.num_tokens}")
        plan = handle.plan
        send_splits, recv_splits = list(handle.send_splits_host), list(handle.recv_splits_host)
        g = slot_grad_rows(grad_y, handle.topk_weights, plan.send_order[: sum(send_splits)])  # fp32, send order
        if quantize_rows:
            q = quantize(g, mode=self.config.scale_mode)
            grad_out = self._rows_to_experts(
                q.qdata.view(torch.uint8), q.scales, plan, handle.num_rows, send_splits, recv_splits
            )
        else:
            grad_out = self._rows_to_experts(
                g.to(torch.bfloat16).view(torch.uint8), None, plan, handle.num_rows, send_splits, recv_splits
            )
        grad_w = None if saved is None else route_weight_grad(grad_y, saved.rows, plan.send_pos)
        return CombineGrads(grad_expert_out=grad_out, grad_weights=grad_w)

    def dispatch_backward(self, grad_recv, handle: EPHandle, quantize_rows: bool) -> torch.Tensor:
        """See :meth:`mxcomm.ep.steps.EPSteps.dispatch_backward`."""
        self._begin("dispatch_backward", f"T={handle.num_tokens}")
        plan = handle.plan
        rows = recv_rows(plan, sum(handle.recv_splits_host)).to(torch.int64)
        if isinstance(grad_recv, MXTensor):
            sent = MXTensor(
                qdata=grad_recv.qdata.view(torch.uint8)[rows].view(torch.float8_e4m3fn),
                scales=grad_recv.row_scales()[rows], axis=1, layout=ScaleLayout.ROW, mode=grad_recv.mode,
                orig_dtype=torch.bfloat16,
            )
        else:
            sent = grad_recv[rows]
        back = self._rows_to_origin(sent, handle, quantize_rows)
        vals = back.dequantize(torch.float32, saturate_to=torch.bfloat16) if isinstance(back, MXTensor) else back.to(torch.float32)
        ones = torch.ones(plan.send_pos.shape, dtype=torch.float32, device=vals.device)
        return weighted_combine(vals, plan.send_pos, ones).to(torch.bfloat16)


__all__ = ["TorchBackend", "weighted_combine"]
