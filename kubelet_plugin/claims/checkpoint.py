"""Crash-safe record of the claims this node has prepared (or started to prepare).

Schema version 2 keeps one file per claim, ``claims/<uid>.json`` beside the version-1 path:
``{"checksum": "sha256:<hex>", "data": {"version": 2, "boot_id": ..., "claim": {...}}}``, the
checksum covering the canonical JSON of "data" (sorted keys, no whitespace). Every state change
of a claim replaces its file atomically (temp file, rename), so a SIGKILL leaves the old or the
new state, and claims never wait for each other's I/O.

Record writes are not synced (no fsync of the file, none of its directory). A killed process
loses nothing: the page cache outlives it, so the rename alone gives old-or-new. Only a kernel
crash or power loss can lose or tear a write that has returned, and that is a reboot, after
which no record is acted on as it stands: start-up resets and drops the records of an earlier
boot (MIG instances, MPS daemons and time-slice settings do not survive a reboot anyway), and
a file that is empty, torn or fails its checksum is set aside as corrupt and the claims are
rebuilt from the CDI specs that survive (none, where the CDI folder is a tmpfs such as
/var/run/cdi). So a sync would buy nothing a reboot does not already undo, and a prepare (two
record writes) costs no fsync here; the CDI spec keeps its own (preparer.py).

Version 1 was one file for the whole node (``checkpoint.json``, same envelope, "data" holding
the boot id and every claim). Start-up migrates it; files of a newer version are left alone.

Rollback guard: ``checkpoint.json`` itself is kept, as a marker sealed like any file with
``{"version": 2, "records": "claims"}``. A version-1 plugin (a ``helm rollback``) checks the
checksum, then refuses any version above 1 and exits at start, before it deletes anything; with
no file at all it would take the node for empty and delete every CDI spec, MIG instance and MPS
daemon that running pods use. Start-up writes the marker whenever the file is missing.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from pydantic import (
    ValidationError,
)

from flexgpu.driver.atomic_file import atomic_write_bytes
from flexgpu.kubelet_plugin.claims.checkpoint_envelope import (
    Unusable,
    open_envelope,
    seal,
)
from flexgpu.kubelet_plugin.claims.checkpoint_records import (
    SCHEMA_VERSION,
    Checkpoint,
    ClaimRecord,
)

log = logging.getLogger(__name__)

LEGACY_VERSION: Final = 1
CLAIMS_FOLDER: Final = "claims"
BOOT_ID_PATH: Final = Path("/proc/sys/kernel/random/boot_id")
_RECORD_FILE = re.compile(r"^(?P<uid>[0-9A-Za-z-]{1,128})\.json$")


# What the marker at the version-1 path says: the records are in this folder.
_MARKER_DATA: Final = {
    "version": SCHEMA_VERSION,
    "records": CLAIMS_FOLDER,
    "note": "claim records are the files in claims/; plugins of schema 1 must not start here",
}


def marker_bytes() -> bytes:
    return seal(dict(_MARKER_DATA))


def _is_marker(data: dict[str, Any]) -> bool:
    return data.get("version") == SCHEMA_VERSION and data.get("records") == CLAIMS_FOLDER


class CheckpointError(Exception):
    """The checkpoint could not be used."""


class CheckpointWriteError(CheckpointError):
    """A record could not be written (disk full, read-only). Names the path and the errno."""

    def __init__(self, path: Path, error: OSError) -> None:
        name = errno.errorcode.get(error.errno or 0, str(error.errno))
        super().__init__(
            f"cannot write claim record {path}: {error.strerror or error} ({name}); "
            f"free space in {path.parent.parent} or fix its permissions"
        )
        self.path = path
        self.errno = error.errno


@dataclass(frozen=True)
class CorruptFile:
    """A checkpoint file that failed to parse or whose checksum does not match."""

    path: Path
    reason: str


@dataclass(frozen=True)
class ForeignFile:
    """A checkpoint file of a newer schema version: read nothing from it, never touch it."""

    path: Path
    version: int


@dataclass
class ScanResult:
    """Everything on disk at start-up, sorted by what start-up must do with it."""

    current: dict[str, ClaimRecord] = field(default_factory=dict)
    # Records of this boot still in the version-1 file; written as version 2 by the caller.
    legacy: dict[str, ClaimRecord] = field(default_factory=dict)
    # missing, marker (records live in claims/), current, stale, corrupt or foreign
    legacy_status: str = "missing"
    # Records written before the last reboot, by the boot id they carry.
    stale: list[tuple[str, ClaimRecord]] = field(default_factory=list)
    corrupt: list[CorruptFile] = field(default_factory=list)
    foreign: list[ForeignFile] = field(default_factory=list)

    @property
    def needs_rebuild(self) -> bool:
        return bool(self.corrupt or self.foreign)


def read_boot_id(path: Path = BOOT_ID_PATH) -> str:
    boot_id = path.read_text(encoding="ascii").strip()
    if not boot_id:
        raise CheckpointError(f"boot id file {path} is empty")
    return boot_id


def record_file_uid(file_name: str) -> str | None:
    match = _RECORD_FILE.match(file_name)
    return match["uid"] if match else None


def _write_record(path: Path, data: bytes) -> None:
    # Unsynced on purpose: see the module docstring.
    atomic_write_bytes(path, data, mode=0o600, sync_data=False)


Writer = Callable[[Path, bytes], None]


class CheckpointStore:
    """The claim records under ``path.parent``: ``path`` is where version 1 kept its single
    file, version 2 files live in the ``claims`` folder beside it.

    Thread-safe. Callers hold the lock of a claim's resources while they change its record;
    records of different claims are written in parallel.
    """

    def __init__(
        self, path: Path, boot_id_path: Path = BOOT_ID_PATH, writer: Writer | None = None
    ) -> None:
        self.legacy_path = path
        self.claims_dir = path.parent / CLAIMS_FOLDER
        # The folder as a string: the serving path joins names onto it without pathlib.
        self._claims_dir = os.fspath(self.claims_dir)
        self.boot_id_path = boot_id_path
        # Injectable so tests can make the disk "full" without filling one.
        self._write: Writer = writer or _write_record
        self._boot_id: str | None = None
        self._guard = threading.Lock()
        # Parsed records keyed by file name and identity (inode, mtime, size): while a file
        # is unchanged, reading it again needs no parse and no validation.
        self._cache: dict[str, tuple[tuple[int, int, int], ClaimRecord | None]] = {}
        # Records that live in memory only: rebuilt while the disk was full, or for a claim
        # whose file belongs to a newer plugin (never overwritten).
        self._memory: dict[str, ClaimRecord] = {}
        self._foreign_uids: set[str] = set()
        self._legacy_seen: tuple[int, int, int] | None = None

    # -- identity ------------------------------------------------------------------------
    @property
    def boot_id(self) -> str:
        if self._boot_id is None:
            self._boot_id = read_boot_id(self.boot_id_path)
        return self._boot_id

    def empty(self) -> Checkpoint:
        return Checkpoint(boot_id=self.boot_id)

    def record_path(self, uid: str) -> Path:
        return self.claims_dir / _record_name(uid)

    # -- serving: one record at a time ---------------------------------------------------
    def get(self, uid: str) -> ClaimRecord | None:
        """The claim's record of this boot, or None."""
        with self._guard:
            if uid in self._memory:
                return self._memory[uid]
        name = _record_name(uid)
        return self._read_cached(f"{self._claims_dir}/{name}", name)

    def checkpoint(self) -> Checkpoint:
        """Every record of this boot. Files that are unusable are skipped here (start-up has
        dealt with them; one that appears later is reported by the next start)."""
        claims: dict[str, ClaimRecord] = {}
        for name in self._record_names():
            record = self._read_cached(f"{self._claims_dir}/{name}", name)
            if record is not None:
                claims[record.uid] = record
        with self._guard:
            claims.update(self._memory)
        return Checkpoint(boot_id=self.boot_id, claims=claims)

    def put(self, record: ClaimRecord) -> None:
        """Replace the claim's record. Raises CheckpointWriteError (the old state stays)."""
        path = self.record_path(record.uid)
        with self._guard:
            if record.uid in self._foreign_uids:
                self._memory[record.uid] = record
                return
        data = {
            "version": SCHEMA_VERSION,
            "boot_id": self.boot_id,
            "claim": record.model_dump(mode="json"),
        }
        try:
            self._write(path, seal(data))
            identity = _identity(path)
        except OSError as err:
            raise CheckpointWriteError(path, err) from err
        with self._guard:
            self._memory.pop(record.uid, None)
            self._cache[path.name] = (identity, record)

    def keep_in_memory(self, record: ClaimRecord) -> None:
        """Hold a record that could not be written; put() or delete() ends that."""
        with self._guard:
            self._memory[record.uid] = record

    def in_memory(self) -> list[str]:
        with self._guard:
            return sorted(self._memory)

    def delete(self, uid: str) -> None:
        """Forget the claim. An unlink needs no free space, so this works on a full disk."""
        name = _record_name(uid)
        with self._guard:
            self._memory.pop(uid, None)
            self._cache.pop(name, None)
            if uid in self._foreign_uids:
                return  # a newer plugin's file: left as it is
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{self._claims_dir}/{name}")

    # -- start-up: everything on disk ----------------------------------------------------
    def scan(self) -> ScanResult:
        """Read every file and sort its records. Moves nothing: corrupt files are set aside
        by set_aside() once what replaces them is safe."""
        result = ScanResult()
        self._scan_legacy(result)
        for path in self._record_files():
            try:
                data = open_envelope(path.read_bytes(), SCHEMA_VERSION)
                boot_id, record = _parse_record(data, expected_uid=record_file_uid(path.name))
            except FileNotFoundError:
                continue
            except Unusable as err:
                if err.version is not None:
                    result.foreign.append(ForeignFile(path, err.version))
                    with self._guard:
                        self._foreign_uids.add(record_file_uid(path.name) or "")
                else:
                    result.corrupt.append(CorruptFile(path, err.reason))
                continue
            if boot_id == self.boot_id:
                result.current[record.uid] = record
            else:
                result.stale.append((boot_id, record))
        return result

    def set_aside(self, corrupt: CorruptFile) -> Path | None:
        """Keep a copy of a corrupt file for inspection (a hard link: needs no space), while
        the file itself stays until remove_corrupt(); None if no copy could be made."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = corrupt.path.with_name(f"{corrupt.path.name}.corrupt-{stamp}")
        suffix = 1
        while target.exists():
            target = corrupt.path.with_name(f"{corrupt.path.name}.corrupt-{stamp}.{suffix}")
            suffix += 1
        try:
            os.link(corrupt.path, target)
        except OSError as exc:
            log.error("cannot keep a copy of corrupt checkpoint file %s: %s", corrupt.path, exc)
            return None
        return target

    def remove_corrupt(self, corrupt: CorruptFile, copy: Path | None) -> None:
        """Remove the corrupt file unless a rebuilt record has replaced it meanwhile."""
        try:
            if copy is None or os.path.samefile(corrupt.path, copy):
                corrupt.path.unlink()
        except FileNotFoundError:
            pass

    def retire_legacy(self) -> None:
        """After its records were written as version 2: keep a copy of the version-1 file for
        inspection, under a name no plugin reads, and put the marker in its place. A crash
        before the marker is written leaves the version-1 file, which is migrated again."""
        copy = self.legacy_path.with_name(f"{self.legacy_path.name}.migrated-v{LEGACY_VERSION}")
        link = copy.with_name(f".{copy.name}.tmp")
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        try:
            os.link(self.legacy_path, link)  # a hard link: needs no space
            os.replace(link, copy)
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning("cannot keep a copy of %s: %s", self.legacy_path, err)
        self.write_marker()

    def write_marker(self) -> bool:
        """Replace the file at the version-1 path with the marker; False (logged) when it
        cannot be written, e.g. on a full disk."""
        try:
            self._write(self.legacy_path, marker_bytes())
            self._legacy_seen = _identity(self.legacy_path)
        except OSError as err:
            log.error(
                "cannot write the rollback marker %s: %s; a plugin of schema version 1 started "
                "on this node would not stop",
                self.legacy_path,
                err,
            )
            return False
        return True

    def ensure_marker(self) -> None:
        """Write the marker where no file is (a fresh node, a corrupt file set aside). A
        version-1 file not yet migrated and a newer plugin's file are left as they are."""
        if not self.legacy_path.exists():
            self.write_marker()

    def legacy_changed(self) -> bool:
        """Whether a version-1 file exists that the last scan() did not see (a plugin of that
        version, still running during a rolling update, wrote it)."""
        try:
            return _identity(self.legacy_path) != self._legacy_seen
        except FileNotFoundError:
            return False

    def migrate_legacy(self, records: dict[str, ClaimRecord]) -> list[CheckpointWriteError]:
        """Write version-1 records as version 2, then retire the version-1 file. A record
        that cannot be written is held in memory and the file stays, to be migrated again."""
        failed = []
        for record in records.values():
            try:
                self.put(record)
            except CheckpointWriteError as err:
                self.keep_in_memory(record)
                failed.append(err)
        if not failed:
            self.retire_legacy()
        return failed

    def _scan_legacy(self, result: ScanResult) -> None:
        try:
            self._legacy_seen = _identity(self.legacy_path)
            raw = self.legacy_path.read_bytes()
        except FileNotFoundError:
            self._legacy_seen = None
            return
        try:
            data = open_envelope(raw, SCHEMA_VERSION)
        except Unusable as err:
            if err.version is not None:
                result.legacy_status = "foreign"
                result.foreign.append(ForeignFile(self.legacy_path, err.version))
            else:
                result.legacy_status = "corrupt"
                result.corrupt.append(CorruptFile(self.legacy_path, err.reason))
            return
        if _is_marker(data):
            result.legacy_status = "marker"
            return
        if data.get("version") != LEGACY_VERSION:
            result.legacy_status = "corrupt"
            reason = f"version {data.get('version')!r} without the marker's fields"
            result.corrupt.append(CorruptFile(self.legacy_path, reason))
            return
        try:
            old = Checkpoint.model_validate(data)
        except ValidationError as exc:
            result.legacy_status = "corrupt"
            result.corrupt.append(CorruptFile(self.legacy_path, f"invalid content: {exc}"))
            return
        if old.boot_id == self.boot_id:
            result.legacy_status = "current"
            result.legacy.update(old.claims)
        else:
            result.legacy_status = "stale"
            result.stale += [(old.boot_id, r) for r in old.claims.values()]

    def _record_files(self) -> Iterator[Path]:
        for name in self._record_names():
            yield self.claims_dir / name

    def _record_names(self) -> list[str]:
        try:
            names = sorted(os.listdir(self._claims_dir))
        except FileNotFoundError:
            return []
        return [name for name in names if record_file_uid(name) is not None]

    def _read_cached(self, path: str, name: str) -> ClaimRecord | None:
        try:
            identity = _identity(path)
            with self._guard:
                known = self._cache.get(name)
            if known is not None and known[0] == identity:
                return known[1]
            with open(path, "rb") as handle:
                raw = handle.read()
        except FileNotFoundError:
            return None
        record: ClaimRecord | None = None
        try:
            boot_id, parsed = _parse_record(
                open_envelope(raw, SCHEMA_VERSION), record_file_uid(name)
            )
            record = parsed if boot_id == self.boot_id else None
        except Unusable as err:
            log.warning("ignoring checkpoint file %s: %s", path, err.reason)
        with self._guard:
            self._cache[name] = (identity, record)
        return record


def _record_name(uid: str) -> str:
    name = f"{uid}.json"
    if record_file_uid(name) is None:
        raise CheckpointError(
            f"claim uid {uid!r} cannot name a record file; allowed: 1-128 letters, digits "
            "and dashes"
        )
    return name


def _identity(path: str | Path) -> tuple[int, int, int]:
    # Every write is a rename of a fresh temp file, so any writer changes the inode.
    st = os.stat(path)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _parse_record(data: dict[str, Any], expected_uid: str | None) -> tuple[str, ClaimRecord]:
    if data.get("version") != SCHEMA_VERSION:
        raise Unusable(f"version {data.get('version')!r} in a version-{SCHEMA_VERSION} file")
    boot_id = data.get("boot_id")
    if not isinstance(boot_id, str) or not boot_id:
        raise Unusable("no boot_id")
    try:
        record = ClaimRecord.model_validate(data.get("claim"))
    except ValidationError as exc:
        raise Unusable(f"invalid content: {exc}") from exc
    if record.uid != expected_uid:
        raise Unusable(f"record of claim {record.uid} in the file of {expected_uid}")
    return boot_id, record
