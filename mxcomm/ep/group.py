"""EPGroup: the expert-parallel dispatch/combine object, and its public pair of calls.

    group = EPGroup(EPConfig(num_experts=256, hidden=7168, topk=8, max_tokens_per_rank=4096,
                             precision="mxfp8", backend="nvshmem"), process_group)
    out = group.dispatch(x, topk_idx, topk_weights)     # Dispatched: out.x [R, H] expert-major, out.offs, out.handle
    y = group.combine(experts(out.dense(), out.offs), out.handle)   # bf16 [T, H]
    loss(y).backward()                                  # gradients reach x, topk_weights (router), the experts

    c = group.combine(expert_out, out.handle, stream=comm)   # on the stream `comm`: a Combined (y + event)
    other_layer_gemm()                                  # overlaps the combine (on the current stream)
    y = c.wait()                                        # the current stream waits for the combine

:meth:`EPGroup.dispatch` / :meth:`EPGroup.combine` are autograd-aware and run under ``torch.compile`` (with
``EPConfig.exact_sizes=False`` without a graph break: :mod:`mxcomm.ep.compiled`). ``EPGroup.steps``
(:class:`~mxcomm.ep.steps.EPSteps`) holds the four collectives without autograd. The group checks that the config is
identical on every rank, validates every call's inputs before anything is written or sent
(:mod:`mxcomm.ep.validate`) and delegates to a backend (:mod:`mxcomm.ep.backend`).

``stream=`` (:mod:`mxcomm.ep.streams`) runs a call on a communication stream and returns its completion event with
the result. The calls of one group share symmetric buffers and epochs: issue them in the same order on every rank
and never concurrently on two streams (all on one communication stream, or ordered by events); compute on other
streams may run concurrently. ``EPGroup.steps`` takes no ``stream=``: it runs on the current stream, and a framework
that calls it on a side stream does the waits, ``record_stream`` marks and events itself
(:func:`mxcomm.ep.streams.begin` / :func:`~mxcomm.ep.streams.finish` are those steps). See docs/design.md,
"Overlapping communication with compute".
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from ..mx.subclass import MXFP8Tensor
from . import compiled, functions, streams, validate
from .backend import make_backend
from ..transport.bounded import BoundedGroup
from .collectives import agree_on_config
from .config import EPConfig
from .handle import Dispatched, EPHandle
from .plan import buffer_sizes
from .registry import GROUPS
from .steps import REFUSALS, EPSteps
from .streams import Combined


def _timeout_of(config) -> float:
    """``config.timeout_s`` where it is usable, else 60 s (the vote that reports the bad config must still end)."""
    t = getattr(config, "timeout_s", None)
    ok = isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < float("inf")
    return float(t) if ok else 60.0


class EPGroup:
    """Expert-parallel dispatch/combine over a torch.distributed process group.

    Args:
        config: :class:`EPConfig`; must be valid and identical on every rank (checked collectively: a config that
            is invalid on one rank, or differs between ranks, makes every rank raise a ValueError naming the ranks
            and fields, within ``config.timeout_s``).
        group: process group (None = WORLD). ``torch.distributed`` must be initialised.

    Attributes:
        config, group, rank, world_size, num_local_experts, local_experts (range of global ids).
        steps: :class:`~mxcomm.ep.steps.EPSteps`, the collectives without autograd.
        backend: the backend object (:class:`~mxcomm.ep.backend.Backend`).
        bounded: the :class:`~mxcomm.transport.BoundedGroup` over ``group`` (collectives bounded by ``timeout_s``).
        memory_bytes: symmetric-buffer bytes the backend allocated (0 for the reference backend, which allocates
            its buffers per call).
        op_id: the group's id (how the compiled ops and the handles name it).
    """

    def __init__(self, config: EPConfig, group=None):
        if not isinstance(config, EPConfig):  # a programming error, raised before any collective
            raise TypeError(f"config must be an EPConfig, got {type(config).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("EPGroup needs torch.distributed initialised (init_process_group) first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # every collective of the reference backend and the config vote below wait at most timeout_s
        self.bounded = BoundedGroup(group, timeout_s=_timeout_of(config))
        agree_on_config(config, self.bounded)  # every rank raises if the config is invalid or differs anywhere
        self.config = config
        self.num_local_experts = config.num_local_experts(self.world_size)
        self.local_experts = range(self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts)
        self.op_id: int = GROUPS.register(self)
        self.backend = make_backend(config, group, self.rank, self.world_size, self.op_id, self.bounded)
        self.steps = EPSteps(config, self.op_id, self.backend)
        self.memory_bytes = self.backend.memory_bytes

    @property
    def path(self) -> str:
        """How this group moves rows, one of :data:`mxcomm.ep.config.PATHS`: ``"all_to_all"`` (torch backend),
        ``"local"`` (nvshmem, one rank: the kernels write the outputs directly), ``"pull"`` (nvshmem, one node, the
        default with several ranks: dispatch receivers read the packed rows through peer pointers, the other ops
        store into peers' buffers), ``"push"`` (every op stores into peers' buffers) or ``"put"`` (NVSHMEM
        put-with-signal: forced, or peers on other nodes)."""
        return self.backend.path

    @staticmethod
    def buffer_bytes(config: EPConfig, world_size: int, put_path: bool | None = None) -> int:
        """Symmetric-buffer bytes per rank the nvshmem backend allocates (:func:`mxcomm.ep.plan.buffer_sizes`).
        ``put_path``: size for the put-with-signal path (default: only when ``config.transport == "put"``); pass
        True to plan a multi-node job with ``transport="auto"``, which takes that path when peers are on other
        nodes."""
        return buffer_sizes(config, world_size, put_path).total

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                 grad_quantize: Optional[bool] = None, stream: Optional[torch.cuda.Stream] = None) -> Dispatched:
        """Send each token's row to the ranks of its top-k experts (differentiable with respect to ``x``).

        Args:
            x: bfloat16 ``[T, H]``, ``T <= max_tokens_per_rank`` (T may be 0).
            topk_idx: int32/int64 ``[T, k]`` global expert ids, -1 = dropped slot (no gradient).
            topk_weights: float ``[T, k]`` route weights: not used by dispatch itself; kept (attached to the autograd
                graph) in the handle so that :meth:`combine` weights with them and differentiates with respect to
                them. Do not modify them in place until combine and its backward ran (combine raises if you do).
            grad_quantize: MXFP8 transport of the gradient in the backward (default: ``precision == "mxfp8"``).
            stream: None (default): everything on the current stream. A ``torch.cuda.Stream`` on ``x``'s device: the
                call (and later its backward) runs on that stream after it waited for the current one; the result's
                ``event`` says when it finished (``out.event.wait()`` before reading ``out``'s tensors on another
                stream; do not modify the inputs in place before that). Not under ``torch.compile``; CUDA tensors only.
        Returns:
            :class:`Dispatched`: ``x`` ``[R, H]`` expert-major (an :class:`MXFP8Tensor` with GROUPED_M scales for
            precision ``"mxfp8"``, else bfloat16), ``offs`` / ``counts`` int32 ``[El]``, ``num_rows``, ``handle``,
            ``event`` (an :class:`~mxcomm.ep.streams.EPEvent` with ``stream``, else None).
        Collective (forward and backward): every rank of the group calls it.
        """
        if stream is not None:
            streams.refuse_compiling()
            try:  # before any work: TypeError / ValueError
                streams.check_stream(stream, x)
            except REFUSALS as exc:
                self.backend.refuse("dispatch", exc)
                raise
            return functions.dispatch(self.steps, x, topk_idx, topk_weights, grad_quantize, stream)
        if torch.compiler.is_compiling():
            if not self.config.exact_sizes:
                return compiled.dispatch(self, x, topk_idx, topk_weights, grad_quantize)
            return functions.dispatch_graph_break(self.steps, x, topk_idx, topk_weights, grad_quantize)
        return functions.dispatch(self.steps, x, topk_idx, topk_weights, grad_quantize)

    def combine(self, expert_out: torch.Tensor, handle: EPHandle, *, topk_weights: Optional[torch.Tensor] = None,
                quantize: Optional[bool] = None, grad_quantize: Optional[bool] = None,
                grad_format: str = "dense",
                stream: Optional[torch.cuda.Stream] = None) -> Union[torch.Tensor, Combined]:
        """Return expert rows to their origin and reduce: ``y[t] = sum_j w[t,j] * out[row(t,j)]`` (differentiable
        with respect to ``expert_out`` and the weights).

        Args:
            expert_out: dense bfloat16 ``[R, H]`` in the dispatch output's layout (padding rows are ignored; their
                gradient is zero).
            handle: ``Dispatched.handle`` of the matching dispatch (of this group).
            topk_weights: float ``[T, k]`` weights to combine with (default: the tensor given to dispatch). Its
                gradient is the route-weight gradient.
            quantize: MXFP8 transport of the returned rows (default: ``precision == "mxfp8"``).
            grad_quantize: MXFP8 transport of ``w * grad_y`` in the backward (default: ``precision == "mxfp8"``).
            grad_format: ``"dense"``: ``expert_out`` gets a bfloat16 gradient; ``"mx"``: an :class:`MXFP8Tensor`
                (GROUPED_M scales, ready for an MX dgrad GEMM) when the gradient travelled as MXFP8.
            stream: None (default): everything on the current stream, returns the tensor. A ``torch.cuda.Stream`` on
                ``expert_out``'s device: the call (and later its backward) runs on that stream after it waited for the
                current one, and returns a :class:`~mxcomm.ep.streams.Combined` (``y`` and ``event``; ``c.wait()``
                makes the current stream wait and returns ``y``). Do not modify the inputs in place before the event.
                Not under ``torch.compile``, nor with the handle of a dispatch that ran as a custom op.
        Returns:
            bfloat16 ``[T, H]``: per (token, rank) the weighted rows summed in fp32 (``j`` ascending) and rounded once for
            transport, the partials summed in fp32; dropped slots contribute 0 (inside a
            :class:`~mxcomm.ep.streams.Combined` with ``stream``).
        Memory: when the weights require grad, the backward needs ``expert_out`` itself (the route-weight gradient
        is formed where those rows are); nothing else is kept.
        Collective (forward and backward).
        """
        if stream is not None:
            streams.refuse_compiling()
        try:  # a refusal is told to the peers before it propagates
            if stream is not None:
                streams.check_stream(stream, expert_out)
            validate.grad_format(grad_format)
            if isinstance(expert_out, MXFP8Tensor):
                raise TypeError("expert_out must be a dense bfloat16 tensor (combine of an MX expert output is not "
                                "supported)")
            validate.handle_of(self.config, self.op_id, handle)
            w = handle.topk_weights if topk_weights is None else topk_weights
            validate.combine_weights(handle, w)
        except REFUSALS as exc:
            self.backend.refuse("combine", exc)
            raise
        mx = self.config.precision == "mxfp8"
        q = mx if quantize is None else bool(quantize)
        gq = mx if grad_quantize is None else bool(grad_quantize)
        if handle.op_state is not None:  # a dispatch that ran as a custom op: combine through the ops too
            with self.steps.refusing("combine"):
                validate.combine_inputs(self.config, self.op_id, expert_out, handle)
                if stream is not None:
                    raise ValueError("stream= is not supported with the handle of a dispatch that ran as a custom "
                                     "op (torch.compile): the ops run on the current stream")
            return compiled.combine(self, expert_out, handle, w, q, gq, grad_format)
        if stream is not None:
            return functions.combine(self.steps, expert_out, handle, w, q, gq, grad_format, stream)
        if torch.compiler.is_compiling():
            return functions.combine_graph_break(self.steps, expert_out, handle, w, q, gq, grad_format)
        return functions.combine(self.steps, expert_out, handle, w, q, gq, grad_format)

    def check_errors(self) -> None:
        """Host sync: raise any error a GPU backend recorded on the device and not reported yet (a peer that never
        arrived: :class:`~mxcomm.transport.PeerTimeout`, which stays set: the group is unusable after it; expert ids
        out of range or repeated in the no-host-sync mode: ValueError, reported once). Calls replayed from a CUDA
        graph check nothing themselves: call this after replays (e.g. once per training step). The reference
        backend checks every call synchronously, so there it has nothing to do."""
        self.backend.check_errors()


__all__ = ["EPGroup"]
