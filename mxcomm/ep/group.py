"""EPGroup: the user-facing expert-parallel dispatch/combine object.

It checks the config (identical on every rank), validates every call's inputs before anything
is written or sent, and delegates to a backend:

* ``"torch"``: :class:`mxcomm.ep.reference.TorchBackend` (torch.distributed all-to-all).
* ``"nvshmem"``: ``mxcomm.ep.nvshmem_backend.NvshmemBackend`` (loaded lazily).

A backend is an object built as ``Backend(config, group, rank, world_size)`` with
``dispatch(x, topk_idx, topk_weights) -> (DispatchResult, EPHandle)``,
``combine(expert_out, handle, quantize: bool) -> Tensor`` and a bool attribute
``device_side_checks`` (True: the backend checks expert-id values on the device itself, so the
group skips its host-synchronising value checks).

Backward interface (needed for training; math and the oracle in :mod:`mxcomm.ep.backward_ref`;
the group validates every argument before calling, all three are collective):

``combine_for_backward(expert_out, handle, quantize: bool) -> (Tensor, CombineSaved)``
    The forward combine (same output as ``combine``) that also returns
    ``CombineSaved(rows=...)``: the returned rows as they ARRIVED at the origin, indexed by
    ``handle.plan.send_pos`` - an ``MXTensor`` ``[n, H]`` with ROW scales (MXFP8 transport) or
    bfloat16 ``[n, H]`` (BF16), ``n >= num_send`` (``n = T*k`` is fine when the count is only on the
    device). They must not alias a buffer the next combine overwrites.
``combine_backward(grad_y, handle, saved: CombineSaved | None, quantize: bool) -> CombineGrads``
    ``grad_y`` bfloat16 ``[T, H]``. For each valid slot ``(t, j)``: ``g = w[t,j] * grad_y[t]``
    (fp32, ``w = handle.topk_weights``), quantized to MXFP8 row-wise in the config's scale mode
    (``quantize``; else cast to BF16), delivered into the dispatch layout: ``grad_expert_out`` has
    the dispatch output's shape ``[handle.num_rows, H]`` and rows, padding rows zero, MX scales
    GROUPED_M on ``handle.plan.offs`` (``MXTensor``, ``orig_dtype`` bfloat16) - i.e. a dispatch of
    per-slot weighted rows. With ``saved``: ``grad_weights[t, j] = <grad_y[t], saved.rows[send_pos[t, j]]>``
    in fp32, float32 ``[T, k]``, 0 for dropped slots; ``saved=None``: ``grad_weights=None``.
``dispatch_backward(grad_recv, handle, quantize: bool) -> Tensor``
    ``grad_recv``: bfloat16 ``[R, H]`` in the dispatch layout, or an ``MXTensor`` ``[R, H]``
    (axis 1, any scale layout; transported as it is, never requantized). Each real row goes back
    to its origin slot (MXFP8 row-wise when ``quantize`` and the row is dense, else BF16) and the
    origin sums over ``j`` in fp32, ``j`` ascending (combine with all weights 1); padding rows are
    never read. Returns bfloat16 ``[T, H]``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..mx import MXTensor
from ..mx.subclass import unwrap_mx
from .backward_ref import CombineGrads, CombineSaved
from .config import EPConfig
from .handle import DispatchResult, EPHandle
from .ids import check_expert_ids
from .plan import buffer_sizes
from .registry import GROUPS


def collective_device(group, data_device: Optional[torch.device] = None) -> torch.device:
    """Device on which small tensors for a collective on ``group`` must live.

    NCCL-only groups need the current CUDA device; anything else (gloo, mixed) uses the CPU unless
    ``data_device`` is a CUDA device and the group has a CUDA-capable backend.
    """
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        if data_device is not None and data_device.type == "cuda":
            return data_device
        if "gloo" not in backend and "cpu" not in backend:
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_config_agreement(config: EPConfig, group=None) -> None:
    """All-gather ``config``'s fingerprint; raise ValueError naming differing fields and ranks.

    Collective: every rank of ``group`` must call it (every rank raises on a mismatch).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    dev = collective_device(group)
    mine = torch.tensor(config.fingerprint_codes(), dtype=torch.int64, device=dev)
    bufs = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(bufs, mine, group=group)
    allc = torch.stack(bufs).cpu()
    if bool((allc == allc[0:1]).all()):
        return
    # Mismatch (seen identically by every rank): gather readable values for the message.
    objs = [None] * world
    dist.all_gather_object(objs, config.fingerprint(), group=group)
    names = [n for n, _ in config.fingerprint()]
    parts = []
    for i, name in enumerate(names):
        col = allc[:, i]
        if bool((col == col[0]).all()):
            continue
        vals = ", ".join(f"rank {r}: {dict(objs[r])[name]!r}" for r in range(world))
        parts.append(f"{name!r} ({vals})")
    raise ValueError("EPConfig differs across ranks in " + "; ".join(parts))


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}; all inputs must be on one device")


