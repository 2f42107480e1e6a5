"""Crash-safe record of the claims this node has prepared (or started to prepare).

The file is JSON: {"checksum": "sha256:<hex>", "data": {...}}, where the checksum covers the
canonical JSON of "data" (sorted keys, no whitespace). "data" carries the schema version, the
boot id of the node when it was written and one record per claim UID. Writes replace the file
atomically, so after a crash it holds either the previous or the new version.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from driver.atomic_file import atomic_write_bytes

log = logging.getLogger(__name__)

SCHEMA_VERSION: Final = 1
BOOT_ID_PATH: Final = Path("/proc/sys/kernel/random/boot_id")
_CHECKSUM_PREFIX: Final = "sha256:"


class ClaimState(enum.StrEnum):
    PREPARE_STARTED = "PrepareStarted"
    PREPARED = "Prepared"


class _Record(BaseModel):
    # extra="allow": during a rolling update an older plugin may rewrite a checkpoint that a
    # newer one extended; unknown fields must survive that round trip instead of failing it.
    model_config = ConfigDict(extra="allow", frozen=True)


class DeviceRecord(_Record):
    """A device handed out for a claim, as reported to the kubelet."""

    request_names: list[str] = Field(default_factory=list)
    pool_name: str
    device_name: str
    cdi_device_ids: list[str] = Field(default_factory=list)
    share_id: str | None = None
    # What the scheduler granted a share of a shared GPU, e.g. {"memory": "16Gi"}.
    consumed_capacity: dict[str, str] = Field(default_factory=dict)
    # Admin-access allocations (monitoring) may overlap with ordinary ones.
    admin_access: bool = False


class MigInstanceRecord(_Record):
    """A MIG partition created for a claim (destroyed again on unprepare). Recorded before it
    is created, so the ids are unknown until then; parent and placement identify it."""

    parent_uuid: str
    parent_index: int | None = None
    profile: str
    profile_id: int | None = None
    placement_start: int
    placement_size: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    uuid: str | None = None


class MpsShareRecord(_Record):
    """Per-claim MPS limits applied on a shared GPU."""

    gpu_uuids: list[str]
    # The GPU whose MPS daemon serves the claim; the daemon stops with its last claim.
    gpu_index: int | None = None
    pipe_dir: str | None = None
    active_thread_percentage: int | None = None
    pinned_memory_limits: dict[str, str] = Field(default_factory=dict)


class CreatedResources(_Record):
    """Everything prepare created on the node, so that unprepare or a restart can undo it."""

    cdi_spec_path: str | None = None
    mig_instances: list[MigInstanceRecord] = Field(default_factory=list)
    mps_share: MpsShareRecord | None = None
    # GPU index (as a string: JSON keys) -> time-slice interval this claim set.
    time_slices: dict[str, str] = Field(default_factory=dict)


class ClaimRecord(_Record):
    uid: str
    namespace: str
    name: str
    state: ClaimState
    devices: list[DeviceRecord] = Field(default_factory=list)
    created: CreatedResources = Field(default_factory=CreatedResources)


class Checkpoint(_Record):
    """The whole node state. Immutable: use with_claim/without_claim to derive a new one."""

    version: int = SCHEMA_VERSION
    boot_id: str
    claims: dict[str, ClaimRecord] = Field(default_factory=dict)

    def with_claim(self, record: ClaimRecord) -> Checkpoint:
        return self.model_copy(update={"claims": {**self.claims, record.uid: record}})

    def without_claim(self, uid: str) -> Checkpoint:
        return self.model_copy(
            update={"claims": {k: v for k, v in self.claims.items() if k != uid}}
        )


class CheckpointError(Exception):
    """The checkpoint file could not be used."""


class CorruptCheckpoint(CheckpointError):
    """Unparsable or checksum mismatch. The file has already been moved to moved_to."""

    def __init__(self, path: Path, moved_to: Path | None, reason: str) -> None:
        where = f"moved to {moved_to}" if moved_to else "could not be moved aside"
        super().__init__(f"checkpoint {path} is corrupt ({reason}); {where}")
        self.path = path
        self.moved_to = moved_to
        self.reason = reason


class UnsupportedCheckpointVersion(CheckpointError):
    """Written by a newer plugin. Left in place: a rollback must not destroy it."""


class LoadStatus(enum.Enum):
    MISSING = "missing"  # no file: a fresh, empty checkpoint for this boot
    CURRENT = "current"  # written during this boot
    STALE = "stale"  # written before the last reboot: what it records is gone


@dataclass(frozen=True)
class LoadResult:
    status: LoadStatus
    # For STALE this is the old content (still carrying the old boot id), so the caller can
    # log or clean up after it before it starts afresh with CheckpointStore.empty().
    checkpoint: Checkpoint


def _identity(path: Path) -> tuple[int, int, int]:
    # Every save is a rename of a fresh temp file, so a write by anyone changes the inode.
    st = os.stat(path)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def read_boot_id(path: Path = BOOT_ID_PATH) -> str:
    boot_id = path.read_text(encoding="ascii").strip()
    if not boot_id:
        raise CheckpointError(f"boot id file {path} is empty")
    return boot_id


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def checksum(data: Any) -> str:
    return _CHECKSUM_PREFIX + hashlib.sha256(canonical_json(data)).hexdigest()


class CheckpointStore:
    """Loads and saves the checkpoint file. Callers serialise access with PrepareLock."""

    def __init__(self, path: Path, boot_id_path: Path = BOOT_ID_PATH) -> None:
        self.path = path
        self.boot_id_path = boot_id_path
        self._boot_id: str | None = None
        # What we last read or wrote, keyed by the file's identity: while the file is the one
        # we know (same inode, mtime and size) a load needs no parse and no validation.
        self._known: tuple[tuple[int, int, int], Checkpoint] | None = None

    @property
    def boot_id(self) -> str:
        if self._boot_id is None:
            self._boot_id = read_boot_id(self.boot_id_path)
        return self._boot_id

    def empty(self) -> Checkpoint:
        return Checkpoint(boot_id=self.boot_id)

    def load(self) -> LoadResult:
        """Read the checkpoint. Raises CorruptCheckpoint (after moving the file aside)."""
        try:
            identity = _identity(self.path)
            if self._known is not None and self._known[0] == identity:
                return LoadResult(LoadStatus.CURRENT, self._known[1])
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return LoadResult(LoadStatus.MISSING, self.empty())
        checkpoint = self._parse(raw)
        if checkpoint.boot_id != self.boot_id:
            log.info(
                "checkpoint %s is from boot %s, this boot is %s: treating it as stale",
                self.path,
                checkpoint.boot_id,
                self.boot_id,
            )
            return LoadResult(LoadStatus.STALE, checkpoint)
        self._known = (identity, checkpoint)
        return LoadResult(LoadStatus.CURRENT, checkpoint)

    def save(self, checkpoint: Checkpoint) -> None:
        data = checkpoint.model_dump(mode="json")
        document = {"checksum": checksum(data), "data": data}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Compact: indenting would push json onto its pure-Python encoder (10x slower).
        atomic_write_bytes(self.path, canonical_json(document))
        self._known = (_identity(self.path), checkpoint)

    def _parse(self, raw: bytes) -> Checkpoint:
        try:
            document = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._corrupt(f"not JSON: {exc}") from exc
        if not isinstance(document, dict) or not isinstance(document.get("data"), dict):
            raise self._corrupt("no 'data' object")
        data = document["data"]
        if document.get("checksum") != checksum(data):
            raise self._corrupt("checksum mismatch")
        version = data.get("version")
        if isinstance(version, int) and version > SCHEMA_VERSION:
            raise UnsupportedCheckpointVersion(
                f"checkpoint {self.path} has schema version {version}; this plugin reads up "
                f"to {SCHEMA_VERSION}. It was left in place."
            )
        try:
            return Checkpoint.model_validate(data)
        except ValidationError as exc:
            raise self._corrupt(f"invalid content: {exc}") from exc

    def _corrupt(self, reason: str) -> CorruptCheckpoint:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        suffix = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}.{suffix}")
            suffix += 1
        moved: Path | None = target
        try:
            os.replace(self.path, target)
        except OSError as exc:
            log.error("cannot move corrupt checkpoint %s aside: %s", self.path, exc)
            moved = None
        error = CorruptCheckpoint(self.path, moved, reason)
        log.error("%s", error)
        return error
