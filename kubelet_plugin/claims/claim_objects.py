"""The last copy of each ResourceClaim the plugin read or wrote, by UID.

The status writer replaces ``status`` on top of this copy, guarded by its resourceVersion,
so writing a claim's status needs no GET of its own: prepare has just read the claim, and
each write returns the object the next write builds on. A stale copy costs one conflict
(409) and a fresh read, never a wrong write.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

# Prepared claims on one node stay far below this; the oldest copy goes first.
DEFAULT_CAPACITY = 1024


class ClaimObjects:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._capacity = capacity
        self._objects: OrderedDict[str, Mapping[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, obj: Mapping[str, Any]) -> None:
        uid = str((obj.get("metadata") or {}).get("uid", ""))
        if not uid:
            return
        with self._lock:
            self._objects[uid] = obj
            self._objects.move_to_end(uid)
            while len(self._objects) > self._capacity:
                self._objects.popitem(last=False)

    def get(self, uid: str) -> Mapping[str, Any] | None:
        with self._lock:
            return self._objects.get(uid)

    def forget(self, uid: str) -> None:
        with self._lock:
            self._objects.pop(uid, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)
