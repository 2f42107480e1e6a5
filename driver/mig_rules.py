"""The rules NVML enforces when a GPU instance is created, for the simulated backend."""

from __future__ import annotations

from collections.abc import Sequence

from flexgpu.driver.backend_errors import InsufficientResourcesError, InvalidArgumentError
from flexgpu.driver.gpu_model import MigPlacement, MigProfile
from flexgpu.driver.mig_catalog import COMPUTE_SLICES


def check_mig_fit(
    profile: MigProfile,
    placement: MigPlacement,
    existing: Sequence[tuple[MigProfile, MigPlacement]],
) -> None:
    """Raise unless an instance of ``profile`` can be created at ``placement`` next to
    ``existing`` instances.

    InvalidArgumentError: the profile does not offer that placement.
    InsufficientResourcesError: the profile's instance limit is reached, the memory slices
    overlap an existing instance, or the compute slices are used up.
    """
    if placement not in profile.placements:
        offered = ", ".join(f"{p.start}:{p.size}" for p in profile.placements)
        raise InvalidArgumentError(
            f"placement {placement.start}:{placement.size} not offered by profile "
            f"{profile.name}; allowed values: {offered}"
        )
    same_profile = sum(1 for other, _ in existing if other.profile_id == profile.profile_id)
    if same_profile >= profile.max_instances:
        raise InsufficientResourcesError(
            f"profile {profile.name} allows at most {profile.max_instances} instances"
        )
    for other, taken in existing:
        if placement.overlaps(taken):
            raise InsufficientResourcesError(
                f"placement {placement.start}:{placement.size} overlaps {other.name} at "
                f"{taken.start}:{taken.size}"
            )
    used = sum(other.compute_slices for other, _ in existing)
    if used + profile.compute_slices > COMPUTE_SLICES:
        raise InsufficientResourcesError(
            f"{profile.name} needs {profile.compute_slices} compute slices; "
            f"{COMPUTE_SLICES - used} free"
        )


def gpu_instance_id_for(placement: MigPlacement) -> int:
    """The GPU instance id NVML gives an instance at ``placement``.

    Ids number the nodes of the binary tree of memory-slice ranges: the whole GPU is 0, the two
    halves 1-2, the quarters 3-6, the eighths 7-14 (as `nvidia-smi mig -lgi` shows on A100 and
    H100). An id therefore names one placement, and two live instances never share one.
    """
    first_of_level = {8: 0, 4: 1, 2: 3, 1: 7}
    if placement.size not in first_of_level or placement.start % placement.size:
        raise InvalidArgumentError(f"placement {placement.start}:{placement.size} is not aligned")
    return first_of_level[placement.size] + placement.start // placement.size
