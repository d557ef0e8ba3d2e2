"""Registry of live :class:`~mxcomm.ep.group.EPGroup` objects by small int id: torch.library ops cannot take a
Python object, so the ops of :mod:`mxcomm.ep.compiled` carry ``group.op_id`` and look the group up here at run
time (the one piece of process-wide state of the EP layer; weak references, ids never reused)."""
from __future__ import annotations

import itertools
import threading
import weakref


class GroupRegistry:
    """int id <-> group (weak references: a collected group's id is never reused). Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next = itertools.count(1)
        self._by_id: dict[int, weakref.ref] = {}
        self._ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def register(self, group) -> int:
        """The id of ``group`` (registered on first call)."""
        with self._lock:
            gid = self._ids.get(group)
            if gid is None:
                gid = next(self._next)
                self._ids[group] = gid
                self._by_id[gid] = weakref.ref(group)
            return gid

    def get(self, gid: int):
        """The group with id ``gid``; ValueError if unknown or collected."""
        ref = self._by_id.get(int(gid))
        group = ref() if ref is not None else None
        if group is None:
            raise ValueError(f"no live EPGroup with op id {gid}")
        return group


GROUPS = GroupRegistry()

__all__ = ["GroupRegistry", "GROUPS"]
