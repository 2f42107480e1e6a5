"""What the checkpoint records for each claim: its state, its devices, and everything prepare
created on the node (CDI spec, MIG partitions, MPS share, time slices), as pydantic models.
checkpoint.py stores them crash-safely; these models fix their JSON (and so their checksums)."""

from __future__ import annotations

import enum
from typing import Any, Final

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

SCHEMA_VERSION: Final = 2


class ClaimState(enum.StrEnum):
    PREPARE_STARTED = "PrepareStarted"
    PREPARED = "Prepared"


class EarlyStage(enum.StrEnum):
    """A claim's on-demand MIG partitions made before its pod was bound (binding
    conditions, early_partitions.py). Such a record keeps state PrepareStarted, so a plugin
    that does not know this field rolls it back (destroys the partitions) and prepares as
    before."""

    CREATING = "Creating"  # recorded before creation: may exist, half-made
    READY = "Ready"  # created; prepare takes them over


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
    """The MPS daemon a claim's clients use and the limits they got.

    Whole GPU: the GPU's daemon, shared by every claim on it, stopped with its last claim.
    MIG (``mig``): a daemon of the claim's own over its MIG devices (``devices``, by name),
    keyed by the first of their UUIDs (``gpu_uuids``, in UUID order: ordinal ``i`` of
    ``pinned_memory_limits`` is ``gpu_uuids[i]``). Those UUIDs are recorded once prepare
    knows them; until then (a partition not created yet) undo finds the daemon through the
    record's MIG instances."""

    gpu_uuids: list[str]
    # The GPU whose daemon serves the claim (for MIG, the parent of gpu_uuids[0]).
    gpu_index: int | None = None
    pipe_dir: str | None = None
    active_thread_percentage: int | None = None
    pinned_memory_limits: dict[str, str] = Field(default_factory=dict)
    mig: bool = False
    devices: list[str] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _only_mig_fields_in_use(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A whole-GPU share is written as plugins before MIG MPS wrote it, so its record
        # (and checksum) is unchanged and any plugin of this schema reads it as it did.
        data = handler(self)
        if isinstance(data, dict) and not self.mig:
            if not data.get("devices"):
                data.pop("devices", None)
            data.pop("mig", None)
        return data


class CreatedResources(_Record):
    """Everything prepare created on the node, so that unprepare or a restart can undo it."""

    cdi_spec_path: str | None = None
    mig_instances: list[MigInstanceRecord] = Field(default_factory=list)
    mps_share: MpsShareRecord | None = None
    # GPU index (as a string: JSON keys) -> time-slice interval this claim set.
    time_slices: dict[str, str] = Field(default_factory=dict)
    # The claim's device metadata folder (KEP-5304; metadata_files.py): one file per request.
    metadata_dir: str | None = None

    @model_serializer(mode="wrap")
    def _metadata_only_when_set(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Records without metadata (early partitions, records of earlier releases rebuilt or
        # migrated) are written as before: same bytes, same checksum.
        data = handler(self)
        if isinstance(data, dict) and data.get("metadata_dir") is None:
            data.pop("metadata_dir", None)
        return data


class ClaimRecord(_Record):
    uid: str
    namespace: str
    name: str
    state: ClaimState
    devices: list[DeviceRecord] = Field(default_factory=list)
    created: CreatedResources = Field(default_factory=CreatedResources)
    early: EarlyStage | None = None

    @model_serializer(mode="wrap")
    def _early_only_when_set(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Records without early partitions are written as before (same bytes, same checksum).
        data = handler(self)
        if isinstance(data, dict) and data.get("early") is None:
            data.pop("early", None)
        return data


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