def validate_dispatch_inputs(
    config: EPConfig, x, topk_idx, topk_weights, *, check_values: bool = True
) -> None:
    """Raise TypeError/ValueError for bad dispatch inputs (before anything is written or sent).

    Shapes/dtypes/devices are checked without a sync. ``check_values`` also checks expert ids
    (in ``[-1, E)``, no duplicate expert in one token's row), which needs a device-to-host sync.
    """
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2D [T, hidden], got shape {tuple(x.shape)}")
    T, H = x.shape
    if H != config.hidden:
        raise ValueError(f"x has hidden size {H}, config.hidden is {config.hidden}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be bfloat16 (dispatch quantizes BF16 activations), got {x.dtype}")
    if T > config.max_tokens_per_rank:
        raise ValueError(
            f"x has {T} tokens, more than config.max_tokens_per_rank={config.max_tokens_per_rank} "
            "(buffer capacity)"
        )
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    if tuple(topk_idx.shape) != (T, config.topk):
        raise ValueError(f"topk_idx must have shape [T, topk] = {(T, config.topk)}, got {tuple(topk_idx.shape)}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be a floating tensor, got {topk_weights.dtype}")
    if tuple(topk_weights.shape) != (T, config.topk):
        raise ValueError(
            f"topk_weights must have shape [T, topk] = {(T, config.topk)}, got {tuple(topk_weights.shape)}"
        )
    _check_device("topk_idx", topk_idx, x.device)
    _check_device("topk_weights", topk_weights, x.device)
    if check_values and topk_idx.numel():
        check_expert_ids(topk_idx, config.num_experts)


def validate_combine_inputs(config: EPConfig, expert_out, handle) -> None:
    """Raise TypeError/ValueError for bad combine inputs (before anything is sent)."""
    if not isinstance(handle, EPHandle):
        raise TypeError(f"handle must be the EPHandle returned by dispatch, got {type(handle).__name__}")
    if handle.config is not config and handle.config != config:
        raise ValueError("handle was made by an EPGroup with a different config")
    if not isinstance(expert_out, torch.Tensor):
        raise TypeError(f"expert_out must be a torch.Tensor, got {type(expert_out).__name__}")
    want = (handle.num_rows, config.hidden)
    if tuple(expert_out.shape) != want:
        raise ValueError(
            f"expert_out must have the dispatch output's shape [R, hidden] = {want}, got {tuple(expert_out.shape)}"
        )
    if expert_out.dtype != torch.bfloat16:
        raise TypeError(f"expert_out must be bfloat16, got {expert_out.dtype}")
    if expert_out.device != handle.device:
        raise ValueError(f"expert_out is on {expert_out.device} but dispatch ran on {handle.device}")


def validate_backward_handle(config: EPConfig, handle) -> None:
    """TypeError/ValueError unless ``handle`` is an :class:`EPHandle` of a group with ``config``."""
    if not isinstance(handle, EPHandle):
        raise TypeError(f"handle must be the EPHandle returned by dispatch, got {type(handle).__name__}")
    if handle.config is not config and handle.config != config:
        raise ValueError("handle was made by an EPGroup with a different config")


