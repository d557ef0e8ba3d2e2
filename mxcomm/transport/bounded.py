"""Bounded, named collectives over a ``torch.distributed`` process group.

A plain collective waits for the process group's timeout (torch's default: 30 minutes) and then
raises an error that names no rank. :class:`BoundedGroup` runs each collective with
``async_op=True`` and ``work.wait(timeout=timeout_s)``; when the wait times out or the collective
fails (a peer that died: gloo's "Connection closed by peer"), the waiting rank runs a *census*
through the group's store and raises :class:`~mxcomm.transport.errors.PeerTimeout` naming the
ranks that did not arrive, the ranks that called another operation, or the ranks that gave up
before this rank arrived. The census happens on the failure path only: a successful call costs
what the plain collective costs (no store round trip).

Typical use (every rank, in the same order)::

    bg = BoundedGroup(group, timeout_s=60.0)           # collective: every rank of ``group`` makes it
    bg.agree(cfg_ok, cfg_error, CallTag("EPConfig", 0), what="EPConfig")
    counts = bg.all_gather(local_counts, CallTag("dispatch", 5, "T=128"))
    bg.all_to_all_single(out, inp, recv_splits, send_splits, CallTag("dispatch", 5, "T=128"))

Census protocol: a rank whose collective failed writes one key
``mxcomm.bounded/<instance>/census/<rank>`` in the group's store (what it called: collective kind,
sequence number on this :class:`BoundedGroup`, :class:`CallTag`, wall-clock entry and failure
times) and polls the other ranks' keys for at most ``census_s`` seconds. A rank whose key is absent
did not arrive (sleeping, dead, or stuck elsewhere, or still waiting: ``census_s`` must cover the
skew between the ranks' entries); a key with another call means that rank called something else;
a key of the same call whose failure time precedes this rank's entry means that rank gave up
before this rank arrived. ``<instance>`` counts the :class:`BoundedGroup` objects made over the
group (equal on every rank when they are made in the same order), so keys of earlier instances
and of other groups never mix; a failed instance refuses further calls, so its keys are written at
most once.

After a failure the process group is unusable: the abandoned collective may still be pending in
the backend and can complete later (gloo keeps it, and writes into the abandoned output buffers
when the peer arrives). Every later call on the same :class:`BoundedGroup` raises
:class:`~mxcomm.transport.errors.TransportError` at once. A rank that arrives after its peers gave
up may see its collective complete (gloo delivers the data the peers had sent before giving up);
its next call on the group then times out and its census names the ranks that gave up. Shutting
down stays clean: ``torch.distributed.destroy_process_group()`` returns at once on gloo even with
a collective pending (``ProcessGroup.abort()`` / ``shutdown()`` are no-ops on gloo in torch 2.13).

Limits: tags are compared on the failure path only: ranks calling different operations whose
collectives happen to match in shape complete without error. On NCCL, ``work.wait(timeout)``
blocks the calling CPU thread until the GPU work completes (torch's ProcessGroupNCCL contract),
unlike a plain ``wait()``, which only orders streams: a bounded call is a host synchronisation.

Pure Python + torch: importable on a CPU machine.
"""
from __future__ import annotations

import datetime
import json
import pickle
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import PeerTimeout, TransportError

__all__ = ["CallTag", "BoundedGroup"]

_KEY_ROOT = "mxcomm.bounded"
_POLL_S = 0.02


@dataclass(frozen=True)
class CallTag:
    """What an exchange is: ``op`` (e.g. ``"dispatch"``), ``call`` (the caller's per-group call
    counter), ``detail`` (free text, e.g. ``"T=128"``). ``str(tag)`` -> ``"dispatch #5 (T=128)"``."""

    op: str
    call: int
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.op} #{self.call}" + (f" ({self.detail})" if self.detail else "")


@dataclass(frozen=True)
class _Record:
    """One rank's census entry: what it called and when (wall clock, seconds since the epoch)."""

    rank: int
    seq: int
    kind: str
    tag: CallTag
    t_enter: float
    t_fail: float
    local: bool  # the collective raised before communicating (bad arguments on that rank)
    error: str

    def to_json(self) -> str:
        d = dict(self.__dict__, tag=[self.tag.op, self.tag.call, self.tag.detail])
        return json.dumps(d)

    @staticmethod
    def from_json(text: str) -> "_Record":
        d = json.loads(text)
        op, call, detail = d.pop("tag")
        return _Record(tag=CallTag(str(op), int(call), str(detail)), **d)

    def call_text(self) -> str:
        return f"{self.tag} ({self.kind}, collective {self.seq})"

    def same_call(self, other: "_Record") -> bool:
        return (self.seq, self.kind, self.tag) == (other.seq, other.kind, other.tag)


