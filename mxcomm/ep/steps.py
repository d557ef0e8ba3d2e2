"""The EP collectives without autograd: :class:`EPSteps`, reached as ``EPGroup.steps``.

The autograd-aware pair :meth:`EPGroup.dispatch` / :meth:`EPGroup.combine` is built of these steps; benchmarks, and
frameworks that write their own autograd (one Function per step, as torchao's MoE training does), call them
directly. Each step validates its arguments (:mod:`mxcomm.ep.validate`) before anything is written or sent, then
calls the backend. Every step is collective: every rank of the group calls the same steps in the same order.

The steps run on every call of a layer, so their own host work is kept small: no context manager or dataclass copy
on the way (a refusal goes through ``try``/``except``, a handle with other weights is a shallow copy,
:func:`mxcomm.ep.handle.with_weights`), and whether CUDA exists is asked once per group.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..mx import MXTensor
from ..mx.subclass import MXFP8Tensor, unwrap_mx
from . import validate
from .backend import Backend
from .config import EPConfig
from .handle import CombineGrads, CombineSaved, Dispatched, EPHandle, with_weights

#: What a refused argument raises; the steps tell the backend before it propagates (``Backend.refuse``).
REFUSALS = (TypeError, ValueError, RuntimeError)


class _Refusing:
    """The context manager of :meth:`EPSteps.refusing`."""

    __slots__ = ("backend", "op")

    def __init__(self, backend: Backend, op: str):
        self.backend, self.op = backend, op

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and issubclass(exc_type, REFUSALS):
            self.backend.refuse(self.op, exc)
        return False


class EPSteps:
    """Validated collectives of one group (see module doc). Built by :class:`~mxcomm.ep.group.EPGroup`."""

    def __init__(self, config: EPConfig, group_id: int, backend: Backend):
        self.config = config
        self.group_id = group_id
        self.backend = backend
        self._cuda: Optional[bool] = None  # torch.cuda.is_available(), asked at the first exact-size call

    def refusing(self, op: str) -> _Refusing:
        """Run the argument checks of ``op`` in this context: a refusal (TypeError / ValueError / RuntimeError) is told
        to the backend before it propagates, so that peers waiting for this rank learn why (``Backend.refuse``)."""
        return _Refusing(self.backend, op)

    def _quantize(self, quantize: Optional[bool]) -> bool:
        return self.config.precision == "mxfp8" if quantize is None else bool(quantize)

    def _refuse_exact_capture(self) -> None:
        """RuntimeError (before any CUDA work) when a call of an exact-size group is captured into a CUDA graph:
        exact sizes and input checks read device values on the host, which capture forbids."""
        if not self.config.exact_sizes:
            return
        if self._cuda is None:
            self._cuda = torch.cuda.is_available()
        if self._cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "CUDA graph capture needs EPConfig(exact_sizes=False) (worst-case output sizes, errors checked on "
                "the device and raised by EPGroup.check_errors); this group has exact_sizes=True"
            )

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        """Send each token's row to the ranks of its top-k experts (no autograd: ``x`` of the result is detached).

        Args:
            x: bfloat16 ``[T, H]``, ``T <= max_tokens_per_rank`` (T may be 0).
            topk_idx: int32/int64 ``[T, k]`` global expert ids, -1 = dropped slot.
            topk_weights: float ``[T, k]`` route weights (kept in the handle for combine; not modified in place
                until combine and its backward ran).
        Returns:
            :class:`Dispatched` (``x`` an :class:`MXFP8Tensor` or bfloat16 ``[R, H]``, expert-major).
        """
        self._refuse_exact_capture()
        try:
            validate.dispatch_inputs(self.config, x, topk_idx, topk_weights,
                                     check_values=not self.backend.device_side_checks)
        except REFUSALS as exc:
            self.backend.refuse("dispatch", exc)
            raise
        res, handle = self.backend.dispatch(x, topk_idx, topk_weights)
        out = MXFP8Tensor(res.x, dtype=torch.bfloat16) if isinstance(res.x, MXTensor) else res.x
        return Dispatched(x=out, offs=res.offs, counts=res.counts, num_rows=res.num_rows, handle=handle)

    def combine(self, expert_out: torch.Tensor, handle: EPHandle, *, topk_weights: Optional[torch.Tensor] = None,
                quantize: Optional[bool] = None) -> torch.Tensor:
        """Return expert rows to their origin and reduce: ``y[t] = sum_j w[t,j] * out[row(t,j)]``.

        Args:
            expert_out: bfloat16 ``[R, H]`` in the dispatch output's expert-major layout (padding rows ignored).
            handle: the :class:`EPHandle` of the matching dispatch.
            topk_weights: float ``[T, k]`` (default: the weights given to dispatch).
            quantize: MXFP8 transport (row-wise, the config's scale mode); default: ``precision == "mxfp8"``.
        Returns:
            bfloat16 ``[T, H]``: per (token, rank) the weighted rows summed in fp32 (``j`` ascending) and rounded
            once for transport, the partials summed in fp32 (docs/design.md); dropped slots contribute 0.
        """
        handle = self._weighted(expert_out, handle, topk_weights)
        return self.backend.combine(expert_out, handle, self._quantize(quantize))

    def combine_for_backward(self, expert_out: torch.Tensor, handle: EPHandle, *,
                             topk_weights: Optional[torch.Tensor] = None,
                             quantize: Optional[bool] = None) -> tuple[torch.Tensor, CombineSaved]:
        """:meth:`combine` that also returns what the route-weight gradient needs: ``(y, saved)``, ``saved`` a
        :class:`CombineSaved` holding ``expert_out`` itself (the route-weight gradient is formed where those rows
        are; nothing is copied)."""
        handle = self._weighted(expert_out, handle, topk_weights)
        return self.backend.combine_for_backward(expert_out, handle, self._quantize(quantize))

    def combine_checked(self, expert_out: torch.Tensor, handle: EPHandle, quantize: bool,
                        keep_rows: bool) -> Union[torch.Tensor, tuple[torch.Tensor, CombineSaved]]:
        """:meth:`combine` (``keep_rows``: :meth:`combine_for_backward`) of a ``handle`` and its weights
        (``handle.topk_weights``) already checked by the caller (:func:`mxcomm.ep.validate.handle_of` and
        :func:`~mxcomm.ep.validate.combine_weights`, as :meth:`EPGroup.combine <mxcomm.ep.group.EPGroup.combine>`
        does): checks the rest (capture, ``expert_out``) as :meth:`combine` does, in the same order, then combines
        (``quantize``: the resolved transport flag)."""
        self._refuse_exact_capture()
        try:
            validate.expert_out_value(self.config, expert_out, handle)
        except REFUSALS as exc:
            self.backend.refuse("combine", exc)
            raise
        if keep_rows:
            return self.backend.combine_for_backward(expert_out, handle, quantize)
        return self.backend.combine(expert_out, handle, quantize)

    def _weighted(self, expert_out, handle: EPHandle, topk_weights) -> EPHandle:
        self._refuse_exact_capture()
        try:
            validate.combine_inputs(self.config, self.group_id, expert_out, handle)
            w = handle.topk_weights if topk_weights is None else topk_weights
            validate.combine_weights(handle, w)
        except REFUSALS as exc:
            self.backend.refuse("combine", exc)
            raise
        return handle if w is handle.topk_weights else with_weights(handle, w)

    def combine_backward(self, grad_y: torch.Tensor, handle: EPHandle, saved: Optional[CombineSaved] = None, *,
                         quantize: Optional[bool] = None) -> CombineGrads:
        """Backward of :meth:`combine`: per-slot gradients to the experts, route-weight gradient at home.

        Args:
            grad_y: bfloat16 ``[T, H]``, gradient of the combine output.
            handle: the dispatch's :class:`EPHandle`; ``handle.topk_weights`` are the weights the forward used.
            saved: the :class:`CombineSaved` of :meth:`combine_for_backward`, or None to skip the route-weight
                gradient.
            quantize: MXFP8 transport of ``w * grad_y`` (default: ``precision == "mxfp8"``).
        Returns:
            :class:`CombineGrads`: ``grad_expert_out`` ``[R, H]`` in the dispatch output's layout (an
            :class:`MXTensor` with GROUPED_M scales, or bfloat16), ``grad_weights`` float32 ``[T, k]`` (0 for
            dropped slots) or None.
        """
        self._refuse_exact_capture()
        try:
            validate.handle_of(self.config, self.group_id, handle)
            validate.dense_grad("grad_y", grad_y, (handle.num_tokens, self.config.hidden), handle.device)
            validate.combine_saved(self.config, handle, saved)
        except REFUSALS as exc:
            self.backend.refuse("combine_backward", exc)
            raise
        return self.backend.combine_backward(grad_y, handle, saved, self._quantize(quantize))

    def dispatch_backward(self, grad_recv: Union[torch.Tensor, MXTensor], handle: EPHandle, *,
                          quantize: Optional[bool] = None) -> torch.Tensor:
        """Backward of :meth:`dispatch`: return each row's gradient to its origin and sum over k.

        Args:
            grad_recv: ``[R, H]`` in the dispatch output's layout: bfloat16, or an :class:`MXTensor` /
                :class:`MXFP8Tensor` (axis 1, any scale layout), decoded before the sum. Padding rows are ignored.
            handle: the dispatch's :class:`EPHandle`.
            quantize: MXFP8 transport of a dense ``grad_recv`` (default: ``precision == "mxfp8"``).
        Returns:
            bfloat16 ``[T, H]``: ``grad_x[t] = sum_j grad_recv[row(t, j)]``, summed per (token, rank) in fp32 (``j``
            ascending), each partial rounded once for transport, the partials summed in fp32.
        """
        self._refuse_exact_capture()
        grad_recv = unwrap_mx(grad_recv)  # an MXFP8Tensor travels as its MXTensor
        try:
            validate.handle_of(self.config, self.group_id, handle)
            validate.grad_recv(self.config, handle, grad_recv)
        except REFUSALS as exc:
            self.backend.refuse("dispatch_backward", exc)
            raise
        return self.backend.dispatch_backward(grad_recv, handle, self._quantize(quantize))


__all__ = ["EPSteps", "REFUSALS"]
