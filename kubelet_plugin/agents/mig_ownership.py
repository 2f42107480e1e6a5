"""Which MIG devices on this node flexgpu created for a GpuNodePolicy's layout: a small file
of MIG device UUIDs in the plugin's data directory, so that after a restart a policy change
still tells flexgpu's instances from those another tool made (docs/admin.md, "GPUs already
partitioned").

Written after each creation and removal, atomically. A crash between creating an instance
and recording it leaves it looking foreign: kept, never destroyed without the admin's
``existingMigDevices: Replace``, which is the safe side. An unreadable file is treated the
same way: every instance looks foreign until the policy says otherwise.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from pathlib import Path

from flexgpu.driver.atomic_file import atomic_write_text

log = logging.getLogger(__name__)

VERSION = 1


class MigOwnership:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._uuids = self._read()

    def _read(self) -> set[str]:
        try:
            data = json.loads(self._path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return set()
        except (OSError, ValueError) as err:
            log.warning("%s unreadable (%s): every MIG device counts as foreign", self._path, err)
            return set()
        uuids = data.get("migDevices") if isinstance(data, dict) else None
        if not isinstance(uuids, list) or data.get("version") != VERSION:
            log.warning("%s has an unknown shape: every MIG device counts as foreign", self._path)
            return set()
        return {u for u in uuids if isinstance(u, str)}

    def owned(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._uuids)

    def update(self, added: Iterable[str] = (), removed: Iterable[str] = ()) -> None:
        with self._lock:
            uuids = (self._uuids | set(added)) - set(removed)
            if uuids == self._uuids:
                return
            self._path.parent.mkdir(parents=True, exist_ok=True)
            body = json.dumps({"version": VERSION, "migDevices": sorted(uuids)}, indent=1)
            atomic_write_text(self._path, body + "\n")
            self._uuids = uuids