def _check_grad(config: EPConfig, name: str, g, shape: tuple, device: torch.device) -> None:
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (or an MXTensor where allowed), got {type(g).__name__}")
    if tuple(g.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(g.shape)}")
    if g.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bfloat16, got {g.dtype}")
    if g.device != device:
        raise ValueError(f"{name} is on {g.device} but dispatch ran on {device}")


def _make_backend(config: EPConfig, group, rank: int, world: int):
    if config.backend == "torch":
        from .reference import TorchBackend

        return TorchBackend(config, group, rank, world)
    if config.backend == "nvshmem":
        try:
            from .nvshmem_backend import NvshmemBackend  # type: ignore[import-not-found]
        except ImportError as e:
            raise ImportError(f"the 'nvshmem' EP backend is not available: {e}") from e
        return NvshmemBackend(config, group, rank, world)
    raise ValueError(f"unknown backend {config.backend!r}")  # validate() already rejects it


class EPGroup:
    """Expert-parallel dispatch/combine over a torch.distributed process group.

    Args:
        config: :class:`EPConfig`; must be identical on every rank (checked, collective).
        group: process group (None = WORLD). ``torch.distributed`` must be initialised.

    Attributes:
        config, group, rank, world_size, num_local_experts, local_experts (range of global ids),
        memory_bytes: symmetric-buffer bytes a GPU backend allocates for this config
        (:meth:`buffer_bytes`; the torch backend allocates about as much per call).
    """

    def __init__(self, config: EPConfig, group=None):
        if not isinstance(config, EPConfig):
            raise TypeError(f"config must be an EPConfig, got {type(config).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("EPGroup needs torch.distributed initialised (init_process_group) first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        config.validate(self.world_size)
        check_config_agreement(config, group)
        self.config = config
        self.num_local_experts = config.num_local_experts(self.world_size)
        self.local_experts = range(self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts)
        self._backend = _make_backend(config, group, self.rank, self.world_size)
        # the put path (forced, or chosen because a peer is on another node) adds its staging buffers
        self.memory_bytes = EPGroup.buffer_bytes(config, self.world_size,
                                                 put_path=getattr(self._backend, "put_mode", None))
        self.op_id: int = GROUPS.register(self)  # how torch.library ops (mxcomm.ep.ops) name this group

    @property
    def path(self) -> str:
        """How this group moves rows: ``"all_to_all"`` (torch backend), ``"peer_pull"`` (nvshmem, one node, the
        default: dispatch receivers read the packed rows through peer pointers, the other ops store into peers'
        buffers), ``"local"`` (nvshmem, one rank, ``transport="auto"``: the kernels write the outputs directly,
        nothing goes through a symmetric buffer but combine's saved rows), ``"peer_stores"`` (``transport="push"``:
        every op stores into peers' buffers) or ``"put_signal"`` (nvshmem put-with-signal path: forced, or peers on
        other nodes)."""
        if self.config.backend == "torch":
            return "all_to_all"
        path = getattr(self._backend, "path", None)
        return {"put": "put_signal", "pull": "peer_pull", "local": "local"}.get(path, "peer_stores")

    @staticmethod
    def buffer_bytes(config: EPConfig, world_size: int, put_path: bool | None = None) -> int:
        """Symmetric-buffer bytes per rank a GPU backend needs (:func:`mxcomm.ep.plan.buffer_sizes`). ``put_path``:
        size for the put-with-signal path (default: only when ``config.transport == "put"``); pass True to
        plan a multi-node job with ``transport="auto"``, which takes that path when peers are on other nodes."""
        return buffer_sizes(config, world_size, put_path).total

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        """Send each token's row to the ranks of its top-k experts.

        Args:
            x: bfloat16 ``[T, H]``, ``T <= max_tokens_per_rank`` (T may be 0).
            topk_idx: int32/int64 ``[T, k]`` global expert ids, -1 = dropped slot.
            topk_weights: float ``[T, k]`` route weights (kept in the handle for combine).
        Returns:
            ``(DispatchResult, EPHandle)``; see :class:`mxcomm.ep.handle.DispatchResult` for the
            expert-major layout of the received rows.
        Collective: every rank of the group must call it.
        """
        self._refuse_exact_capture()
        validate_dispatch_inputs(
            self.config, x, topk_idx, topk_weights,
            check_values=not getattr(self._backend, "device_side_checks", False),
        )
        return self._backend.dispatch(x, topk_idx, topk_weights)

    def combine(self, expert_out: torch.Tensor, handle: EPHandle, *, quantize: Optional[bool] = None) -> torch.Tensor:
        """Return expert rows to their origin and reduce: ``y[t] = sum_k w[t,k] * out[row(t,k)]``.

        Args:
            expert_out: bfloat16 ``[R, H]`` in the dispatch output's expert-major layout
                (padding rows are ignored).
            handle: the :class:`EPHandle` from the matching dispatch.
            quantize: transport the rows as MXFP8 (row-wise, the config's scale mode) and
                dequantize at the origin; default True when ``precision == "mxfp8"``.
        Returns:
            bfloat16 ``[T, H]``; reduced in fp32 with k ascending; dropped slots contribute 0.
        Collective: every rank of the group must call it.
        """
        self._refuse_exact_capture()
        validate_combine_inputs(self.config, expert_out, handle)
        if quantize is None:
            quantize = self.config.precision == "mxfp8"
        return self._backend.combine(expert_out, handle, bool(quantize))

    def _refuse_exact_capture(self) -> None:
        """RuntimeError (before any CUDA work) when a call of an exact-size group is captured into a CUDA
        graph: exact sizes and input checks read device values on the host, which capture forbids."""
        if self.config.exact_sizes and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "CUDA graph capture needs EPConfig(exact_sizes=False) (worst-case output sizes, errors checked on "
                "the device and raised by EPGroup.check_errors); this group has exact_sizes=True"
            )

    def check_errors(self) -> None:
        """Host sync: raise any error a GPU backend recorded on the device and not reported yet (a peer
        that never arrived: :class:`~mxcomm.transport.PeerTimeout`, which stays set: the group is unusable
        after it; expert ids out of range or repeated in the no-host-sync mode: ValueError, reported once). Calls replayed from a CUDA graph check nothing
        themselves: call this after replays (e.g. once per training step). The reference backend checks
        every call synchronously, so there it has nothing to do."""
        fn = getattr(self._backend, "check_errors", None)
        if fn is not None:
            fn()

    # -- backward (used by mxcomm.ep.autograd; callable directly) ------------------------------
    def _backward_op(self, name: str):
        fn = getattr(self._backend, name, None)
        if fn is None:
            raise NotImplementedError(f"the {self.config.backend!r} EP backend does not implement {name} yet")
        return fn

    def _quantize_default(self, quantize: Optional[bool]) -> bool:
        return self.config.precision == "mxfp8" if quantize is None else bool(quantize)

    def combine_for_backward(self, expert_out: torch.Tensor, handle: EPHandle, *, quantize: Optional[bool] = None):
        """:meth:`combine` that also returns what the route-weight gradient needs.

        Returns:
            ``(y, saved)``: ``y`` as :meth:`combine`; ``saved`` a :class:`CombineSaved` holding the
            returned rows as they arrived (``n_send * H * 33/32`` bytes with MXFP8 transport,
            ``n_send * H * 2`` with BF16; ``n_send <= T*k``), for :meth:`combine_backward`.
        Collective.
        """
        self._refuse_exact_capture()
        validate_combine_inputs(self.config, expert_out, handle)
        return self._backward_op("combine_for_backward")(expert_out, handle, self._quantize_default(quantize))

    def combine_backward(
        self, grad_y: torch.Tensor, handle: EPHandle, saved: Optional[CombineSaved] = None, *,
        quantize: Optional[bool] = None,
    ) -> CombineGrads:
        """Backward of :meth:`combine`: per-slot gradients to the experts, route-weight gradient at home.

        Args:
            grad_y: bfloat16 ``[T, H]``, gradient of the combine output.
            handle: the dispatch's :class:`EPHandle`; ``handle.topk_weights`` are the weights
                the forward combine used.
            saved: the :class:`CombineSaved` of the forward (:meth:`combine_for_backward`), or None
                to skip the route-weight gradient.
            quantize: MXFP8 transport of ``w * grad_y`` (default: ``precision == "mxfp8"``).
        Returns:
            :class:`CombineGrads`: ``grad_expert_out`` ``[R, H]`` in the dispatch output's layout
            (an :class:`MXTensor` with GROUPED_M scales, or bfloat16), ``grad_weights`` float32
            ``[T, k]`` (0 for dropped slots) or None.
        Collective.
        """
        self._refuse_exact_capture()
        validate_backward_handle(self.config, handle)
        _check_grad(self.config, "grad_y", grad_y, (handle.num_tokens, self.config.hidden), handle.device)
        if saved is not None:
            if not isinstance(saved, CombineSaved):
                raise TypeError(f"saved must be the CombineSaved of combine_for_backward, got {type(saved).__name__}")
            rows = saved.rows
            n = rows.shape[0] if isinstance(rows, (MXTensor, torch.Tensor)) else -1
            if n < 0 or rows.shape[1:] != (self.config.hidden,) or n > max(handle.num_tokens * self.config.topk, 0):
                raise ValueError(
                    f"saved.rows must be [n <= T*k, hidden] = [<= {handle.num_tokens * self.config.topk}, "
                    f"{self.config.hidden}], got {tuple(getattr(rows, 'shape', ()))}"
                )
        return self._backward_op("combine_backward")(grad_y, handle, saved, self._quantize_default(quantize))

    def dispatch_backward(self, grad_recv, handle: EPHandle, *, quantize: Optional[bool] = None) -> torch.Tensor:
        """Backward of :meth:`dispatch`: return each row's gradient to its origin and sum over k.

        Args:
            grad_recv: ``[R, H]`` in the dispatch output's layout: bfloat16, or an :class:`MXTensor`
                / :class:`mxcomm.mx.subclass.MXFP8Tensor` (axis 1, any scale layout) that travels as
                it is. Padding rows are ignored.
            handle: the dispatch's :class:`EPHandle`.
            quantize: MXFP8 transport of a dense ``grad_recv`` (default: ``precision == "mxfp8"``).
        Returns:
            bfloat16 ``[T, H]``: ``grad_x[t] = sum_j grad_recv[row(t, j)]`` in fp32, j ascending.
        Collective.
        """
        self._refuse_exact_capture()
        validate_backward_handle(self.config, handle)
        grad_recv = unwrap_mx(grad_recv)  # an MXFP8Tensor travels as its MXTensor
        shape = (handle.num_rows, self.config.hidden)
        if isinstance(grad_recv, MXTensor):
            if tuple(grad_recv.shape) != shape or grad_recv.axis != 1:
                raise ValueError(
                    f"an MXTensor grad_recv must be row-wise (axis 1) with shape {shape}, got axis "
                    f"{grad_recv.axis} shape {tuple(grad_recv.shape)}"
                )
            if grad_recv.device != handle.device:
                raise ValueError(f"grad_recv is on {grad_recv.device} but dispatch ran on {handle.device}")
        else:
            _check_grad(self.config, "grad_recv", grad_recv, shape, handle.device)
        return self._backward_op("dispatch_backward")(grad_recv, handle, self._quantize_default(quantize))


__all__ = [
    "EPGroup", "DispatchResult", "EPHandle", "check_config_agreement", "validate_dispatch_inputs",
    "validate_combine_inputs", "check_expert_ids", "collective_device", "validate_backward_handle",
]
