"""Validation of every argument of the EP calls, written once (the group's steps and the autograd layer call these
before anything is written or sent). Each raises TypeError / ValueError with a message naming the argument.

They run on every call: each check costs the host well under a microsecond when the argument is right (shapes are
compared as they are - ``torch.Size`` is a tuple -, the messages are built only for a refusal)."""
from __future__ import annotations

from typing import Optional

import torch

from ..mx import MXTensor
from .config import EPConfig
from .handle import CombineSaved, EPHandle
from .ids import check_expert_ids

GRAD_FORMATS = ("dense", "mx")


def check_tensor(name: str, t) -> None:
    """TypeError unless ``t`` is a torch.Tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_device(name: str, t: torch.Tensor, device: torch.device, what: str = "dispatch ran on") -> None:
    """ValueError unless ``t`` is on ``device``."""
    if t.device != device:
        raise ValueError(f"{name} is on device {t.device} but {what} {device}")


def _same_shape(shape: torch.Size, want) -> bool:
    """``tuple(shape) == tuple(want)``, without building tuples when ``want`` already is one (the usual case)."""
    return shape == want or tuple(shape) == tuple(want)


def dispatch_inputs(config: EPConfig, x, topk_idx, topk_weights, *, check_values: bool = True) -> None:
    """Dispatch inputs: ``x`` bfloat16 ``[T, H]`` (``T <= max_tokens_per_rank``), ``topk_idx`` int32/int64
    ``[T, k]``, ``topk_weights`` float ``[T, k]``, all on one device. ``check_values`` also checks the expert ids
    (in ``[-1, E)``, no expert twice in one token), which costs a device-to-host sync (backends that check ids on
    the device pass False)."""
    check_tensor("x", x)
    check_tensor("topk_idx", topk_idx)
    check_tensor("topk_weights", topk_weights)
    if x.dim() != 2:
        raise ValueError(f"x must be 2D [T, hidden], got shape {tuple(x.shape)}")
    T, H = x.shape
    if H != config.hidden:
        raise ValueError(f"x has hidden size {H}, config.hidden is {config.hidden}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be bfloat16 (dispatch quantizes BF16 activations), got {x.dtype}")
    if T > config.max_tokens_per_rank:
        raise ValueError(
            f"x has {T} tokens, more than config.max_tokens_per_rank={config.max_tokens_per_rank} (buffer capacity)"
        )
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    want = (T, config.topk)
    if topk_idx.shape != want:
        raise ValueError(f"topk_idx must have shape [T, topk] = {want}, got {tuple(topk_idx.shape)}")
    topk_weights_value(config, topk_weights, want)
    dev = x.device
    check_device("topk_idx", topk_idx, dev, "x is on")
    check_device("topk_weights", topk_weights, dev, "x is on")
    if check_values and topk_idx.numel():
        check_expert_ids(topk_idx, config.num_experts)


def topk_weights_value(config: EPConfig, w, shape: tuple) -> None:
    """Route weights: a floating ``[T, k]`` tensor."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise TypeError(f"topk_weights must be a floating torch.Tensor, got {getattr(w, 'dtype', type(w).__name__)}")
    if not _same_shape(w.shape, shape):
        raise ValueError(f"topk_weights must have shape [T, topk] = {tuple(shape)}, got {tuple(w.shape)}")


def handle_of(config: EPConfig, group_id: int, handle) -> None:
    """``handle`` must be the :class:`EPHandle` of a dispatch of this group (same config, same group)."""
    if not isinstance(handle, EPHandle):
        raise TypeError(f"handle must be the EPHandle returned by dispatch, got {type(handle).__name__}")
    if handle.config is not config and handle.config != config:
        raise ValueError("handle was made by an EPGroup with a different config")
    if handle.group_id != group_id:
        raise ValueError(
            f"handle belongs to another EPGroup (group id {handle.group_id}, this group is {group_id}): pass each "
            "handle to the group whose dispatch made it"
        )


