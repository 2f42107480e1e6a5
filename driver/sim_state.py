"""What the simulated hardware remembers across plugin restarts, as real GPUs do: MIG mode,
MIG instances, compute mode, time slice, and GPUs that fell off the bus. Stored as JSON and
replaced atomically after every change."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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