class BoundedGroup:
    """A process group whose collectives wait at most ``timeout_s`` and name the peers on failure.

    Construction is collective in the sense of ``dist.new_group``: every rank of ``group`` makes its
    :class:`BoundedGroup` objects over that group in the same order (it costs one store ``add``, no
    collective). Every method is a collective: all ranks call the same methods in the same order.

    Args:
        group: the process group (``None``: the default group).
        timeout_s: the most a collective waits before the census starts.
        census_s: the most the census waits for the other ranks' keys (should exceed the skew
            between the ranks' entries into a collective; 1-2 s on one host).
        device: device of the small tensors made by :meth:`all_gather_object` / :meth:`agree`
            (default: the current CUDA device for NCCL groups, else the CPU).

    Raises:
        ValueError: ``timeout_s`` or ``census_s`` not positive.
        RuntimeError: ``torch.distributed`` is not initialised.
    """

    def __init__(self, group=None, *, timeout_s: float = 60.0, census_s: float = 1.5, device=None):
        if not timeout_s > 0 or not census_s > 0:
            raise ValueError(f"timeout_s and census_s must be > 0, got {timeout_s} and {census_s}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("BoundedGroup needs an initialised torch.distributed process group")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.timeout_s = float(timeout_s)
        self.census_s = float(census_s)
        self._timeout = datetime.timedelta(seconds=self.timeout_s)
        if device is None:
            nccl = "nccl" in str(dist.get_backend(self.group)).lower()
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)
        self._global_ranks = dist.get_process_group_ranks(self.group)
        self._store = self.group.get_group_store()  # already prefixed per group by torch
        self.instance = int(self._store.add(f"{_KEY_ROOT}/made/{self.rank}", 1))
        self._seq = 0
        self._failure: str | None = None

    def __repr__(self) -> str:
        return (f"BoundedGroup(rank={self.rank}, world_size={self.world_size}, timeout_s={self.timeout_s}, "
                f"instance={self.instance}, calls={self._seq}{', failed' if self._failure else ''})")

    # ------------------------------------------------------------------ collectives

    def all_gather(self, tensor: torch.Tensor, tag: CallTag) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on all ranks), in group-rank order.

        Returns ``world_size`` new tensors shaped and typed like ``tensor`` on its device.
        Raises PeerTimeout / TransportError (see the module docstring)."""
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._run("all_gather", tag, lambda: dist.all_gather(out, tensor, group=self.group, async_op=True))
        return out

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None, tag: CallTag,
    ) -> torch.Tensor:
        """``dist.all_to_all_single`` along dim 0, bounded; fills and returns ``output``.

        ``input_split_sizes[p]`` rows of ``input`` go to rank ``p``; ``output_split_sizes[p]`` rows
        of ``output`` come from rank ``p`` (``None``: equal splits). Both tensors contiguous, same
        dtype and trailing shape. After a failure do not reuse ``output``: the abandoned collective
        may still write into it.

        Raises:
            ValueError: on this rank only, before communicating: splits that do not add up to the
                tensor's rows, or not ``world_size`` of them, or mismatched dtypes; the other ranks'
                census then reports that this rank refused its input.
        """
        def issue():
            if output.dtype != input.dtype or output.shape[1:] != input.shape[1:]:
                raise ValueError(f"output {output.dtype} {tuple(output.shape)} and input {input.dtype} "
                                 f"{tuple(input.shape)} must share the dtype and the trailing shape")
            recv = _checked_splits(output, output_split_sizes, self.world_size, "output")
            send = _checked_splits(input, input_split_sizes, self.world_size, "input")
            return dist.all_to_all_single(output, input, recv, send, group=self.group, async_op=True)

        self._run("all_to_all_single", tag, issue)
        return output

    def all_gather_object(self, obj, tag: CallTag) -> list:
        """Every rank's picklable ``obj``, in group-rank order (two bounded all_gathers: sizes, bytes)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        sizes = [int(s) for s in torch.cat(self.all_gather(size, tag)).tolist()]
        buf = torch.zeros(max(sizes), dtype=torch.uint8, device=self.device)
        buf[: data.numel()] = data.to(self.device)
        parts = self.all_gather(buf, tag)
        return [pickle.loads(p[:n].cpu().numpy().tobytes()) for p, n in zip(parts, sizes)]

    def agree(self, ok: bool, message: str, tag: CallTag, *, what: str | None = None) -> None:
        """Collective validity vote: each rank passes whether its local check passed and, if not, why.

        If any rank failed, every rank raises the same ``ValueError`` naming each failing rank and
        its message: ``"EPConfig is invalid on rank 1: hidden (48) must be a multiple of 32"``
        (``what`` defaults to ``str(tag)``). The group stays usable after that ``ValueError``.
        Raises PeerTimeout / TransportError when the vote itself cannot complete."""
        votes = self.all_gather_object((bool(ok), "" if ok else str(message)), tag)
        bad = [(r, msg) for r, (good, msg) in enumerate(votes) if not good]
        if bad:
            subject = what if what is not None else str(tag)
            raise ValueError(f"{subject} is invalid on " + "; ".join(f"rank {r}: {msg}" for r, msg in bad))

    def refuse(self, tag: CallTag, exc: BaseException) -> None:
        """This rank refuses its input to the call ``tag`` (it raises ``exc`` without entering the collective):
        leave a note so that the peers' census, should their collective time out waiting for this rank, says
        so ("rank 1 refused its input: ...") instead of "did not arrive". The group stays usable (when every rank
        refused the same call, no collective is pending); a failure path only: one store write."""
        rec = _Record(self.rank, self._seq, "refused", tag, time.time(), time.time(), True, _short(exc))
        try:
            self._store.set(f"{_KEY_ROOT}/{self.instance}/refused/{self.rank}/{self._seq}", rec.to_json())
        except Exception:  # noqa: BLE001 - the note is best effort: the peers still time out and name this rank
            pass

    # ------------------------------------------------------------------ machinery

    def _run(self, kind: str, tag: CallTag, issue) -> None:
        """Issue one async collective and wait for it, at most ``timeout_s``; census on failure."""
        if self._failure is not None:
            raise TransportError(f"rank {self.rank}: this BoundedGroup is unusable after {self._failure}; "
                                 "make a new process group")
        seq = self._seq
        self._seq += 1
        t_enter = time.time()
        try:
            work = issue()  # argument checks run here, before anything is sent
        except Exception as exc:  # refused before communicating: record it so the peers' census says so
            self._failure = f"{kind} for {tag} failed locally"
            self._publish(_Record(self.rank, seq, kind, tag, t_enter, time.time(), True, _short(exc)))
            raise
        try:
            done = work.wait(timeout=self._timeout)
        except Exception as exc:  # timed out, or the backend lost a peer
            self._census(_Record(self.rank, seq, kind, tag, t_enter, time.time(), False, _short(exc)))
        if done is False:  # a backend that reports the timeout instead of raising
            self._census(_Record(self.rank, seq, kind, tag, t_enter, time.time(), False, "wait timed out"))

    def _key(self, rank: int) -> str:
        return f"{_KEY_ROOT}/{self.instance}/census/{rank}"

    def _publish(self, mine: _Record) -> str | None:
        """Write this rank's census key; returns why it could not (store unreachable) or None."""
        try:
            self._store.set(self._key(self.rank), mine.to_json())
            return None
        except Exception as exc:  # noqa: BLE001 - the store host may have exited
            return _short(exc)

    def _collect(self) -> tuple[dict[int, _Record], str | None]:
        """Poll the other ranks' census keys for at most ``census_s``; (records, store problem or None)."""
        records: dict[int, _Record] = {}
        others = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + self.census_s
        try:
            while True:
                for r in others:
                    if r not in records and self._store.check([self._key(r)]):
                        records[r] = _Record.from_json(self._store.get(self._key(r)).decode())
                if len(records) == len(others) or time.monotonic() >= deadline:
                    return records, None
                time.sleep(_POLL_S)
        except Exception as exc:  # noqa: BLE001
            return records, _short(exc)

    def _name(self, rank: int) -> str:
        g = self._global_ranks[rank]
        return f"rank {rank}" if g == rank else f"rank {rank} (global {g})"

    def _census(self, mine: _Record) -> None:
        """Failure path: publish, collect, classify the peers, raise PeerTimeout (or TransportError)."""
        self._failure = f"a failed {mine.kind} for {mine.tag}"
        problem = self._publish(mine)
        records, problem2 = self._collect() if problem is None else ({}, problem)
        problem = problem or problem2
        others = [r for r in range(self.world_size) if r != self.rank]
        for r in others:  # a rank that refused its input to this call (see refuse) never entered it
            key = f"{_KEY_ROOT}/{self.instance}/refused/{r}/{mine.seq}"
            try:
                if r not in records and problem is None and self._store.check([key]):
                    rec = _Record.from_json(self._store.get(key).decode())
                    records[r] = _Record(r, mine.seq, mine.kind, mine.tag, rec.t_enter, rec.t_fail, True,
                                         f"{rec.tag}: {rec.error}")
            except Exception as exc:  # noqa: BLE001
                problem = problem or _short(exc)
        missing = [r for r in others if r not in records]
        mismatched = [r for r in others if r in records and not records[r].same_call(mine)]
        local = [r for r in others if r in records and records[r].same_call(mine) and records[r].local]
        left = [r for r in others if r in records and records[r].same_call(mine) and not records[r].local
                and records[r].t_fail < mine.t_enter]
        lines = []
        if missing:
            lines.append(", ".join(self._name(r) for r in missing)
                         + f" did not arrive within {self.timeout_s:g} s (+{self.census_s:g} s census): "
                         "sleeping, dead, or stuck elsewhere")
        if left:
            lines.append(", ".join(f"{self._name(r)} gave up on it {mine.t_enter - records[r].t_fail:.1f} s "
                                   f"before this rank arrived ({records[r].error})" for r in left))
        if local:
            lines.append("; ".join(f"{self._name(r)} refused its input: {records[r].error}" for r in local))
        if mismatched:
            calls = [f"{self._name(self.rank)} called {mine.call_text()}"]
            calls += [f"{self._name(r)} "
                      + ("gave up on " if records[r].t_fail < mine.t_enter else "called ")
                      + records[r].call_text() for r in mismatched]
            lines.append("ranks called different operations: " + ", ".join(calls))
        if problem is not None:
            lines.append(f"census incomplete, the store is unreachable ({problem}); the rank serving it "
                         "(global rank 0 for the default store) may have exited")
        head = (f"{self._name(self.rank)}: {mine.kind} for {mine.tag} (collective {mine.seq}) failed after "
                f"{mine.t_fail - mine.t_enter:.1f} s (timeout {self.timeout_s:g} s; backend said: {mine.error})")
        tail = "The process group is unusable now: destroy it (dist.destroy_process_group()) and start over."
        # Ranks that left before this one arrived are to blame only when nobody else is: a peer that
        # failed fast because a third rank died left early too, but is not the cause.
        peers = sorted(set(missing + local + mismatched)) or sorted(left)
        if not peers and problem is not None:
            peers = missing = others  # the census could not tell: any peer may be at fault
        if not peers:
            lines.append("every rank arrived at this call, yet it did not complete")
            raise TransportError(". ".join([head] + lines + [tail]))
        message = ". ".join([head] + lines + [tail])
        raise PeerTimeout(peers[-1], f"{mine.kind} for {mine.tag}", rank=self.rank, peers=tuple(peers),
                          missing=tuple(missing), message=message)


def _checked_splits(t: torch.Tensor, splits, world: int, name: str):
    """``splits`` after checking them against ``t`` (rows along dim 0); ``None`` passes (equal splits).

    Gloo checks splits only inside its asynchronous work, where a refusal looks like any other
    failure; checking here makes it a local ``ValueError`` that the peers' census can name."""
    if splits is None:
        if t.dim() == 0 or t.shape[0] % world:
            raise ValueError(f"{name} has {t.shape[0] if t.dim() else 0} rows, not a multiple of world size {world}")
        return None
    splits = [int(n) for n in splits]
    if len(splits) != world or min(splits) < 0 or sum(splits) != (t.shape[0] if t.dim() else 0):
        raise ValueError(f"{name}_split_sizes {splits} must be {world} non-negative sizes adding up to the "
                         f"{name}'s {t.shape[0] if t.dim() else 0} rows")
    return splits


def _short(exc: BaseException, limit: int = 300) -> str:
    """First line of an exception's text, at most ``limit`` characters."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"{type(exc).__name__}: {text[:limit]}"