def combine_weights(handle: EPHandle, w) -> None:
    """The weights a combine uses: ``[T, k]`` floating on the dispatch's device; the handle's own weights must not
    have been modified in place since the dispatch."""
    topk_weights_value(handle.config, w, handle.topk_idx.shape)
    check_device("topk_weights", w, handle.device)
    if w is handle.topk_weights and handle.weights_version >= 0 and w._version != handle.weights_version:
        raise RuntimeError(
            "topk_weights was modified in place between dispatch and combine (its version changed from "
            f"{handle.weights_version} to {w._version}); the handle keeps the tensor given to dispatch, so pass a "
            "fresh tensor or do not modify it until combine and its backward ran"
        )


def combine_inputs(config: EPConfig, group_id: int, expert_out, handle) -> None:
    """Combine inputs: ``handle`` of this group, ``expert_out`` bfloat16 ``[R, H]`` on the dispatch's device."""
    handle_of(config, group_id, handle)
    expert_out_value(config, expert_out, handle)


def expert_out_value(config: EPConfig, expert_out, handle: EPHandle) -> None:
    """``expert_out`` of a combine with the valid ``handle``: bfloat16 ``[R, H]`` on the dispatch's device."""
    check_tensor("expert_out", expert_out)
    want = (handle.num_rows, config.hidden)
    if expert_out.shape != want:
        raise ValueError(
            f"expert_out must have the dispatch output's shape [R, hidden] = {want}, got {tuple(expert_out.shape)}"
        )
    if expert_out.dtype != torch.bfloat16:
        raise TypeError(f"expert_out must be bfloat16, got {expert_out.dtype}")
    check_device("expert_out", expert_out, handle.device)


def dense_grad(name: str, g, shape: tuple, device: torch.device) -> None:
    """A dense gradient: bfloat16 tensor of ``shape`` on ``device``."""
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (or an MXTensor where allowed), got {type(g).__name__}")
    if not _same_shape(g.shape, shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(g.shape)}")
    if g.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bfloat16, got {g.dtype}")
    check_device(name, g, device)


def combine_saved(config: EPConfig, handle: EPHandle, saved: Optional[CombineSaved]) -> None:
    """``saved`` of :meth:`combine_for_backward`: the expert output, bfloat16 ``[R, H]`` on the dispatch's device
    (or None)."""
    if saved is None:
        return
    if not isinstance(saved, CombineSaved):
        raise TypeError(f"saved must be the CombineSaved of combine_for_backward, got {type(saved).__name__}")
    rows = saved.rows
    want = (handle.num_rows, config.hidden)
    if not isinstance(rows, torch.Tensor) or isinstance(rows, MXTensor) or rows.shape != want:
        raise ValueError(
            f"saved.rows must be the expert output, bfloat16 [R, hidden] = {list(want)}, got "
            f"{tuple(getattr(rows, 'shape', ()))}"
        )


def grad_recv(config: EPConfig, handle: EPHandle, g) -> None:
    """Gradient of a dispatch output: bfloat16 ``[R, H]`` or a row-wise :class:`MXTensor` ``[R, H]``."""
    shape = (handle.num_rows, config.hidden)
    if isinstance(g, MXTensor):
        if tuple(g.shape) != shape or g.axis != 1:
            raise ValueError(
                f"an MXTensor grad_recv must be row-wise (axis 1) with shape {shape}, got axis {g.axis} shape "
                f"{tuple(g.shape)}"
            )
        check_device("grad_recv", g, handle.device)
    else:
        dense_grad("grad_recv", g, shape, handle.device)


def grad_format(value: str) -> None:
    if value not in GRAD_FORMATS:
        raise ValueError(f"grad_format must be one of {GRAD_FORMATS}, got {value!r}")


__all__ = [
    "GRAD_FORMATS", "dispatch_inputs", "combine_inputs", "expert_out_value", "combine_weights", "handle_of",
    "combine_saved", "grad_recv", "dense_grad", "topk_weights_value", "grad_format", "check_tensor", "check_device",
]
