"""Running a call of an :class:`~mxcomm.ep.group.EPGroup` on a communication stream, so that it overlaps compute
on other streams: the ``stream=`` argument of :meth:`EPGroup.dispatch <mxcomm.ep.group.EPGroup.dispatch>` and
:meth:`~mxcomm.ep.group.EPGroup.combine`, and the values they return with it (:class:`EPEvent`, :class:`Combined`).

A call given ``stream=s`` (a ``torch.cuda.Stream`` on the inputs' device):

1. makes ``s`` wait for the caller's current stream ``c`` (so it sees the inputs ``c`` produced);
2. marks its inputs as used on ``s`` for the caching allocator (``Tensor.record_stream``): the caller may drop them
   right after the call;
3. runs every kernel on ``s`` (``with torch.cuda.stream(s)``; the autograd node records ``s``, so the autograd
   engine runs the backward collective on ``s`` too and orders the gradients between ``s`` and the streams of
   their producers and consumers itself);
4. records a CUDA event on ``s`` after its last kernel (:class:`EPEvent`) and marks its outputs as used on ``c``
   (the caller reads them there after ``event.wait()``; a third stream needs its own ``record_stream``).

The caller's stream does not wait for anything: ``event.wait()`` (or ``torch.cuda.current_stream().wait_event(
event.event)``) does. Why an event in the result and not hidden state in the group: the result says itself whether it
is ready, several calls can be in flight, and nothing in the group changes when a caller forgets to wait.

DeepEP's ``previous_event`` (the communication waits for one event instead of the whole current stream) has no
argument here: make the communication stream current yourself (``with torch.cuda.stream(s): s.wait_event(e);
group.dispatch(...)``) and the call runs on ``s`` as on any current stream; ``stream=`` adds the wait for the
caller's stream, the ``record_stream`` marks and the event.

The rules for calls in flight (shared symmetric buffers and epochs) are in docs/design.md, "Overlapping
communication with compute".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from ..mx import MXTensor
from ..mx.subclass import MXFP8Tensor


@dataclass(frozen=True)
class EPEvent:
    """Completion of a call issued with ``stream=``: a CUDA event recorded on that stream after the call's last
    kernel (the forward call only: a backward runs on the same stream and the autograd engine orders it).

    Attributes:
        event: the ``torch.cuda.Event``.
        stream: the ``torch.cuda.Stream`` the call ran on.
    """

    event: torch.cuda.Event
    stream: torch.cuda.Stream

    def wait(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Make ``stream`` (default: the current stream of the call's device) wait for the call; no host sync."""
        s = torch.cuda.current_stream(self.stream.device) if stream is None else stream
        s.wait_event(self.event)

    def query(self) -> bool:
        """True when the call's kernels have finished (no wait)."""
        return self.event.query()

    def synchronize(self) -> None:
        """Block the host until the call's kernels have finished."""
        self.event.synchronize()


@dataclass(frozen=True)
class Combined:
    """What :meth:`EPGroup.combine <mxcomm.ep.group.EPGroup.combine>` returns when given ``stream=``.

    Attributes:
        y: bfloat16 ``[T, H]``, the combine output (autograd-connected), written on ``event.stream``: read it only
            after :meth:`wait` (or ``event.wait()``) on the stream that reads it.
        event: :class:`EPEvent` of the call.
    """

    y: torch.Tensor
    event: EPEvent

    def wait(self, stream: Optional[torch.cuda.Stream] = None) -> torch.Tensor:
        """Make ``stream`` (default: the current stream) wait for the combine and return ``y``."""
        self.event.wait(stream)
        return self.y


def refuse_compiling() -> None:
    """RuntimeError while ``torch.compile`` traces a call with ``stream=`` (the compiled custom ops run on the current
    stream). Dynamo compiles no code for a frame whose trace raises: with ``fullgraph=True`` torch.compile then
    raises; otherwise that frame runs eagerly, and the call with it, on the stream as any eager call."""
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "stream= is not supported under torch.compile (the compiled custom ops run on the current stream): make "
            "the stream current around the compiled code (with torch.cuda.stream(s)) or call outside it"
        )


def check_stream(stream, ref) -> None:
    """Refuse a ``stream=`` argument before any work: TypeError when it is not a ``torch.cuda.Stream``, ValueError
    when the call's tensors (``ref``: the first input) are not CUDA tensors or are on another GPU than the stream. A
    ``ref`` that is not a tensor is left to the call's own argument checks."""
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    if not isinstance(ref, torch.Tensor):
        return
    if ref.device.type != "cuda":
        raise ValueError(
            f"stream= runs the call on a CUDA stream, but its tensors are on {ref.device} (streams are CUDA): pass "
            "stream=None"
        )
    if stream.device.index != ref.device.index:
        raise ValueError(f"stream is on {stream.device}, the call's tensors on {ref.device}")


def tensors_of(obj, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor held by ``obj``: a tensor, an :class:`MXFP8Tensor` (its payload, scales, group offsets), an
    :class:`MXTensor` or another dataclass (its fields, e.g. :class:`~mxcomm.ep.handle.EPHandle`, the routing plan),
    tuples and lists; nested at most a few levels."""
    if _depth > 6 or obj is None:
        return
    if isinstance(obj, MXFP8Tensor):
        yield from (t for t in (obj.qdata, obj.scales, obj.group_offs) if t is not None)
    elif isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, MXTensor) or (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        for name in _field_names(obj.__class__):
            yield from tensors_of(getattr(obj, name), _depth + 1)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from tensors_of(o, _depth + 1)


_FIELD_NAMES: dict = {}  # dataclass -> its field names (tensors_of)


def _field_names(cls) -> tuple:
    """The field names of the dataclass ``cls`` (``dataclasses.fields``, read once per class)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def record(obj, stream: torch.cuda.Stream) -> None:
    """``record_stream(stream)`` on every CUDA tensor of ``obj`` (:func:`tensors_of`), once each: the caching
    allocator then reuses their memory only after the work ``stream`` had queued when they are freed."""
    seen = set()
    for t in tensors_of(obj):
        if t.device.type == "cuda" and id(t) not in seen:
            seen.add(id(t))
            t.record_stream(stream)


def begin(stream: torch.cuda.Stream, inputs) -> torch.cuda.Stream:
    """Start a call on ``stream``: it waits for the caller's current stream, the ``inputs`` (:func:`tensors_of`) are
    marked as used on it. Returns the caller's stream."""
    caller = torch.cuda.current_stream(stream.device)
    stream.wait_stream(caller)
    record(inputs, stream)
    return caller


def finish(stream: torch.cuda.Stream, outputs, caller: torch.cuda.Stream) -> EPEvent:
    """End a call on ``stream`` (call it with ``stream`` current, after the call's last kernel): the event, and the
    ``outputs`` marked as used on the caller's stream."""
    ev = torch.cuda.Event()
    ev.record(stream)
    record(outputs, caller)
    return EPEvent(event=ev, stream=stream)


__all__ = ["EPEvent", "Combined", "refuse_compiling", "check_stream", "tensors_of", "record", "begin", "finish"]
