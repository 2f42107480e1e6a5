"""What the simulated hardware remembers across plugin restarts, as real GPUs do: MIG mode,
MIG instances, compute mode, time slice, MPS daemons, and GPUs that fell off the bus. Stored
as JSON and replaced atomically after every change."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)

from flexgpu.driver.atomic_file import atomic_write_text
from flexgpu.driver.gpu_model import ComputeMode, TimeSliceInterval


class SimulatedStateError(ValueError):
    """The state file is unreadable or belongs to another node or topology."""


class _State(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SimulatedMigInstance(_State):
    gpu_instance_id: int = Field(ge=0)
    compute_instance_id: int = Field(ge=0)
    profile_id: int
    start: int = Field(ge=0)
    size: int = Field(ge=1)
    uuid: str


class SimulatedMigMpsDaemon(_State):
    """An MPS control daemon of a claim's MIG devices on this GPU, with what it was started
    with, so tests can read back which devices and limits it got."""

    device_uuids: list[str]
    active_thread_percentage: int | None = None
    pinned_memory_mib: dict[str, int] = {}


class SimulatedGpuState(_State):
    mig_enabled: bool = False
    compute_mode: ComputeMode = ComputeMode.DEFAULT
    time_slice: TimeSliceInterval = TimeSliceInterval.DEFAULT
    lost: bool = False
    # Counts MIG creations so a re-created instance gets a fresh UUID.
    creations: int = 0
    mig_instances: list[SimulatedMigInstance] = []
    # A running MPS control daemon outlives the plugin, as the real one does.
    mps_running: bool = False
    mps_starts: int = 0
    # Daemons of MIG devices whose first device (by UUID) is on this GPU.
    mig_mps: list[SimulatedMigMpsDaemon] = []

    @model_serializer(mode="wrap")
    def _mig_mps_only_when_running(self, handler: SerializerFunctionWrapHandler) -> object:
        # Left out while none runs, so an older plugin (a rollback) still reads the file:
        # it forbids fields it does not know.
        data = handler(self)
        if isinstance(data, dict) and not self.mig_mps:
            data.pop("mig_mps", None)
        return data


class SimulatedNodeState(_State):
    format_version: Literal[1] = 1
    node_name: str
    topology: str
    gpus: list[SimulatedGpuState]


def load_state(path: Path) -> SimulatedNodeState | None:
    """The saved state, or ``None`` if there is none yet."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SimulatedStateError(f"cannot read {path}: {exc.strerror}") from None
    try:
        return SimulatedNodeState.model_validate(json.loads(text))
    except (ValueError, ValidationError) as exc:
        raise SimulatedStateError(f"{path}: not a valid simulated GPU state: {exc}") from None


def save_state(path: Path, state: SimulatedNodeState) -> None:
    atomic_write_text(path, state.model_dump_json(indent=2) + "\n")
